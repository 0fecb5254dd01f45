"""The Gateway: the public face of the exactly-once save path.

A save goes through five steps, each in a module of its own:

1. the local tier, values known saved in this process (:mod:`dedup._engine.local`, inline
   in :meth:`Gateway.save`) -> ``local``;
2. singleflight: the same value already in flight here shares its flight
   (:mod:`dedup._engine.flights`) -> ``inflight``;
3. a claim batch: every claim made during one event-loop tick goes to Redis in one
   script call (:mod:`dedup._engine.batcher`, :mod:`dedup._engine.claim_stage`), which answers per
   value saved (``redis``), won (lease held) or busy; busy values wait and are
   claimed again (:mod:`dedup._engine.wait_queue`);
4. a write batch: the winners go to the sink in ONE statement, keys sorted, and
   their callers are answered once the rows are committed (``write`` or ``db``);
5. a commit batch: one script call marks the values saved (both in
   :mod:`dedup._engine.write_stage`).

When Redis cannot serve, degraded mode (:mod:`dedup._engine.degraded`) lets the database's
unique key decide alone, under admission control. :mod:`dedup._engine.backends` opens
and closes the servers and connections, :mod:`dedup._engine.wiring` wires the stages, and
:mod:`dedup.options` holds every option.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from hashlib import blake2b
from time import monotonic
from types import TracebackType
from typing import Any, NamedTuple, Unpack, get_args

from redis.exceptions import RedisError

from dedup._claims.keys import KeySpace
from dedup._engine.backends import Backends
from dedup._engine.local import SavedCache
from dedup._engine.once import RunOnceMixin
from dedup._engine.parts import EngineParts
from dedup._engine.wiring import Engine
from dedup._redis.connect import unlink_matching
from dedup._values import DIGEST_BYTES, Limits, encode_payload, validate_kind, validate_value
from dedup.errors import ConfigError, DedupError, InvalidInput, Unavailable
from dedup.metrics import Stats
from dedup.options import GatewayOptions, GatewayOptionsKwargs
from dedup.store import DefaultSink
from dedup.tracing import (
    CREATED_COUNT,
    DELETED_COUNT,
    FORGOTTEN_COUNT,
    ITEMS,
    KIND,
    sink_system,
    span,
    trace_save,
    trace_tracer,
)
from dedup.types import Item, Reconciled, SaveResult, Source

__all__ = ["Gateway"]

# One shared result per source: created exactly when this call's own write inserted it.
_RESULTS: dict[Source, SaveResult] = {s: SaveResult(s == "write", s) for s in get_args(Source)}
_LOCAL = _RESULTS["local"]
_INFLIGHT = _RESULTS["inflight"]


class _Pending(NamedTuple):
    """A save that :meth:`Gateway._save_begin` could not answer without I/O."""

    kind: str
    value: str
    digest: bytes
    payload_json: str | None


class Gateway(RunOnceMixin):
    """Saves each value of a kind exactly once, keeping duplicate traffic off the database.

    With no URLs it runs the embedded default: a private redis-server on a unix
    socket and a SQLite file, both under ``data_dir``. Use it as an async context
    manager (or call :meth:`open` and :meth:`aclose`).

    :meth:`once`, :meth:`get` and :meth:`filter` come from
    :class:`dedup._engine.once.RunOnceMixin`.

    Every option is a keyword argument; :class:`dedup.options.GatewayOptions` holds
    their defaults and checks (a bad one raises :class:`~dedup.errors.ConfigError`
    here, before any I/O; an unknown name, :class:`TypeError`), and the option
    table of the Configuration page (``docs/configuration.md``) describes each.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        database_url: str | None = None,
        **options: Unpack[GatewayOptionsKwargs],
    ) -> None:
        for name in options:
            if name not in GatewayOptionsKwargs.__optional_keys__:
                raise TypeError(f"Gateway() got an unexpected keyword argument {name!r}")
        # Every keyword is an option of the same name: one place checks them all.
        self.options = checked = GatewayOptions(redis_url, database_url, **options)
        """The checked options (:class:`dedup.options.GatewayOptions`)."""
        try:
            self._keys = KeySpace(
                checked.namespace, cluster_shards=checked.shards, secret=checked.secret
            )
            self._limits = Limits(
                max_value_bytes=checked.max_value_bytes,
                max_payload_bytes=checked.max_payload_bytes,
            )
            self._local = SavedCache(checked.local_cache_size)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self._stats = Stats()
        self._kinds_ok: set[str] = set()
        self._backends = Backends(checked, self._keys, self._stats)
        self._engine: Engine | None = None
        self._parts_made: tuple[Engine, EngineParts] | None = None
        self._state = "new"
        # db.system.name of the spans of answers from the sink (dedup.tracing).
        self._sink_system = sink_system(checked.database_url, checked.sink is not None)

    # ----------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Gateway:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Start or connect to Redis and the database, and check Redis is safe to use.

        A Redis that cannot be reached does not stop it (unless ``require_redis``):
        the Gateway starts degraded and uses Redis once it answers and passes the
        eviction check.
        """
        if self._state != "new":
            raise DedupError("a Gateway can be opened once")
        self._state = "opening"
        try:
            await self._backends.open()
            self._engine = Engine(
                asyncio.get_running_loop(), self.options, self._backends, self._local, self._stats
            )
            if not self._engine.degraded.active:
                # The local tier answers only while its invalidation channel is heard:
                # wait (briefly) for that, so that repeats are local from the start.
                await self._engine.invalidations.ready(self.options.redis_timeout_s)
        except BaseException:
            # Cancelled or failed after the engine started (its tasks hold connections):
            # stop it before closing what it uses.
            engine, self._engine = self._engine, None
            try:
                if engine is not None:
                    await engine.stop()
            finally:
                await self._backends.aclose()
                self._state = "closed"
            raise
        self._state = "open"

    async def aclose(self, *, drain_timeout_s: float | None = None) -> None:
        """Stop taking saves, let saves in flight finish (bounded), then close everything.

        Saves still unfinished after ``drain_timeout_s`` (default: ``wait_timeout_s``)
        fail with :class:`DedupError`; leases they held expire on their own. Saves
        answered already have their values marked saved in Redis within the same bound.
        """
        if self._state in ("closing", "closed"):
            return
        self._state = "closing"
        engine = self._engine
        try:
            if engine is not None and (engine.flights.inflight or engine.settling):
                timeout = (
                    self.options.wait_timeout_s if drain_timeout_s is None else drain_timeout_s
                )
                loop = asyncio.get_running_loop()
                deadline = loop.time() + timeout
                # Wait for the flights, not the callers: a flight whose callers were all
                # cancelled still holds a lease until it finishes. Then for the batches:
                # the markers' commit follows the answers, and cut off it would leave
                # the values leased (busy to every gateway) until their leases expire.
                # Polled, as this runs only at close, where an Event set on every
                # resolve would tax the hot path.
                while (  # noqa: ASYNC110
                    engine.flights.inflight or engine.settling
                ) and loop.time() < deadline:
                    await asyncio.sleep(0.005)
        finally:
            try:
                if engine is not None:
                    await engine.stop()
            finally:
                await self._backends.aclose()
                self._state = "closed"

    # ----------------------------------------------------------------- public API

    def stats(self) -> Stats:
        """A snapshot of the counters (answers per tier, round trips, statements, rows)."""
        return self._stats.copy()

    @property
    def degraded(self) -> bool:
        """True while Redis is skipped (the circuit is open or half-open): saves are
        decided by the database's unique key alone, under admission control."""
        return self._engine is not None and self._engine.degraded.active

    @property
    def degraded_reason(self) -> str:
        """Why Redis is skipped (empty while it is not): ``unreachable``, ``oom`` (full),
        ``readonly`` (a replica) or ``misconf`` (snapshots failing)."""
        return self._engine.degraded.reason if self.degraded and self._engine else ""

    @property
    def pending(self) -> int:
        """Values in flight in this process (claimed, waiting or being written)."""
        return 0 if self._engine is None else len(self._engine.flights)

    async def save(self, kind: str, value: str, payload: Any = None) -> SaveResult:
        """Save ``value`` of ``kind`` once; return when its row is committed.

        ``created`` is True only for the call whose own write inserted the row.
        ``payload`` (JSON-serialisable) is stored with the row the first time.
        Raises :class:`InvalidInput`, :class:`Unavailable`, :class:`WaitTimeout`,
        :class:`Overloaded`, or :class:`DedupError` when the Gateway is not open.
        """
        begun = self._save_begin(kind, value, payload)
        if isinstance(begun, _Pending):
            return await self._save_finish(begun)
        return begun  # a local answer: no span (dedup.tracing)

    def _save_begin(self, kind: str, value: str, payload: Any = None) -> SaveResult | _Pending:
        """The part of :meth:`save` that needs no I/O: the answer when this process
        knows it already (its local tier: ``source="local"``), else what
        :meth:`_save_finish` takes to go on. Raises what :meth:`save` raises.

        For the service (:mod:`dedup.service.app`), which answers a request from the
        protocol's callback when it can, with no task: ``save(k, v, p)`` is exactly
        ``_save_begin(k, v, p)`` then, unless that was a :class:`SaveResult`,
        ``await _save_finish(...)`` of what it returned.
        """
        # The common case inline (this is the hot path); the validators give the errors.
        if type(kind) is not str or kind not in self._kinds_ok:
            self._kind_ok(validate_kind(kind))
        if type(value) is not str:
            validate_value(value, self._limits)
        local_ok = monotonic() < self._local.until  # the tier hears its invalidations
        if payload is None and local_ok and self._state == "open":
            # A repeat of a value lately answered locally, found by its text (SavedCache
            # fronts): the same text was checked then, so it is valid now.
            front = self._local.fronts.get(kind)
            if front is not None and value in front:
                self._stats.local += 1
                return _LOCAL
        try:
            raw = value.encode()
        except UnicodeEncodeError:
            raw = b"\x00"  # refused below with the validator's message
        if len(raw) > self._limits.max_value_bytes or b"\x00" in raw:
            validate_value(value, self._limits)
        digest = blake2b(raw, digest_size=DIGEST_BYTES).digest()
        payload_json = None if payload is None else encode_payload(payload, self._limits)
        if self._state != "open" or self._engine is None:
            raise DedupError(f"the Gateway is {self._state}, not open")
        salt = self._local.salts.get(kind)
        if salt is not None and local_ok:  # the tier inline (SavedCache.__contains__)
            saved = self._local.entries
            local_key = salt ^ int.from_bytes(digest, "little")
            if saved.pop(local_key, 0) is None:  # found: now the most recently used
                saved[local_key] = None
                self._stats.local += 1
                self._local.promote(kind, value, local_key)
                return _LOCAL
        return _Pending(kind, value, digest, payload_json)

    def _save_finish(self, pending: _Pending) -> Awaitable[SaveResult]:
        """The rest of a :meth:`save` that :meth:`_save_begin` could not answer, to await:
        in a ``dedup.save`` span while a tracer provider is set (:mod:`dedup.tracing`).
        Not a coroutine itself, so that an untraced save makes no second one."""
        tracer = trace_tracer()
        if tracer is None:
            return self._save_flight(pending)
        return trace_save(tracer, pending.kind, self._save_flight(pending), self._sink_system)

    async def _save_flight(self, pending: _Pending) -> SaveResult:
        engine = self._engine
        if self._state != "open" or engine is None:
            raise DedupError(f"the Gateway is {self._state}, not open")
        kind, value, digest, payload_json = pending
        fut, shared = engine.flights.join(
            self._keys.key(kind, digest), kind, value, digest, payload_json
        )
        source = await fut
        if shared:
            self._stats.inflight += 1
            return _INFLIGHT
        return _RESULTS[source]

    async def save_many(self, items: Iterable[Item]) -> list[SaveResult]:
        """Save a batch; one result per item, in order.

        Every item is validated before any work: one bad item raises
        :class:`InvalidInput` naming its index, and nothing is saved. If Redis or
        the database fails midway the call raises; values committed before the
        failure answer ``created=False`` on retry.
        """
        tracer = trace_tracer()
        if tracer is None:
            return await self._save_many(items)
        with span(tracer, "dedup.save_many") as current:
            results = await self._save_many(items)
            current.set_attribute(ITEMS, len(results))
            current.set_attribute(CREATED_COUNT, sum(r.created for r in results))
            return results

    async def _save_many(self, items: Iterable[Item]) -> list[SaveResult]:
        if isinstance(items, str | bytes | dict) or not hasattr(items, "__iter__"):
            # A string or a mapping iterates, but never as items: refuse it as a whole.
            raise InvalidInput(
                f"items must be an iterable of tuples, not {type(items).__name__}", field="items"
            )
        checked: list[tuple[str, str, bytes, str | None]] = []
        for index, item in enumerate(items):
            if not isinstance(item, tuple) or len(item) not in (2, 3):
                raise InvalidInput(
                    "each item must be a tuple (kind, value) or (kind, value, payload)",
                    index=index,
                )
            kind = validate_kind(item[0], index)
            digest = validate_value(item[1], self._limits, index)
            payload_json = encode_payload(item[2], self._limits, index) if len(item) == 3 else None
            checked.append((kind, item[1], digest, payload_json))
        engine = self._engine
        if self._state != "open" or engine is None:
            raise DedupError(f"the Gateway is {self._state}, not open")
        engine.flights.admit(len(checked))
        waits: list[tuple[int, asyncio.Future[Source], bool]] = []
        results: list[SaveResult] = [_LOCAL] * len(checked)
        local, join, key = self._local, engine.flights.join, self._keys.key
        for i, (kind, value, digest, payload_json) in enumerate(checked):
            if (kind, digest) in local:
                self._stats.local += 1
            else:
                waits.append((i, *join(key(kind, digest), kind, value, digest, payload_json)))
        if not waits:
            return results
        outcomes = await asyncio.gather(*(f for _, f, _ in waits), return_exceptions=True)
        error: BaseException | None = None
        for (i, _, shared), outcome in zip(waits, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                error = error or outcome
            elif shared:
                self._stats.inflight += 1
                results[i] = _INFLIGHT
            else:
                results[i] = _RESULTS[outcome]
        if error is not None:
            raise error
        return results

    async def forget(self, kind: str, value: str) -> bool:
        """Forget ``value`` of ``kind``: delete its row, clear its marker and take it out
        of every gateway's local tier; True if a row was deleted.

        Returns after the row is gone (about a second: every gateway must have read the
        invalidation first; see the Guarantees page). A save racing it ends with the row
        and its marker, or with neither. A save of the value in flight ends first.
        Raises :class:`InvalidInput`, :class:`Unavailable` (also while degraded: Redis
        must be reachable), :class:`WaitTimeout`, :class:`CannotForget` (approximate
        mode, a custom sink), or :class:`DedupError` when the Gateway is not open.
        """
        checked = (validate_kind(kind), validate_value(value, self._limits))
        tracer = trace_tracer()
        if tracer is None:
            return (await self._forget_checked([checked]))[0]
        with span(tracer, "dedup.forget", {KIND: kind, ITEMS: 1}) as current:
            forgotten = (await self._forget_checked([checked]))[0]
            current.set_attribute(FORGOTTEN_COUNT, int(forgotten))
            return forgotten

    async def forget_many(self, items: Iterable[tuple[str, str]]) -> list[bool]:
        """:meth:`forget` of many values at once (one wait for them all); one bool per
        item, in order: True where this call deleted a row (a value given twice is
        True once). Every item is validated first: one bad item raises
        :class:`InvalidInput` naming its index, and nothing is forgotten."""
        if isinstance(items, str | bytes | dict) or not hasattr(items, "__iter__"):
            raise InvalidInput(
                f"items must be an iterable of (kind, value) tuples, not {type(items).__name__}",
                field="items",
            )
        checked: list[tuple[str, bytes]] = []
        for index, item in enumerate(items):
            if not isinstance(item, tuple) or len(item) != 2:
                raise InvalidInput("each item must be a tuple (kind, value)", index=index)
            kind = validate_kind(item[0], index)
            checked.append((kind, validate_value(item[1], self._limits, index)))
        tracer = trace_tracer()
        if tracer is None:
            return await self._forget_checked(checked)
        with span(tracer, "dedup.forget", {ITEMS: len(checked)}) as current:
            results = await self._forget_checked(checked)
            current.set_attribute(FORGOTTEN_COUNT, sum(results))
            return results

    async def _forget_checked(self, checked: list[tuple[str, bytes]]) -> list[bool]:
        """Forget validated ``(kind, digest)`` pairs: every kind at once (one wait)."""
        forgetter = self._require_engine().forgetter
        forgetter.check()
        by_kind: dict[str, dict[bytes, None]] = {}
        for kind, digest in checked:
            by_kind.setdefault(kind, {})[digest] = None
        outcomes = await asyncio.gather(
            *(forgetter.forget(kind, list(digests)) for kind, digests in by_kind.items())
        )
        deleted = dict(zip(by_kind, outcomes, strict=True))
        results: list[bool] = []
        for kind, digest in checked:
            gone = deleted[kind]
            results.append(digest in gone)
            gone.discard(digest)  # a value given twice: True for the first only
        return results

    async def prune(
        self,
        kind: str,
        older_than_s: float,
        *,
        batch_size: int = 1000,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Forget every value of ``kind`` whose row is older than ``older_than_s`` seconds
        (by the database's clock), in batches of ``batch_size``; returns how many rows
        were deleted. Each batch is a :meth:`forget_many`: markers and local entries go
        too, and it is safe while the fleet saves (a row saved after the cutoff is never
        deleted). ``progress(done, total)`` is called after each batch. Stopped midway,
        it can simply be run again: it goes on with the rows left."""
        kind = validate_kind(kind)
        if (
            isinstance(older_than_s, bool)
            or not isinstance(older_than_s, int | float)
            or not (0 < older_than_s < float("inf"))
        ):
            raise InvalidInput(
                "older_than_s must be a positive number of seconds", field="older_than_s"
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidInput("batch_size must be a positive int", field="batch_size")
        forgetter = self._require_engine().forgetter
        tracer = trace_tracer()
        if tracer is None:
            return await forgetter.prune(
                kind, older_than_s, batch_size=batch_size, progress=progress
            )
        with span(tracer, "dedup.prune", {KIND: kind}) as current:
            deleted = await forgetter.prune(
                kind, older_than_s, batch_size=batch_size, progress=progress
            )
            current.set_attribute(DELETED_COUNT, deleted)
            return deleted

    async def reconcile(self) -> Reconciled:
        """Make the markers true to the database again, after it lost rows in a way no
        gateway could see (a dump reloaded, a SQLite file put back): drain the
        tombstones of rows deleted outside dedup, reset every marker of the namespace
        (every gateway moves to a new marker epoch and drops its local tier), wait until
        every gateway has (about two seconds), then delete the old markers. Safe while
        the fleet saves: after it, each value's next save goes to the database once, and
        the unique key decides. Gateways notice SQL deletes, restores, point-in-time
        recoveries and failovers by themselves (Guarantees, in the docs)."""
        engine = self._require_engine()
        if engine.degraded.active:
            raise Unavailable(
                "Redis is unavailable (degraded mode): the markers cannot be reset now",
                component="redis",
            )
        try:
            return await engine.guardian.reconcile()
        except (RedisError, OSError) as exc:
            raise Unavailable(f"Redis failed: {exc!r}", component="redis") from None

    async def purge(self, kinds: Sequence[str]) -> None:
        """Delete this namespace's Redis keys and the default table's rows of ``kinds``.

        For demos and tests that must start empty; never needed in normal use. The keys
        are matched by the namespace's prefix, so those of a namespace nested under this
        one (``<namespace>:...``, whose leases and markers live on) go too.
        """
        sink, client = self._require_default_sink(), self._backends.redis
        assert client is not None  # open with the default sink: Redis is connected
        if self.pending:
            raise DedupError("purge needs a quiet Gateway: saves are in flight")
        await unlink_matching(client, self._keys.match_pattern)
        self._local.clear()
        await sink.delete(kinds)

    async def count_rows(self, kinds: Sequence[str]) -> int:
        """How many rows the default table holds for ``kinds`` (a query, not a counter)."""
        return await self._require_default_sink().count(kinds)

    async def ping(self, timeout_s: float = 1.0) -> dict[str, bool]:
        """Whether Redis and the database answer right now: ``{"redis", "database"}``.

        Both are checked at once, each bounded by ``timeout_s``: a PING to Redis and
        a count of no kinds (an index probe that also proves the table exists) on
        the default sink. A custom sink is not probed (``"database"`` is True).
        A closed Gateway answers False for both. Never raises for an unreachable server.
        """
        engine = self._engine
        if self._state != "open" or engine is None:
            return {"redis": False, "database": False}
        return await self._backends.ping(timeout_s, engine.degraded)

    # ----------------------------------------------------------------- internals

    def _kind_ok(self, kind: str) -> None:
        if len(self._kinds_ok) < 4096:  # kinds are few; bound the set anyway
            self._kinds_ok.add(kind)

    def _parts(self) -> EngineParts:
        """The open Gateway's parts, for :mod:`dedup._engine.once`; DedupError when not open."""
        backends, engine = self._backends, self._engine
        if self._state != "open" or engine is None:
            raise DedupError(f"the Gateway is {self._state}, not open")
        made = self._parts_made
        if made is not None and made[0] is engine:
            return made[1]  # built once per open Gateway: every run-once call asks for them
        assert backends.claims is not None and backends.sink is not None
        parts = EngineParts(
            keys=self._keys,
            limits=self._limits,
            claims=backends.claims,
            sink=backends.sink,
            default_sink=backends.default_sink,
            local=self._local,
            stats=self._stats,
            lease_ms=self.options.lease_ms,
            wait_timeout_s=self.options.wait_timeout_s,
            write_timeout_s=self.options.write_timeout_s,
            degraded=lambda: engine.degraded.active,
        )
        self._parts_made = (engine, parts)
        return parts

    def _require_engine(self) -> Engine:
        engine = self._engine
        if self._state != "open" or engine is None:
            raise DedupError(f"the Gateway is {self._state}, not open")
        return engine

    def _require_default_sink(self) -> DefaultSink:
        if self._backends.default_sink is None or self._state != "open":
            raise DedupError("this needs an open Gateway with the default sink")
        return self._backends.default_sink


# help(Gateway) and inspect.signature list every option with its default, from the
# one place the defaults are written.
Gateway.__init__.__signature__ = GatewayOptions.gateway_signature()  # type: ignore[attr-defined]
