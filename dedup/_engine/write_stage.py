"""Steps 4 and 5 of a save: one statement writes a batch, one script call commits it.

The winners of claim batches go to the sink in ONE statement, keys sorted
(unsorted concurrent multi-row upserts deadlock). Their callers are answered as
soon as the rows are committed: ``write`` for the rows this statement inserted,
``db`` for those already there. Then one commit script call turns the leases into
"saved" markers. A write never outlives its lease: the statement is bounded by
``write_timeout_ms``, and a winner with too little lease left renews it first.
A failed write releases the leases, then fails its callers: nothing is
acknowledged that is not durable.
"""

from __future__ import annotations

import asyncio
import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import RedisError

from dedup._claims.protocol import Claims
from dedup._engine.degraded import DegradedMode
from dedup._engine.flights import Flight, FlightTable
from dedup.errors import Unavailable, WaitTimeout
from dedup.metrics import Stats
from dedup.types import BatchWriter, Row

__all__ = ["RowWriter", "WriteStage", "row_order", "write_rows"]

log = logging.getLogger("dedup")

row_order = operator.attrgetter("kind", "digest")
"""The order of a statement's rows (or of the flights they come from): by their unique
key, since unsorted concurrent multi-row upserts deadlock."""


async def write_rows(
    sink: BatchWriter,
    rows: list[Row],
    timeout_s: float,
    abandoned: set[asyncio.Future[Any]] | None = None,
) -> set[tuple[str, bytes]]:
    """One sink call, bounded by ``timeout_s`` (:class:`TimeoutError` past it): the keys
    of the rows it inserted.

    Unlike :func:`asyncio.wait_for`, which waits for the cancelled call to end, a sink
    that ignores cancellation is left to end on its own: a hung sink must not hold its
    caller past the bound. ``abandoned`` collects such calls while they still run.
    """
    call = asyncio.ensure_future(sink(rows))
    try:
        done, _ = await asyncio.wait((call,), timeout=timeout_s)
    except asyncio.CancelledError:
        call.cancel()
        raise
    if not done:
        call.cancel()
        call.add_done_callback(_retrieve)
        if abandoned is not None:
            abandoned.add(call)
            call.add_done_callback(abandoned.discard)
        raise TimeoutError(f"the statement took more than {timeout_s} s")
    return set(call.result())


def _retrieve(call: asyncio.Future[Any]) -> None:
    """Read an abandoned call's outcome, so that asyncio does not log it as never read."""
    if not call.cancelled():
        call.exception()


class RowWriter:
    """Step 4 alone: one key-sorted statement writes a batch and answers its callers.

    The normal write stage and degraded mode both write through it; it knows nothing
    of Redis.
    """

    __slots__ = ("_flights", "_sink", "_stats", "_write_timeout_s")

    def __init__(
        self, *, sink: BatchWriter, flights: FlightTable, stats: Stats, write_timeout_s: float
    ) -> None:
        self._sink = sink
        self._flights = flights
        self._stats = stats
        self._write_timeout_s = write_timeout_s

    async def insert(self, batch: list[Flight]) -> str | None:
        """One key-sorted INSERT of ``batch``; answers its callers ("write" for the rows
        this statement inserted, "db" for those already there) and returns None, or
        returns what went wrong and leaves the callers to be failed."""
        batch.sort(key=row_order)  # unsorted concurrent multi-row upserts deadlock
        rows = [f.row() for f in batch]
        stats = self._stats
        stats.db_statements += 1
        stats.db_rows_sent += len(rows)
        try:
            inserted = await write_rows(self._sink, rows, self._write_timeout_s)
        except Exception as exc:
            stats.db_errors += 1
            return "timed out" if isinstance(exc, TimeoutError) else f"failed: {exc!r}"
        resolve = self._flights.resolve
        created = 0
        for f in batch:
            if (f.kind, f.digest) in inserted:
                created += 1
                resolve(f, "write")
            else:
                resolve(f, "db")
        stats.write += created
        stats.db += len(batch) - created
        return None

    async def write_alone(self, batch: list[Flight]) -> None:
        """Degraded mode: one statement, and the unique key alone decides ``created``."""
        failure = await self.insert(batch)
        if failure is not None:
            self.fail(batch, failure)
        else:
            self._stats.degraded_answers += len(batch)

    def fail(self, batch: list[Flight], failure: str) -> None:
        """Fail the callers of ``batch``: the statement ``failure`` (what :meth:`insert`
        returned)."""
        message = f"the database write {failure}"
        for f in batch:
            self._flights.fail(f, lambda: Unavailable(message, component="database"))


class WriteStage:
    """Writes batches of winners through a :class:`RowWriter` and commits their leases.

    :meth:`split` first sets apart the winners whose lease is too short for a
    statement: they are for the caller to claim again (renewing the lease).
    """

    __slots__ = ("_announce", "_claims", "_degraded", "_flights", "_loop", "_renew_after_s",
                 "_rows", "_stats")  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        claims: Claims,
        rows: RowWriter,
        flights: FlightTable,
        stats: Stats,
        degraded: DegradedMode,
        lease_s: float,
        write_budget_s: float,
        announce: Callable[[list[Flight]], Sequence[Sequence[Any]]] | None = None,
    ) -> None:
        self._loop = loop
        self._claims = claims
        self._rows = rows
        self._flights = flights
        self._stats = stats
        self._degraded = degraded
        # A winner writes only if the statement can finish inside its lease with a margin.
        self._renew_after_s = lease_s - write_budget_s
        # Commands to send with a batch's commit, in its round trip: the fleet's
        # saved-values message, for the other gateways' local tiers (none outside one).
        self._announce = announce

    def split(self, batch: list[Flight]) -> tuple[list[Flight], list[Flight]]:
        """The winners of ``batch`` with lease enough left for a statement, and those
        with too little, to be claimed again (renewing the lease) before writing, or
        given up (:meth:`give_up`) once their callers' wait is over."""
        now = self._loop.time()
        limit = self._renew_after_s
        fresh = [f for f in batch if now - f.claimed_at <= limit]
        if len(fresh) == len(batch):
            return fresh, []
        stale = [f for f in batch if now - f.claimed_at > limit]
        self._stats.reclaims += len(stale)
        return fresh, stale

    async def run(self, batch: list[Flight]) -> None:
        """Write one batch of winners (from :meth:`split`), answer their callers, then
        commit their leases (and, in a fleet, announce their values as saved)."""
        keys = [f.key for f in batch]
        failure = await self._rows.insert(batch)
        if failure is not None:
            # Release the leases first, so that a caller retrying at once is not
            # racing our own release.
            await self._abort(keys)
            self._rows.fail(batch, failure)
            return
        if self._degraded.active:
            return  # Redis is skipped: the leases expire, the markers are not set
        try:
            announce = () if self._announce is None else self._announce(batch)
            if announce:
                _, held = await self._claims.commit_after(announce, keys)
            else:
                held = await self._claims.commit(keys)
            self._stats.lost_leases += len(keys) - held
        except (RedisError, OSError) as exc:
            # The rows are committed and the callers answered; a missing marker
            # only costs the next claimant a redundant (conflicting) insert.
            self._stats.redis_errors += 1
            self._degraded.redis_failed(exc)
            log.warning("could not mark %d saved values in Redis: %s", len(keys), exc)
        else:
            self._degraded.success()

    async def give_up(self, batch: list[Flight]) -> None:
        """Winners short of lease whose callers' deadline has passed: release their leases,
        then fail them with :class:`WaitTimeout`. A Redis whose claims come back later
        than the lease leaves room for would otherwise send them round for ever."""
        await self._abort([f.key for f in batch])
        self._stats.wait_timeouts += len(batch)
        message = "Redis answered too slowly to write this value within its lease in time"
        for f in batch:
            self._flights.fail(f, lambda: WaitTimeout(message))

    async def _abort(self, keys: list[bytes]) -> None:
        if self._degraded.active:
            return  # Redis is skipped; the leases expire on their own
        try:
            await self._claims.abort(keys)
        except (RedisError, OSError) as exc:
            self._stats.redis_errors += 1
            self._degraded.redis_failed(exc)
            log.warning("could not release %d leases (they expire anyway): %s", len(keys), exc)
