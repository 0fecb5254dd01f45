"""Run-once functions, the saved-payload read path and stream filtering.

Three methods of :class:`dedup.Gateway` live here, in :class:`RunOnceMixin`, which
the Gateway inherits (as redis-py's command mixins are written: each method's
``self`` is typed by a Protocol, :class:`RunOnceHost`, naming what it needs):

* :meth:`RunOnceMixin.once`: a decorator that runs an ``async def`` function at most
  once per value across every process sharing the Redis and the database, and
  stores its JSON return value as the row's payload;
* :meth:`RunOnceMixin.get`: the saved payload of a value (a database read), or None;
* :meth:`RunOnceMixin.filter`: an async iterator over a stream that yields only the
  items whose save created the row, saving them in batches through ``save_many``.

The claim/run/commit machinery of ``once`` (:func:`begin` and :class:`Lease`) is
shared with the blocking facade (:mod:`dedup.sync`) and the ingest middlewares
(:mod:`dedup.asgi`, :mod:`dedup.aiohttp`, :mod:`dedup.wsgi`). It works through the
Gateway's :class:`~dedup._engine.parts.EngineParts` and its public methods only, and
keeps its per-Gateway state (:class:`RunOnceState`) on the Gateway itself.

What "once" means here: the function runs under the value's lease (the same lease
as a save's, renewed every third of ``lease_ms`` while it runs); only after it
returned is the row written and the value marked saved. A runner that dies before
that commit (after the side effect, say) leaves the value unsaved, and the next
call runs the function again: at most once per value while runners live, at least
once overall.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import random
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    Awaitable,
    Callable,
    Iterable,
)
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

import orjson
from redis.exceptions import RedisError

from dedup._engine.keyed_batches import Batched, gated_call
from dedup._engine.write_stage import row_order, write_rows
from dedup._values import encode_payload, validate_kind, validate_value
from dedup.errors import DedupError, InvalidInput, Unavailable, WaitTimeout
from dedup.types import Item, Row, SaveResult

if TYPE_CHECKING:
    from dedup._engine.parts import EngineParts
    from dedup.store import DefaultSink

__all__ = [
    "Lease",
    "RunOnceHost",
    "RunOnceMixin",
    "RunOnceState",
    "Saved",
    "begin",
    "run_once",
    "value_of",
]

log = logging.getLogger("dedup")

_P = ParamSpec("_P")
_T = TypeVar("_T")

# Busy values are looked at again after a jittered, growing pause: short at first (a
# runner often finishes quickly), never longer than this, so a takeover after the
# lease expires is not delayed much.
_FIRST_POLL_S = 0.01
_MAX_POLL_S = 0.2
# Calls of a combined run-once batch (claim and read, write and mark) in flight at once.
_LANES = 4


class RunOnceState:
    """What the run-once machinery keeps per open Gateway (held by the Gateway, built
    on first use, as it needs the open Gateway's claims).

    ``running``: the values being run here, each with a future done when the run
    ends. Every run-once call of one Gateway claims under the same token (a re-claim
    of its own lease answers "won"), so two calls of one process meet here, not in
    Redis. That token is not the one of the Gateway's saves: a ``save()`` of a value
    being run here waits for the run as a save in another process does, rather than
    re-claim the run's lease as its own and write the row under it.

    ``claim``, ``commit``, ``abort`` and ``reclaim`` (see :func:`begin`) batch the
    Redis scripts of concurrent runs and ``fetch`` their row reads (one ``SELECT`` a
    batch), so that N concurrent runs cost a few statements, not 2N.

    The two steps of a new value's run go as two batches: ``claim_read`` claims a
    batch and reads the rows of the claims won (or found saved) in one go, and
    ``store`` writes a batch of leases' rows (one key-sorted ``INSERT``, as the write
    stage's) and marks them saved. Each caller waits
    once for each, not once per round trip: a run's CPU, not its round trips, is what
    a busy process pays for.
    """

    __slots__ = ("abort", "claim", "claim_read", "commit", "fetch", "leases", "reclaim",
                 "renewer", "running", "store")  # fmt: skip

    def __init__(self, parts: EngineParts) -> None:
        claims = parts.claims.under_own_token()
        gate = asyncio.Semaphore(1)
        stats = parts.stats

        async def claim(keys: list[bytes]) -> list[str]:
            return list(await claims.claim(keys))

        async def commit(keys: list[bytes]) -> list[str]:
            await claims.commit(keys)
            return [""] * len(keys)

        async def abort(keys: list[bytes]) -> list[str]:
            await claims.abort(keys)
            return [""] * len(keys)

        async def reclaim(keys: list[bytes]) -> list[str]:
            return list(await claims.reclaim(keys))

        async def fetch(keys: list[tuple[str, bytes]]) -> list[tuple[bool, str | None]]:
            found = await fetch_rows(keys)
            return [(key in found, found.get(key)) for key in keys]

        async def write(rows: list[Row]) -> list[bool]:
            # One row per key in a statement (two runs of one key can only meet here
            # after a lost lease): the first decides, the others are not inserted by it.
            first: dict[tuple[str, bytes], Row] = {}
            for row in rows:
                first.setdefault((row.kind, row.digest), row)
            batch = sorted(first.values(), key=row_order)
            stats.db_statements += 1
            stats.db_rows_sent += len(batch)
            try:
                inserted = await write_rows(parts.sink, batch, parts.write_timeout_s)
            except Exception:
                stats.db_errors += 1
                raise
            return [
                (row.kind, row.digest) in inserted and first[(row.kind, row.digest)] is row
                for row in rows
            ]

        async def redis(call: Callable[[list[bytes]], Awaitable[Any]], keys: list[bytes]) -> Any:
            # The Redis step of a combined batch: gated and retried as a Batched call is.
            return await gated_call(call, keys, gate)

        async def claim_read(
            keys: list[tuple[bytes, str, bytes]],
        ) -> list[tuple[str, bool, str | None]]:
            try:
                letters = await redis(claims.claim, [key for key, _, _ in keys])
            except (RedisError, OSError) as exc:
                stats.redis_errors += 1
                raise Unavailable(f"Redis failed a claim: {exc!r}", component="redis") from None
            pairs = list(zip(keys, letters, strict=True))
            wanted = [(kind, digest) for (_, kind, digest), x in pairs if x != "B"]
            found: dict[tuple[str, bytes], str | None] = {}
            if wanted:
                try:
                    found = await fetch_rows(wanted)
                except Exception as exc:
                    # The claims won are released: nobody here will run them.
                    won = [key for (key, _, _), x in pairs if x == "W"]
                    if won:
                        with contextlib.suppress(RedisError, OSError):
                            await redis(claims.abort, won)
                    raise Unavailable(
                        f"the database read failed: {exc!r}", component="database"
                    ) from None
            return [
                (x, (kind, digest) in found, found.get((kind, digest)))
                for (_, kind, digest), x in pairs
            ]

        async def store(leases: list[Lease]) -> list[str | None]:
            try:
                inserted = await write([lease.row() for lease in leases])
                outcomes = list(zip(leases, inserted, strict=True))
                lost = [(lease.kind, lease.digest) for lease, ok in outcomes if not ok]
                # Another runner wrote first (a lease lost while paused): its row's payload.
                found = await fetch_rows(lost) if lost else {}
            except (DedupError, asyncio.CancelledError):
                raise
            except Exception as exc:
                raise Unavailable(
                    f"the database write failed: {exc!r}", component="database"
                ) from None
            for lease in leases:  # no renewal after the commit: it would find them saved
                self.let_go(lease)
            try:
                await redis(claims.commit, [lease.key for lease in leases])
            except (RedisError, OSError) as exc:
                # The rows are durable; a missing marker only costs the next caller a read.
                stats.redis_errors += 1
                log.warning("could not mark run-once values saved: %r", exc)
            return [
                None if ok else (found.get((lease.kind, lease.digest)) or "null")
                for lease, ok in outcomes
            ]

        async def fetch_rows(keys: list[tuple[str, bytes]]) -> dict[tuple[str, bytes], str | None]:
            sink = _default_sink(parts)
            try:
                return await asyncio.wait_for(sink.fetch_many(keys), parts.write_timeout_s)
            except Exception:
                stats.db_errors += 1
                raise

        self.running: dict[bytes, asyncio.Future[None]] = {}
        # The live leases (each with the loop time it was taken), renewed together by one
        # task while there are any: a task per lease would cost every run a task
        # created and cancelled, though most runs end long before their first renewal.
        self.leases: dict[Lease, float] = {}
        self.renewer: asyncio.Task[None] | None = None
        self.claim = Batched(claim, gate)
        self.commit = Batched(commit, gate)
        self.abort = Batched(abort, gate)
        self.reclaim = Batched(reclaim, gate)
        self.fetch = Batched(fetch)
        self.claim_read = Batched(claim_read, lanes=_LANES)
        self.store = Batched(store, lanes=_LANES)

    def hold(self, lease: Lease, period_s: float) -> None:
        """Renew ``lease`` every ``period_s`` until it is let go (:meth:`let_go`)."""
        loop = asyncio.get_running_loop()
        self.leases[lease] = loop.time()
        if self.renewer is None:
            self.renewer = loop.create_task(self._renew(period_s), name="dedup-once-renewer")

    def let_go(self, lease: Lease) -> bool:
        """Stop renewing ``lease``; False if it was let go already."""
        return self.leases.pop(lease, None) is not None

    async def _renew(self, period_s: float) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self.leases:
                await asyncio.sleep(period_s)
                # A lease taken less than half a period ago has most of its time left: it
                # is renewed at the next round, at most 1.5 periods (half the lease) old.
                due_at = loop.time() - period_s / 2
                due = [lease for lease, taken in self.leases.items() if taken <= due_at]
                if due:
                    await asyncio.gather(*(lease._renew() for lease in due))
        finally:
            self.renewer = None


class RunOnceHost(Protocol):
    """What :class:`RunOnceMixin` and :func:`begin` need of the Gateway they serve.

    ``_run_once_state`` is None until the first claim of an open Gateway builds it.
    """

    _run_once_state: RunOnceState | None

    def _parts(self) -> EngineParts:
        """The open Gateway's parts; :class:`DedupError` when it is not open."""
        ...

    async def save_many(self, items: Iterable[Item]) -> list[SaveResult]:
        """Save a batch; one result per item, in order."""
        ...


def _state(gw: RunOnceHost, parts: EngineParts) -> RunOnceState:
    state = gw._run_once_state
    if state is None:
        state = gw._run_once_state = RunOnceState(parts)
    return state


@dataclass(frozen=True, slots=True)
class Saved:
    """The value was already saved: ``payload`` is its stored payload (decoded JSON)."""

    payload: Any


def _decode(payload_json: str | None) -> Any:
    return None if payload_json is None else orjson.loads(payload_json)


def _default_sink(parts: EngineParts) -> DefaultSink:
    sink = parts.default_sink
    if sink is None:
        raise DedupError(
            "once, get and the middlewares read the saved payload back from dedup_items: "
            "they need the default sink, not a custom one"
        )
    return sink


async def _fetch(
    state: RunOnceState, parts: EngineParts, kind: str, digest: bytes
) -> tuple[bool, str | None]:
    """The row of ``(kind, digest)``: whether it exists and its payload JSON. The reads
    of concurrent calls go to the database together (``state.fetch``), each statement
    bounded by the Gateway's write timeout."""
    _default_sink(parts)
    try:
        return await state.fetch((kind, digest))
    except (DedupError, asyncio.CancelledError):
        raise
    except Exception as exc:  # any driver error: the database did not answer
        raise Unavailable(f"the database read failed: {exc!r}", component="database") from None


async def _claim_letter(
    claim: Callable[[bytes], Awaitable[str]], key: bytes, parts: EngineParts
) -> str:
    """One claim of ``key`` (``claim`` or ``reclaim``): its letter, or Unavailable."""
    try:
        return await claim(key)
    except (RedisError, OSError) as exc:
        parts.stats.redis_errors += 1
        raise Unavailable(f"Redis failed a claim: {exc!r}", component="redis") from None


def _release(
    running: dict[bytes, asyncio.Future[None]], key: bytes, fut: asyncio.Future[None]
) -> None:
    """End this process's run of ``key``: waiters of the process look again."""
    if running.get(key) is fut:
        del running[key]
    if not fut.done():
        fut.set_result(None)


class Lease:
    """A won claim on one value: the caller runs the work, then :meth:`finish` or :meth:`fail`.

    The lease is re-claimed every third of ``lease_ms`` (a re-claim of a lease this
    Gateway holds extends it; :meth:`RunOnceState.hold` renews every live lease of the
    Gateway together) until it is finished or failed. A lease won over a stale saved
    marker (``reclaimed``) is renewed the way it was taken, as a plain claim would keep
    answering "saved" for it.
    If the lease was lost meanwhile (the process was paused past it and another
    runner took over), ``lost`` is True; the database's unique key still decides
    whose payload is stored.
    """

    __slots__ = ("_done", "_parts", "_payload", "_renewal", "_stamp", "_state", "digest",
                 "key", "kind", "lost", "value")  # fmt: skip

    def __init__(
        self,
        parts: EngineParts,
        kind: str,
        value: str,
        digest: bytes,
        key: bytes,
        state: RunOnceState,
        done: asyncio.Future[None],
        *,
        reclaimed: bool = False,
    ) -> None:
        self._parts = parts
        self.kind = kind
        self.value = value
        self.digest = digest
        self.key = key
        self._state = state
        self._done = done
        self._renewal = state.reclaim if reclaimed else state.claim
        # The tier's stamp: a forget of the value after this run's commit is not undone
        # by the run's remembering it as saved (SavedCache.add).
        self._stamp = parts.local.stamp()
        self.lost = False
        self._payload: str | None = None
        state.hold(self, parts.lease_ms / 3000)

    def row(self) -> Row:
        """The row :meth:`store` writes."""
        return Row(self.kind, self.digest, self.value, self._payload)

    async def _renew(self) -> None:
        """One renewal (called by the state's renewer)."""
        try:
            letter = await self._renewal(self.key)
        except (RedisError, OSError, DedupError) as exc:
            # One failed renewal is not yet a lost lease: two more chances remain.
            log.warning("could not renew the lease of a run-once value: %r", exc)
            return
        if letter != "W" and self._state.let_go(self):  # not finished meanwhile
            self.lost = True
            log.warning("a run-once value's lease was lost while its function ran")

    def _stop(self) -> None:
        self._state.let_go(self)

    async def finish(self, result: Any) -> Any:
        """Store ``result`` (JSON-serialisable) as the row's payload, mark the value saved,
        and return the stored payload decoded: ``result`` as JSON gives it back, or, if
        another runner's row got there first, that row's payload.

        On any failure (a payload that is not JSON, the database write) the lease is
        released and nothing is saved: the next call runs the work again.
        """
        try:
            payload_json = encode_payload(result, self._parts.limits)
        except BaseException:
            await self.fail()
            raise
        stored = await self.store(payload_json)
        return _decode(payload_json if stored is None else stored)

    async def store(self, payload_json: str | None) -> str | None:
        """:meth:`finish` for a payload already encoded (checked by the caller, as
        :func:`~dedup._values.encode_payload` checks it): None when this run's row was
        written, else the payload JSON of the row another runner wrote first."""
        self._payload = payload_json
        try:
            # With the rows of concurrent runs: one INSERT, then one script marking them saved.
            stored = await self._state.store(self)
        except BaseException:
            await self.fail()
            raise
        self._stop()
        self._parts.local.add(self.kind, self.digest, self._stamp)
        _release(self._state.running, self.key, self._done)
        return stored

    async def fail(self) -> None:
        """Release the lease without saving anything (safe to call twice)."""
        try:
            self._stop()
            if not self._done.done():
                # Shielded: a cancelled caller still releases the lease rather than
                # leaving it to expire.
                await asyncio.shield(self._state.abort(self.key))
        except (RedisError, OSError, asyncio.CancelledError) as exc:
            log.warning("could not release a run-once lease (it expires anyway): %r", exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            _release(self._state.running, self.key, self._done)


async def begin(
    gw: RunOnceHost, kind: str, value: str, *, wait_s: float | None = None
) -> Saved | Lease:
    """Claim ``value`` of ``kind`` for a run: :class:`Saved` with the stored payload when
    it is saved already (after waiting, bounded by ``wait_s``, default the Gateway's
    ``wait_timeout_s``, for a runner elsewhere; 0 does not wait), or a :class:`Lease`
    when this caller is to run the work.

    Raises :class:`InvalidInput`, :class:`WaitTimeout`, :class:`Unavailable` (also
    while the Gateway is degraded: without Redis two runners could not be told
    apart), or :class:`DedupError` when the Gateway is not open or has a custom sink.

    "Saved" is only answered with the row in hand. A value the local tier or the Redis
    marker calls saved while its row is gone (deleted from ``dedup_items`` to forget it,
    the marker kept) is forgotten here and claimed again over the stale marker: the
    caller gets a :class:`Lease` and runs the work, rather than a made-up empty payload.
    """
    kind = validate_kind(kind)
    parts = gw._parts()
    digest = validate_value(value, parts.limits)
    _default_sink(parts)
    state = _state(gw, parts)
    if (kind, digest) in parts.local:
        exists, payload_json = await _fetch(state, parts, kind, digest)
        if exists:
            return Saved(_decode(payload_json))
        # The row was deleted after this process saw it saved: the entry is stale.
        parts.local.discard(kind, value, digest)
    key = parts.keys.key(kind, digest)
    running = state.running
    loop = asyncio.get_running_loop()
    bound_s = parts.wait_timeout_s if wait_s is None else wait_s
    deadline = loop.time() + bound_s
    pause_s = _FIRST_POLL_S
    while True:
        if parts.degraded():
            raise Unavailable(
                "Redis is unavailable (degraded mode): a run-once function cannot be "
                "guarded by the database alone",
                component="redis",
            )
        other = running.get(key)
        if other is not None:
            # Another call of this process runs it: wait for that run's end, then look
            # again (it may have failed, and then this call runs it).
            try:
                async with asyncio.timeout_at(deadline):
                    await asyncio.shield(other)
            except TimeoutError:
                parts.stats.wait_timeouts += 1
                raise WaitTimeout(
                    f"the run of this value went on for more than {bound_s} s"
                ) from None
            continue
        mine: asyncio.Future[None] = loop.create_future()
        running[key] = mine
        stamp = parts.local.stamp()  # before the claim: see SavedCache.add
        lease: Lease | None = None
        handed_over = False
        try:
            # The claim, and the row read of a claim won or found saved, in one batch.
            letter, exists, payload_json = await state.claim_read((key, kind, digest))
            reclaimed = False
            if letter == "S":
                if exists:
                    parts.local.add(kind, digest, stamp)
                    return Saved(_decode(payload_json))
                # Redis marks the value saved but its row is gone (deleted to forget the
                # value, the marker kept): answering "saved" would hand out a payload
                # that does not exist. Claim it over the marker instead; the row is read
                # again under the lease below, in case another runner wrote it meanwhile.
                log.info("a run-once value is marked saved in Redis but has no row: reclaimed")
                letter = await _claim_letter(state.reclaim, key, parts)
                reclaimed = True
                if letter == "W":
                    exists, payload_json = await _fetch(state, parts, kind, digest)
            if letter == "W":
                lease = Lease(parts, kind, value, digest, key, state, mine, reclaimed=reclaimed)
                # The row may exist with no marker (a plain save whose marker was lost,
                # or a Redis that restarted empty): then the database has the answer.
                if not exists:
                    handed_over = True
                    return lease
                lease._stop()
                with contextlib.suppress(RedisError, OSError):
                    await state.commit(key)
                parts.local.add(kind, digest, stamp)
                return Saved(_decode(payload_json))
        except BaseException:
            if lease is not None:
                await lease.fail()
            raise
        finally:
            if not handed_over:
                _release(running, key, mine)
        parts.stats.busy += 1
        remaining = deadline - loop.time()
        if remaining <= 0:
            parts.stats.wait_timeouts += 1
            raise WaitTimeout(f"another process held this value's lease for more than {bound_s} s")
        await asyncio.sleep(min(pause_s * random.uniform(0.5, 1.5), remaining))
        pause_s = min(pause_s * 2, _MAX_POLL_S)


async def run_once(
    gw: RunOnceHost, kind: str, value: str, work: Callable[[], Awaitable[Any]]
) -> Any:
    """Run ``work()`` if this caller wins ``value``'s lease and store its result; return
    the stored payload (decoded JSON) either way. See :meth:`RunOnceMixin.once`."""
    claimed = await begin(gw, kind, value)
    if isinstance(claimed, Saved):
        return claimed.payload
    try:
        result = await work()
    except BaseException:
        await claimed.fail()
        raise
    return await claimed.finish(result)


def value_of(key: Callable[..., str] | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The value a run-once function's call is for: ``key(*args, **kwargs)``, or the first
    positional argument."""
    if key is not None:
        return key(*args, **kwargs)
    if not args:
        raise InvalidInput(
            "a run-once function takes the value as its first positional argument "
            "(or pass key= to map its arguments to the value)",
            field="value",
        )
    value: str = args[0]
    return value


class RunOnceMixin:
    """The run-once methods of :class:`dedup.Gateway`: :meth:`once`, :meth:`get` and
    :meth:`filter`. Each method's ``self`` is a :class:`RunOnceHost`; the run-once
    state lives on that Gateway, in ``_run_once_state``."""

    _run_once_state: RunOnceState | None = None

    def once(
        self: RunOnceHost, kind: str, *, key: Callable[..., str] | None = None
    ) -> Callable[[Callable[_P, Awaitable[Any]]], Callable[_P, Awaitable[Any]]]:
        """Decorate an ``async def`` function so that it runs at most once per value of ``kind``
        across every process that shares this Gateway's Redis and database.

        The value is the function's first positional argument, or ``key(*args, **kwargs)``.
        The caller that wins the value's lease runs the function; the lease is renewed
        while it runs. Its return value (JSON-serialisable) is stored as the row's payload
        and returned, decoded from JSON (a tuple comes back as a list), so every caller,
        now or later, in any process, gets the same answer. Other callers wait, at most
        ``wait_timeout_s``, for the runner's outcome (:class:`WaitTimeout` past it).

        If the function raises, its lease is released, nothing is saved, the exception
        reaches its caller and the next call runs the function again. A runner that dies
        after the function's side effect but before the commit also leaves the value
        unsaved: the next call runs it again (see docs/locks.md on fencing tokens).

        A value already saved by a plain :meth:`Gateway.save` returns its payload (None
        when it was saved without one) and the function does not run. While the Gateway
        is degraded (Redis skipped) calls raise :class:`Unavailable` rather than risk a
        second run. Needs the default sink (``dedup_items``), where the payloads are read.
        """
        validate_kind(kind)
        if key is not None and not callable(key):
            raise InvalidInput(
                "key must be a callable mapping the arguments to the value", field="key"
            )

        def decorate(fn: Callable[_P, Awaitable[Any]]) -> Callable[_P, Awaitable[Any]]:
            if not inspect.iscoroutinefunction(fn):
                raise InvalidInput(
                    "Gateway.once decorates an async def function "
                    "(SyncGateway.once takes plain ones)",
                    field="function",
                )

            @functools.wraps(fn)
            async def run(*args: _P.args, **kwargs: _P.kwargs) -> Any:
                value = value_of(key, args, kwargs)
                return await run_once(self, kind, value, lambda: fn(*args, **kwargs))

            return run

        return decorate

    async def get(self: RunOnceHost, kind: str, value: str) -> Any:
        """The payload saved with ``value`` of ``kind`` (decoded JSON), or None when the value
        is not saved or was saved without a payload.

        A read of the default table (``dedup_items``), bounded by the write timeout: it
        needs the default sink. Raises :class:`InvalidInput` or :class:`Unavailable`.
        """
        kind = validate_kind(kind)
        parts = self._parts()
        digest = validate_value(value, parts.limits)
        _default_sink(parts)
        return _decode((await _fetch(_state(self, parts), parts, kind, digest))[1])

    def filter(
        self: RunOnceHost,
        stream: AsyncIterable[_T] | Iterable[_T],
        kind: str,
        *,
        key: Callable[[_T], str] | None = None,
        payload: Callable[[_T], Any] | None = None,
        batch_size: int = 256,
        linger_s: float = 0.005,
    ) -> AsyncGenerator[_T, None]:
        """Yield, in order, the items of ``stream`` whose save created the row: each value
        passes once, however often and from however many processes it arrives.

        ``stream`` is an async or a plain iterable; ``key(item)`` gives an item's value
        (default: the item itself, a str) and ``payload(item)`` its payload (default none).
        Items are saved through :meth:`Gateway.save_many` in batches of up to
        ``batch_size``, sent when full or ``linger_s`` after their first item arrived (a
        plain iterable is only looked at between items: a blocking one holds the batch
        back). A bad item raises :class:`InvalidInput` naming its position in the stream;
        the items of its unsent batch are not saved. An item is yielded only once its row
        is committed; errors of ``save_many`` end the iteration.
        """
        validate_kind(kind)
        if isinstance(stream, str | bytes | dict) or not (
            isinstance(stream, AsyncIterable | Iterable)
        ):
            raise InvalidInput(
                "stream must be an iterable or async iterable of items, "
                f"not {type(stream).__name__}",
                field="stream",
            )
        for name, fn in (("key", key), ("payload", payload)):
            if fn is not None and not callable(fn):
                raise InvalidInput(f"{name} must be a callable on an item", field=name)
        if type(batch_size) is not int or batch_size < 1:
            raise InvalidInput("batch_size must be an int >= 1", field="batch_size")
        if not isinstance(linger_s, int | float) or not 0 <= linger_s < float("inf"):
            raise InvalidInput("linger_s must be a finite number >= 0", field="linger_s")
        return _filter(self, stream, kind, key, payload, batch_size, float(linger_s))


async def _filter(
    gw: RunOnceHost,
    stream: AsyncIterable[_T] | Iterable[_T],
    kind: str,
    key: Callable[[_T], str] | None,
    payload: Callable[[_T], Any] | None,
    batch_size: int,
    linger_s: float,
) -> AsyncGenerator[_T, None]:
    limits = gw._parts().limits
    loop = asyncio.get_running_loop()
    batch: list[_T] = []
    items: list[Item] = []
    first_at = 0.0
    index = 0

    def add(item: _T) -> None:
        nonlocal first_at, index
        value = item if key is None else key(item)
        validate_value(value, limits, index)
        if payload is None:
            items.append((kind, value))  # type: ignore[arg-type]  # validated: a str
        else:
            data = payload(item)
            encode_payload(data, limits, index)  # fails here, naming the stream position
            items.append((kind, value, data))  # type: ignore[arg-type]
        if not batch:
            first_at = loop.time()
        batch.append(item)
        index += 1

    async def flush() -> list[_T]:
        results = await gw.save_many(items)
        created = [item for item, r in zip(batch, results, strict=True) if r.created]
        batch.clear()
        items.clear()
        return created

    if not isinstance(stream, AsyncIterable):
        for item in stream:
            add(item)
            if len(batch) >= batch_size or loop.time() - first_at >= linger_s:
                for out in await flush():
                    yield out
        if batch:
            for out in await flush():
                yield out
        return

    source = aiter(stream)

    async def next_item() -> _T:
        return await anext(source)

    # The next item is awaited in a task of its own, so that a batch can be sent when
    # its linger ends without cancelling the stream's own read.
    pending: asyncio.Task[_T] | None = None
    try:
        while True:
            if pending is None:
                pending = loop.create_task(next_item())
            timeout = None if not batch else max(0.0, first_at + linger_s - loop.time())
            if timeout is not None and not pending.done():
                await asyncio.wait((pending,), timeout=timeout)
            elif timeout is None:
                await asyncio.wait((pending,))
            if not pending.done():
                for out in await flush():
                    yield out
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                break
            add(item)
            if len(batch) >= batch_size:
                for out in await flush():
                    yield out
        if batch:
            for out in await flush():
                yield out
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
