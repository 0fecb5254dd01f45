"""Step 2 of a save, singleflight: the table of values in flight in this process.

A value being claimed, waited on or written has one :class:`Flight`, shared by
every caller that asks for it meanwhile; each caller has a future of its own, so
a cancelled caller cancels only itself. :class:`FlightTable` starts flights,
answers their callers (``resolve``), fails them (``fail``, never cached: the next
save starts afresh), bounds them (``max_pending``) and fails them all at close.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from dedup._engine.local import SavedCache
from dedup.errors import Overloaded
from dedup.metrics import Stats
from dedup.types import Row, Source

__all__ = ["ErrorFactory", "Flight", "FlightTable"]

ErrorFactory = Callable[[], BaseException]
"""Makes the exception of one caller: one per caller, since a shared instance would
collect every caller's traceback."""


class Flight:
    """One value on its way through claim, wait and write; shared by its callers."""

    __slots__ = ("backoff", "claimed_at", "deadline", "digest", "done", "key", "kind",
                 "payload_json", "queued_until", "shared", "stamp", "value", "waiters")  # fmt: skip

    def __init__(
        self,
        key: bytes,
        kind: str,
        value: str,
        digest: bytes,
        payload_json: str | None,
        waiter: asyncio.Future[Source],
        deadline: float,
        stamp: int = 0,
    ) -> None:
        self.key = key
        self.kind = kind
        self.value = value
        self.digest = digest
        self.payload_json = payload_json
        # One future per caller: a cancelled caller cancels only its own future,
        # never the work the others share.
        self.waiters = [waiter]
        self.done = False
        self.deadline = deadline
        self.claimed_at = 0.0
        self.backoff = 0.0
        self.queued_until = 0.0  # degraded mode: Overloaded if not written by then
        self.shared = False  # its row went to the fleet's writer once (dedup._engine.shared)
        # The local tier's stamp at the start: an answer that comes after the value was
        # invalidated (forgotten) is given, but not remembered (SavedCache.add).
        self.stamp = stamp

    def row(self) -> Row:
        """The row whose insert saves this value."""
        return Row(self.kind, self.digest, self.value, self.payload_json)


class FlightTable:
    """The in-flight map of one Gateway: at most one :class:`Flight` per key.

    ``start`` receives each new flight (the claim queue); ``local`` learns every
    value answered as saved.
    """

    __slots__ = ("_local", "_loop", "_stats", "_wait_timeout_s", "inflight", "max_pending",
                 "start")  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        max_pending: int,
        wait_timeout_s: float,
        local: SavedCache,
        stats: Stats,
        start: Callable[[Flight], None],
    ) -> None:
        self._loop = loop
        self._local = local
        self._stats = stats
        self._wait_timeout_s = wait_timeout_s
        self.inflight: dict[bytes, Flight] = {}
        self.max_pending = max_pending
        self.start = start

    def __len__(self) -> int:
        return len(self.inflight)

    def join(
        self, key: bytes, kind: str, value: str, digest: bytes, payload_json: str | None
    ) -> tuple[asyncio.Future[Source], bool]:
        """Join the value's flight, or start one: the caller's future, and whether shared."""
        loop = self._loop
        flight = self.inflight.get(key)
        if flight is not None:
            waiter: asyncio.Future[Source] = loop.create_future()
            flight.waiters.append(waiter)
            return waiter, True
        if len(self.inflight) >= self.max_pending:
            self._stats.overloaded += 1
            raise Overloaded("too many saves in flight; retry later")
        fut: asyncio.Future[Source] = loop.create_future()
        flight = Flight(
            key,
            kind,
            value,
            digest,
            payload_json,
            fut,
            loop.time() + self._wait_timeout_s,
            self._local.generation,
        )
        self.inflight[key] = flight
        self.start(flight)
        return fut, False

    def admit(self, count: int) -> None:
        """Raise :class:`Overloaded` unless ``count`` more values fit under ``max_pending``."""
        if count > self.max_pending:
            raise Overloaded(f"a batch of {count} items exceeds max_pending")
        if len(self.inflight) + count > self.max_pending:
            self._stats.overloaded += 1
            raise Overloaded("too many saves in flight; retry later")

    def resolve(self, f: Flight, source: Source) -> None:
        """The value is saved: answer every caller with ``source`` and remember it locally."""
        if self.inflight.get(f.key) is f:
            del self.inflight[f.key]
        self._local.add(f.kind, f.digest, f.stamp)
        f.done = True
        for waiter in f.waiters:
            if not waiter.done():  # a cancelled caller's future is done already
                waiter.set_result(source)

    def fail(self, f: Flight, error: ErrorFactory) -> None:
        """The save failed: every caller gets an exception of its own from ``error``."""
        # Failures are not cached: the next save of the value starts afresh.
        if self.inflight.get(f.key) is f:
            del self.inflight[f.key]
        f.done = True
        for waiter in f.waiters:
            if not waiter.done():
                waiter.set_exception(error())

    def fail_all(self, error: ErrorFactory) -> None:
        """Fail every flight still in the table (at close)."""
        for flight in list(self.inflight.values()):
            self.fail(flight, error)
        self.inflight.clear()
