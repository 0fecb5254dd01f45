"""The Gateway: the exactly-once save path.

A save goes through, in order:

1. the local tier (values known saved in this process) -> ``local``;
2. singleflight: the same value already in flight here shares its future -> ``inflight``;
3. a claim batch: every claim made during one event-loop tick goes to Redis in one
   script call, which answers per value saved (``redis``), won (lease held) or busy;
4. a write batch: the winners go to the sink in ONE statement (keys sorted), and
   their callers are answered once the rows are committed (``write`` or ``db``);
5. a commit batch: one script call marks the values saved.

Busy values are re-claimed in later batches with jittered backoff until they are
saved, their lease expires (then they are taken over) or ``wait_timeout_s`` passes.

Degraded mode: when Redis stops answering (a circuit breaker, :mod:`dedup.breaker`,
opens on consecutive connection errors or one timeout), claims skip Redis and values
go straight to write batches, where the database's unique key decides who created
the row. Admission control keeps the database from being flooded: at most
``degraded_max_statements`` statements at once, and a queue bounded in length and
in waiting time, past which saves raise ``Overloaded``. A PING probe closes the
circuit when Redis answers again, and normal mode resumes by itself.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import random
from collections.abc import Awaitable, Iterable, Sequence
from hashlib import blake2b
from pathlib import Path
from types import TracebackType
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dedup import _embed
from dedup._parts import EngineParts
from dedup.breaker import CircuitBreaker
from dedup.claims import (
    CLUSTER_SCHEMES,
    REDIS_SCHEMES,
    Claims,
    connect_redis,
    unlink_matching,
    unsafe_policies,
)
from dedup.embedded import DataDirLock, EmbeddedRedis
from dedup.errors import ConfigError, DedupError, InvalidInput, Overloaded, Unavailable, WaitTimeout
from dedup.keys import (
    DIGEST_BYTES,
    KeySpace,
    Limits,
    encode_payload,
    validate_kind,
    validate_value,
)
from dedup.local import SavedCache
from dedup.metrics import Stats
from dedup.store import DATABASE_SCHEMES, DefaultSink, open_sink
from dedup.types import BatchWriter, Item, Row, SaveResult, Source
from dedup.urls import check_url_password, embedded_sqlite_url, redact

__all__ = ["Gateway"]

log = logging.getLogger("dedup")

_RESULTS: dict[Source, SaveResult] = {
    "local": SaveResult(False, "local"),
    "inflight": SaveResult(False, "inflight"),
    "redis": SaveResult(False, "redis"),
    "db": SaveResult(False, "db"),
    "write": SaveResult(True, "write"),
}
_LOCAL = _RESULTS["local"]
_WAKE_TICK_S = 0.005
_INFLIGHT = _RESULTS["inflight"]


class _Flight:
    """One value on its way through claim, wait and write; shared by its callers."""

    __slots__ = ("backoff", "claimed_at", "deadline", "digest", "done", "key", "kind",
                 "payload_json", "queued_until", "value", "waiters")  # fmt: skip

    def __init__(
        self,
        key: bytes,
        kind: str,
        value: str,
        digest: bytes,
        payload_json: str | None,
        waiter: asyncio.Future[Source],
        deadline: float,
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


class Gateway:
    """Saves each value of a kind exactly once, keeping duplicate traffic off the database.

    With no URLs it runs the embedded default: a private redis-server on a unix
    socket and a SQLite file, both under ``data_dir``. Use it as an async context
    manager (or call :meth:`open` and :meth:`aclose`).

    Options (all keyword arguments, with defaults):

    - ``redis_url``: redis://, rediss://, unix:// or redis+cluster:// (None: embedded).
    - ``database_url``: postgresql:// or sqlite:/// (None: embedded SQLite).
    - ``sink``: an async batch writer (see :data:`dedup.types.BatchWriter`) used
      instead of the default ``dedup_items`` sink; excludes ``database_url``.
    - ``namespace="dedup"``: prefix of every Redis key.
    - ``lease_ms=5000``: the claim lease; a writer that dies is taken over after it.
    - ``wait_timeout_s=10.0``: bound on waiting for another writer's outcome.
    - ``write_timeout_ms=lease_ms // 2``: bound on one database statement; must
      leave room in the lease, so a write never outlives it.
    - ``local_cache_size=100_000``: entries of the local tier (0 disables it).
    - ``max_batch=512``: keys per claim and rows per write statement.
    - ``max_claim_batches=4`` / ``max_write_batches=4``: batches in flight at once
      (Redis connections and database connections are sized from them).
    - ``max_pending=100_000``: values in flight before saves raise ``Overloaded``.
    - ``redis_timeout_s=2.0``: socket timeout of each Redis call.
    - ``retention_s=None``: expiry of the "saved" markers (None: never).
    - ``max_value_bytes=8192`` / ``max_payload_bytes=65536``: input limits.
    - ``data_dir=".dedup"``: folder of the embedded default (locked while open).
    - ``migrate=None``: apply the schema at open (None: only for the embedded SQLite).
    - ``allow_eviction=False``: start even if Redis may evict keys (unsafe).
    - ``cluster_shards=0``: hash-tag shards per namespace; 0 means none on a single
      server and 64 on a cluster (a batch then needs at most 64 script calls).
    - ``breaker_failures=3``: consecutive Redis connection errors that open the circuit
      (degraded mode); one timeout of ``redis_timeout_s`` opens it at once.
    - ``breaker_cooldown_s=1.0``: time the circuit stays open before a PING probe
      (jittered by +-20 %); a failed probe opens it for another cooldown.
    - ``degraded_max_statements=2``: database statements in flight at once in degraded mode.
    - ``degraded_max_queue=10_000``: values waiting for a degraded statement before
      saves raise ``Overloaded``.
    - ``degraded_queue_timeout_s=1.0``: a value not sent to the database within this
      long in degraded mode fails with ``Overloaded``.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        database_url: str | None = None,
        *,
        sink: BatchWriter | None = None,
        namespace: str = "dedup",
        lease_ms: int = 5000,
        wait_timeout_s: float = 10.0,
        write_timeout_ms: int | None = None,
        local_cache_size: int = 100_000,
        max_batch: int = 512,
        max_claim_batches: int = 4,
        max_write_batches: int = 4,
        max_pending: int = 100_000,
        redis_timeout_s: float = 2.0,
        retention_s: float | None = None,
        max_value_bytes: int = 8192,
        max_payload_bytes: int = 65536,
        data_dir: str | Path = ".dedup",
        migrate: bool | None = None,
        allow_eviction: bool = False,
        cluster_shards: int = 0,
        breaker_failures: int = 3,
        breaker_cooldown_s: float = 1.0,
        degraded_max_statements: int = 2,
        degraded_max_queue: int = 10_000,
        degraded_queue_timeout_s: float = 1.0,
    ) -> None:
        if sink is not None and database_url is not None:
            raise ConfigError("pass either database_url or sink, not both")
        if redis_url is not None and not redis_url.startswith(REDIS_SCHEMES):
            raise ConfigError(f"redis_url must start with one of {', '.join(REDIS_SCHEMES)}")
        if database_url is not None and not database_url.startswith(DATABASE_SCHEMES):
            raise ConfigError(f"database_url must start with one of {', '.join(DATABASE_SCHEMES)}")
        for url_name, url in (("redis_url", redis_url), ("database_url", database_url)):
            if url is not None:
                check_url_password(url, url_name)
        if lease_ms < 100:
            raise ConfigError("lease_ms must be at least 100")
        write_timeout_ms = lease_ms // 2 if write_timeout_ms is None else write_timeout_ms
        if not 0 < write_timeout_ms < lease_ms:
            raise ConfigError("write_timeout_ms must be positive and below lease_ms")
        for name, number in (
            ("max_batch", max_batch),
            ("max_claim_batches", max_claim_batches),
            ("max_write_batches", max_write_batches),
            ("max_pending", max_pending),
            ("breaker_failures", breaker_failures),
            ("degraded_max_statements", degraded_max_statements),
            ("degraded_max_queue", degraded_max_queue),
        ):
            if number < 1:
                raise ConfigError(f"{name} must be at least 1")
        if wait_timeout_s <= 0 or redis_timeout_s <= 0:
            raise ConfigError("wait_timeout_s and redis_timeout_s must be positive")
        if not (breaker_cooldown_s > 0 and degraded_queue_timeout_s > 0):
            raise ConfigError("breaker_cooldown_s and degraded_queue_timeout_s must be positive")
        if retention_s is not None and retention_s <= 0:
            raise ConfigError("retention_s must be positive or None")
        if cluster_shards == 0 and redis_url is not None and redis_url.startswith(CLUSTER_SCHEMES):
            # Without hash tags a batch would need one script call per key's slot.
            cluster_shards = 64
        try:
            self._keys = KeySpace(namespace, cluster_shards=cluster_shards)
            self._limits = Limits(
                max_value_bytes=max_value_bytes, max_payload_bytes=max_payload_bytes
            )
            self._local = SavedCache(local_cache_size)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

        self._redis_url = redis_url
        self._database_url = database_url
        self._custom_sink = sink
        self._lease_ms = lease_ms
        self._lease_s = lease_ms / 1000
        self._wait_timeout_s = wait_timeout_s
        self._write_timeout_s = write_timeout_ms / 1000
        # A winner writes only if the statement can finish inside its lease with a
        # margin; otherwise it renews the lease first.
        self._write_budget_s = self._write_timeout_s + min(0.25, self._lease_s / 10)
        self._max_batch = max_batch
        self._max_claim_batches = max_claim_batches
        # While a batch is in flight, another starts only once this many are queued;
        # with nothing in flight, even one key goes at once.
        self._min_fill = max(1, max_batch // 8)
        self._max_write_batches = max_write_batches
        self._max_pending = max_pending
        self._redis_timeout_s = redis_timeout_s
        self._retention_ms = 0 if retention_s is None else max(1, int(retention_s * 1000))
        self._data_dir = Path(data_dir)
        self._migrate = migrate
        self._allow_eviction = allow_eviction
        self._min_backoff_s = 0.002
        self._max_backoff_s = min(0.1, self._lease_s / 4)

        self._stats = Stats()
        self._breaker = CircuitBreaker(failures=breaker_failures, cooldown_s=breaker_cooldown_s)
        self._probing = False
        self._degraded_max_statements = degraded_max_statements
        self._degraded_max_queue = degraded_max_queue
        self._degraded_queue_timeout_s = degraded_queue_timeout_s
        self._degraded_q: list[_Flight] = []
        self._degraded_running = 0
        self._degraded_scheduled = False
        self._degraded_timer: asyncio.TimerHandle | None = None
        self._kinds_ok: set[str] = set()
        self._inflight: dict[bytes, _Flight] = {}
        self._claim_q: list[_Flight] = []
        self._write_q: list[_Flight] = []
        self._waiting: list[tuple[float, int, _Flight]] = []
        self._wait_seq = 0
        self._wait_timer: asyncio.TimerHandle | None = None
        self._claim_scheduled = False
        self._write_scheduled = False
        self._claims_running = 0
        self._writes_running = 0
        self._tasks: set[asyncio.Task[None]] = set()

        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: DataDirLock | None = None
        self._embedded: EmbeddedRedis | None = None
        self._redis: Redis | RedisCluster | None = None
        self._claims: Claims | None = None
        self._sink: BatchWriter | None = None
        self._default_sink: DefaultSink | None = None
        self._state = "new"

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
        """Start or connect to Redis and the database, and check Redis is safe to use."""
        if self._state != "new":
            raise DedupError("a Gateway can be opened once")
        self._state = "opening"
        self._loop = asyncio.get_running_loop()
        try:
            await self._open_parts()
        except BaseException:
            await self._close_parts()
            self._state = "closed"
            raise
        self._state = "open"

    async def _open_parts(self) -> None:
        redis_url, database_url = self._redis_url, self._database_url
        embedded_db = self._custom_sink is None and database_url is None
        if redis_url is None or embedded_db:
            self._lock = DataDirLock(self._data_dir)
            self._lock.acquire()
        if redis_url is None:
            self._embedded = EmbeddedRedis(self._data_dir)
            redis_url = await self._embedded.start()
        if embedded_db:
            database_url = embedded_sqlite_url(self._data_dir)

        connections = self._max_claim_batches + self._max_write_batches + 2
        self._redis = connect_redis(
            redis_url, max_connections=connections, timeout_s=self._redis_timeout_s
        )
        await self._check_redis(redis_url)
        self._claims = Claims(
            self._redis,
            lease_ms=self._lease_ms,
            retention_ms=self._retention_ms,
            stats=self._stats,
            max_parallel=connections - 2,
        )

        if self._custom_sink is not None:
            self._sink = self._custom_sink
            return
        assert database_url is not None
        migrate = embedded_db if self._migrate is None else self._migrate
        if migrate:
            from dedup.migrate import upgrade_async  # alembic is slow to import

            try:
                await upgrade_async(database_url)
            except Exception as exc:
                raise Unavailable(
                    f"could not migrate {redact(database_url)}: {exc}", component="database"
                ) from exc
        sink = open_sink(
            database_url,
            pool_size=self._max_write_batches,
            statement_timeout_ms=int(self._write_timeout_s * 1000),
        )
        try:
            await sink.open()
        except (OSError, TimeoutError) as exc:
            raise Unavailable(
                f"cannot connect to the database at {redact(database_url)}: {exc}",
                component="database",
            ) from exc
        except Exception as exc:
            if isinstance(exc, DedupError):
                raise
            raise Unavailable(
                f"cannot use the database at {redact(database_url)}: {exc}", component="database"
            ) from exc
        self._default_sink = sink
        self._sink = sink

    async def _check_redis(self, url: str) -> None:
        """Reach Redis and refuse one that may evict keys (leases and markers would vanish)."""
        assert self._redis is not None
        try:
            info: Any = await self._redis.info("memory")
        except NoPermissionError as exc:
            # An ACL user without +info: the policy cannot be read. Say so, not "cannot connect".
            if self._allow_eviction:
                log.warning("Redis user may not run INFO: maxmemory-policy not checked (allowed)")
                return
            raise ConfigError(
                f"the Redis user of {redact(url)} may not run INFO ({exc}), which dedup needs to "
                "check maxmemory-policy: grant it (ACL SETUSER <user> +info) or pass "
                "allow_eviction=True"
            ) from exc
        except (RedisError, OSError) as exc:
            raise Unavailable(
                f"cannot connect to Redis at {redact(url)}: {exc}", component="redis"
            ) from exc
        self._stats.redis_round_trips += 1
        bad = unsafe_policies(info)
        if bad and not self._allow_eviction:
            raise ConfigError(
                f"Redis at {redact(url)} has maxmemory-policy {', '.join(sorted(bad))}; dedup "
                "needs noeviction (leases and saved markers carry TTLs, so volatile-* policies "
                "evict them too). Set `maxmemory-policy noeviction` or pass allow_eviction=True."
            )

    async def aclose(self, *, drain_timeout_s: float | None = None) -> None:
        """Stop taking saves, let saves in flight finish (bounded), then close everything.

        Saves still unfinished after ``drain_timeout_s`` (default: ``wait_timeout_s``)
        fail with :class:`DedupError`; leases they held expire on their own.
        """
        if self._state in ("closing", "closed"):
            return
        was_open = self._state == "open"
        self._state = "closing"
        try:
            if was_open and self._inflight:
                timeout = self._wait_timeout_s if drain_timeout_s is None else drain_timeout_s
                deadline = asyncio.get_running_loop().time() + timeout
                # Wait for the flights, not the callers: a flight whose callers were all
                # cancelled still holds a lease until it finishes. Polled, as this runs
                # only at close, where an Event set on every resolve would tax the hot path.
                while self._inflight and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
        finally:
            try:
                await self._stop_work()
            finally:
                await self._close_parts()
                self._state = "closed"

    async def _stop_work(self) -> None:
        if self._wait_timer is not None:
            self._wait_timer.cancel()
            self._wait_timer = None
        if self._degraded_timer is not None:
            self._degraded_timer.cancel()
            self._degraded_timer = None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        closed = DedupError("the Gateway was closed before this save finished")
        leftovers = [f for _, _, f in self._waiting] + self._claim_q + self._write_q
        leftovers += self._degraded_q
        self._waiting.clear()
        self._claim_q.clear()
        self._write_q.clear()
        self._degraded_q.clear()
        for flight in leftovers:
            self._fail(flight, closed)
        for flight in list(self._inflight.values()):
            self._fail(flight, DedupError(str(closed)))
        self._inflight.clear()

    async def _close_parts(self) -> None:
        """Close every owned resource, each step even if an earlier one failed."""
        sink, self._default_sink, self._sink = self._default_sink, None, None
        client, self._redis = self._redis, None
        embedded, self._embedded = self._embedded, None
        lock, self._lock = self._lock, None
        try:
            if sink is not None:
                await sink.aclose()
        finally:
            try:
                if client is not None:
                    await client.aclose()
            finally:
                try:
                    if embedded is not None:
                        await embedded.aclose()
                finally:
                    if lock is not None:
                        lock.release()

    # ----------------------------------------------------------------- public API

    def _kinds_ok_add(self, kind: str) -> None:
        if len(self._kinds_ok) < 4096:  # kinds are few; bound the set anyway
            self._kinds_ok.add(kind)

    def stats(self) -> Stats:
        """A snapshot of the counters (answers per tier, round trips, statements, rows)."""
        return self._stats.copy()

    @property
    def degraded(self) -> bool:
        """True while Redis is skipped (the circuit is open or half-open): saves are
        decided by the database's unique key alone, under admission control."""
        return not self._breaker.closed

    @property
    def pending(self) -> int:
        """Values in flight in this process (claimed, waiting or being written)."""
        return len(self._inflight)

    async def save(self, kind: str, value: str, payload: Any = None) -> SaveResult:
        """Save ``value`` of ``kind`` once; return when its row is committed.

        ``created`` is True only for the call whose own write inserted the row.
        ``payload`` (JSON-serialisable) is stored with the row the first time.
        Raises :class:`InvalidInput`, :class:`Unavailable`, :class:`WaitTimeout`,
        :class:`Overloaded`, or :class:`DedupError` when the Gateway is not open.
        """
        # The common case inline (this is the hot path); the validators give the errors.
        if type(kind) is not str or kind not in self._kinds_ok:
            self._kinds_ok_add(validate_kind(kind))
        if type(value) is not str:
            validate_value(value, self._limits)
        try:
            raw = value.encode()
        except UnicodeEncodeError:
            raw = b"\x00"  # refused below with the validator's message
        if len(raw) > self._limits.max_value_bytes or b"\x00" in raw:
            validate_value(value, self._limits)
        digest = blake2b(raw, digest_size=DIGEST_BYTES).digest()
        payload_json = None if payload is None else encode_payload(payload, self._limits)
        if self._state != "open":
            raise DedupError(f"the Gateway is {self._state}, not open")
        salt = self._local.salts.get(kind)
        if salt is not None:  # the local tier, inline (SavedCache.__contains__): most answers
            saved = self._local.entries
            local_key = salt ^ int.from_bytes(digest, "little")
            if saved.pop(local_key, 0) is None:  # found: now the most recently used
                saved[local_key] = None
                self._stats.local += 1
                return _LOCAL
        key = self._keys.key(kind, digest)
        fut, shared = self._submit_new(key, kind, value, digest, payload_json)
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
        if len(checked) > self._max_pending:
            raise Overloaded(f"a batch of {len(checked)} items exceeds max_pending")
        if len(self._inflight) + len(checked) > self._max_pending:
            self._stats.overloaded += 1
            raise Overloaded("too many saves in flight; retry later")
        waits: list[tuple[int, asyncio.Future[Source], bool]] = []
        results: list[SaveResult] = [_LOCAL] * len(checked)
        for i, (kind, value, digest, payload_json) in enumerate(checked):
            routed = self._submit(kind, value, digest, payload_json)
            if routed is not None:
                waits.append((i, *routed))
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

    async def purge(self, kinds: Sequence[str]) -> None:
        """Delete this namespace's Redis keys and the default table's rows of ``kinds``.

        For demos and tests that must start empty; never needed in normal use.
        """
        sink, client = self._require_default_sink(), self._require_redis()
        if self._inflight:
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

        async def redis_ok() -> bool:
            client = self._redis
            if client is None or self._state != "open":
                return False
            try:
                await asyncio.wait_for(client.ping(), timeout_s)
            except (RedisError, OSError, TimeoutError) as exc:
                # A failed readiness PING counts like a failed call (never as a timeout
                # of redis_timeout_s): an idle gateway still learns that Redis is gone.
                self._redis_failed(exc, may_time_out=False)
                return False
            self._breaker.success()
            return True

        async def database_ok() -> bool:
            if self._state != "open":
                return False
            sink = self._default_sink
            if sink is None:
                return self._sink is not None
            try:
                await asyncio.wait_for(sink.count(()), timeout_s)
            except Exception:  # any failure of the probe means "cannot serve now"
                return False
            return True

        redis_up, database_up = await asyncio.gather(redis_ok(), database_ok())
        return {"redis": redis_up, "database": database_up}

    def _parts(self) -> EngineParts:
        """The open Gateway's parts, for :mod:`dedup._embed`; DedupError when not open."""
        if self._state != "open" or self._claims is None or self._sink is None:
            raise DedupError(f"the Gateway is {self._state}, not open")
        return EngineParts(
            keys=self._keys,
            limits=self._limits,
            claims=self._claims,
            sink=self._sink,
            default_sink=self._default_sink,
            local=self._local,
            stats=self._stats,
            lease_ms=self._lease_ms,
            wait_timeout_s=self._wait_timeout_s,
            write_timeout_s=self._write_timeout_s,
            degraded=lambda: not self._breaker.closed,
        )

    def _require_default_sink(self) -> DefaultSink:
        if self._default_sink is None:
            raise DedupError("this needs an open Gateway with the default sink")
        return self._default_sink

    def _require_redis(self) -> Redis | RedisCluster:
        if self._redis is None:
            raise DedupError("the Gateway is not open")
        return self._redis

    # ----------------------------------------------------------------- the engine

    def _submit(
        self, kind: str, value: str, digest: bytes, payload_json: str | None
    ) -> tuple[asyncio.Future[Source], bool] | None:
        """Route one validated value: None when known saved, else its future and whether shared."""
        if self._state != "open":
            raise DedupError(f"the Gateway is {self._state}, not open")
        if (kind, digest) in self._local:
            self._stats.local += 1
            return None
        return self._submit_new(self._keys.key(kind, digest), kind, value, digest, payload_json)

    def _submit_new(
        self, key: bytes, kind: str, value: str, digest: bytes, payload_json: str | None
    ) -> tuple[asyncio.Future[Source], bool]:
        """Join the value's flight, or start one: its future and whether it is shared."""
        loop = self._loop
        assert loop is not None
        flight = self._inflight.get(key)
        if flight is not None:
            waiter: asyncio.Future[Source] = loop.create_future()
            flight.waiters.append(waiter)
            return waiter, True
        if len(self._inflight) >= self._max_pending:
            self._stats.overloaded += 1
            raise Overloaded("too many saves in flight; retry later")
        fut: asyncio.Future[Source] = loop.create_future()
        flight = _Flight(
            key, kind, value, digest, payload_json, fut, loop.time() + self._wait_timeout_s
        )
        self._inflight[key] = flight
        self._claim_q.append(flight)
        if not self._claim_scheduled:
            self._claim_scheduled = True
            loop.call_soon(self._flush_claims)
        return fut, False

    def _spawn(self, coro: Awaitable[None]) -> None:
        assert self._loop is not None
        task: asyncio.Task[None] = self._loop.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _flush_claims(self) -> None:
        """Send queued claims, ``max_batch`` keys a call, up to ``max_claim_batches`` at once."""
        self._claim_scheduled = False
        queue, size = self._claim_q, self._max_batch
        if not self._breaker.closed:
            self._degrade(queue)
            queue.clear()
            return
        while queue and self._claims_running < self._max_claim_batches:
            if self._claims_running and len(queue) < self._min_fill:
                break  # a batch in flight will flush us when it ends: let this one grow
            batch = queue[:size]
            del queue[:size]
            self._claims_running += 1
            self._spawn(self._run_claim(batch))

    def _flush_writes(self) -> None:
        """Send queued winners to the sink, up to ``max_write_batches`` statements at once."""
        self._write_scheduled = False
        queue, size = self._write_q, self._max_batch
        if not self._breaker.closed:
            # Winners too go through the degraded admission: one bound on statements.
            self._degrade(queue)
            queue.clear()
            return
        while queue and self._writes_running < self._max_write_batches:
            if self._writes_running and len(queue) < self._min_fill:
                break  # as for claims: an idle pipeline sends at once, a busy one batches
            batch = queue[:size]
            del queue[:size]
            self._writes_running += 1
            self._spawn(self._run_write(batch))

    def _schedule(self, claims: bool) -> None:
        loop = self._loop
        assert loop is not None
        if claims and not self._claim_scheduled:
            self._claim_scheduled = True
            loop.call_soon(self._flush_claims)
        elif not claims and not self._write_scheduled:
            self._write_scheduled = True
            loop.call_soon(self._flush_writes)

    async def _run_claim(self, batch: list[_Flight]) -> None:
        claims, loop = self._claims, self._loop
        assert claims is not None and loop is not None
        try:
            started = loop.time()
            try:
                letters = await claims.claim([f.key for f in batch])
            except (RedisError, OSError) as exc:
                self._stats.redis_errors += 1
                if self._redis_failed(exc):
                    # The claim may or may not have run; either way the database decides.
                    self._degrade(batch)
                    return
                for f in batch:
                    self._fail(f, Unavailable(f"Redis failed a claim: {exc!r}", component="redis"))
                return
            self._breaker.success()
            self._stats.claim_batches += 1
            won = False
            for f, letter in zip(batch, letters, strict=True):
                if letter == "W":
                    f.claimed_at = started
                    self._write_q.append(f)
                    won = True
                elif letter == "S":
                    self._stats.redis += 1
                    self._resolve(f, "redis")
                else:
                    self._wait(f)
            if won:
                self._schedule(claims=False)
        except BaseException as exc:
            self._fail_unfinished(batch, exc)
            raise
        finally:
            self._claims_running -= 1
            if self._claim_q:
                self._schedule(claims=True)

    async def _run_write(self, batch: list[_Flight]) -> None:
        claims, loop = self._claims, self._loop
        assert claims is not None and loop is not None
        try:
            now = loop.time()
            limit = self._lease_s - self._write_budget_s
            fresh = [f for f in batch if now - f.claimed_at <= limit]
            if len(fresh) < len(batch):
                # Too little lease left for a full statement: renew it before writing.
                stale = [f for f in batch if now - f.claimed_at > limit]
                self._stats.reclaims += len(stale)
                self._claim_q.extend(stale)
                self._schedule(claims=True)
            if not fresh:
                return
            keys = [f.key for f in fresh]
            failure = await self._insert(fresh)
            if failure is not None:
                # Release the leases first, so that a caller retrying at once is not
                # racing our own release.
                await self._abort(keys)
                self._fail_write(fresh, failure)
                return
            if not self._breaker.closed:
                return  # Redis is skipped: the leases expire, the markers are not set
            try:
                held = await claims.commit(keys)
                self._stats.lost_leases += len(keys) - held
            except (RedisError, OSError) as exc:
                # The rows are committed and the callers answered; a missing marker
                # only costs the next claimant a redundant (conflicting) insert.
                self._stats.redis_errors += 1
                self._redis_failed(exc)
                log.warning("could not mark %d saved values in Redis: %s", len(keys), exc)
            else:
                self._breaker.success()
        except BaseException as exc:
            self._fail_unfinished(batch, exc)
            raise
        finally:
            self._writes_running -= 1
            if self._write_q:
                self._schedule(claims=False)
            if self._degraded_q:
                self._schedule_degraded()

    async def _insert(self, batch: list[_Flight]) -> str | None:
        """One key-sorted INSERT of ``batch``; answers its callers ("write" for the rows
        this statement inserted, "db" for those already there) and returns None, or
        returns what went wrong and leaves the callers to :meth:`_fail_write`."""
        sink = self._sink
        assert sink is not None
        batch.sort(key=_row_order)  # unsorted concurrent multi-row upserts deadlock
        rows = [Row(f.kind, f.digest, f.value, f.payload_json) for f in batch]
        self._stats.db_statements += 1
        self._stats.db_rows_sent += len(rows)
        self._stats.write_batches += 1
        try:
            inserted = set(await asyncio.wait_for(sink(rows), self._write_timeout_s))
        except Exception as exc:
            self._stats.db_errors += 1
            return "timed out" if isinstance(exc, TimeoutError) else f"failed: {exc!r}"
        for f in batch:
            if (f.kind, f.digest) in inserted:
                self._stats.write += 1
                self._resolve(f, "write")
            else:
                self._stats.db += 1
                self._resolve(f, "db")
        return None

    def _fail_write(self, batch: list[_Flight], failure: str) -> None:
        for f in batch:
            # One exception per caller: a shared one would collect every caller's traceback.
            self._fail(f, Unavailable(f"the database write {failure}", component="database"))

    async def _abort(self, keys: list[bytes]) -> None:
        claims = self._claims
        assert claims is not None
        if not self._breaker.closed:
            return  # Redis is skipped; the leases expire on their own
        try:
            await claims.abort(keys)
        except (RedisError, OSError) as exc:
            self._stats.redis_errors += 1
            self._redis_failed(exc)
            log.warning("could not release %d leases (they expire anyway): %s", len(keys), exc)

    # ----------------------------------------------------------------- degraded mode

    def _redis_failed(self, exc: BaseException, *, may_time_out: bool = True) -> bool:
        """Report a failed Redis call to the breaker; True while Redis is to be skipped.

        Connection errors count toward ``breaker_failures``; a timeout (the call waited
        ``redis_timeout_s``) opens the circuit at once. Errors Redis answered with (a
        script error, say) prove it is up and do not count.
        """
        timeout = isinstance(exc, RedisTimeoutError | TimeoutError)
        unreachable = timeout or isinstance(exc, RedisConnectionError | OSError)
        if unreachable and self._breaker.failure(timeout=timeout and may_time_out):
            self._stats.breaker_opens += 1
            log.warning("Redis failed (%r): circuit open, serving through the database alone", exc)
            if not self._probing and self._state == "open":
                self._probing = True
                self._spawn(self._probe())
        return not self._breaker.closed

    async def _probe(self) -> None:
        """While the circuit is open: one PING per cooldown until Redis answers."""
        breaker, client = self._breaker, self._redis
        assert client is not None
        try:
            while not breaker.closed:
                await asyncio.sleep(breaker.probe_delay_s())
                if not breaker.try_probe():
                    continue
                self._stats.redis_round_trips += 1
                try:
                    await asyncio.wait_for(client.ping(), self._redis_timeout_s)
                except (RedisError, OSError, TimeoutError):
                    breaker.probe_done(False)
                else:
                    breaker.probe_done(True)
        finally:
            self._probing = False
        log.warning("Redis answers again: circuit closed, normal mode resumes")
        if self._degraded_q:
            self._schedule_degraded()  # hands the queue back to the claims
        if self._claim_q:
            self._schedule(claims=True)

    def _degrade(self, flights: Iterable[_Flight]) -> None:
        """Queue ``flights`` for degraded writes; beyond the queue bound, refuse them."""
        loop = self._loop
        assert loop is not None
        until = loop.time() + self._degraded_queue_timeout_s
        queue = self._degraded_q
        for f in flights:
            if len(queue) >= self._degraded_max_queue:
                self._stats.overloaded += 1
                self._fail(f, Overloaded("degraded mode: the database queue is full; retry later"))
            else:
                f.queued_until = until
                queue.append(f)
        self._schedule_degraded()

    def _schedule_degraded(self) -> None:
        if not self._degraded_scheduled:
            self._degraded_scheduled = True
            loop = self._loop
            assert loop is not None
            loop.call_soon(self._flush_degraded)

    def _flush_degraded(self) -> None:
        """Refuse values queued too long; start statements while under the bound."""
        loop = self._loop
        assert loop is not None
        self._degraded_scheduled = False
        if self._degraded_timer is not None:
            self._degraded_timer.cancel()
            self._degraded_timer = None
        queue, now = self._degraded_q, loop.time()
        if self._breaker.closed:
            # Redis is back: what still waits is claimed as usual (the normal bounds apply).
            self._claim_q.extend(queue)
            queue.clear()
            self._schedule(claims=True)
            return
        # Entries share one timeout and are appended in time order: the expired are a prefix.
        # The timer may fire up to the loop's clock resolution early: a millisecond of slack.
        now += 0.001
        expired = 0
        while expired < len(queue) and queue[expired].queued_until <= now:
            expired += 1
        if expired:
            stale = queue[:expired]
            del queue[:expired]
            self._stats.overloaded += expired
            for f in stale:
                self._fail(
                    f,
                    Overloaded(
                        f"degraded mode: not written within {self._degraded_queue_timeout_s} s; "
                        "retry later"
                    ),
                )
        size = self._max_batch
        while queue and (
            self._degraded_running + self._writes_running < self._degraded_max_statements
        ):
            batch = queue[:size]
            del queue[:size]
            self._degraded_running += 1
            self._spawn(self._run_degraded(batch))
        if queue:
            self._degraded_timer = loop.call_at(queue[0].queued_until, self._flush_degraded)

    async def _run_degraded(self, batch: list[_Flight]) -> None:
        """One statement for a degraded batch: the unique key alone decides ``created``."""
        try:
            failure = await self._insert(batch)
            if failure is not None:
                self._fail_write(batch, failure)
                return
            self._stats.degraded_answers += len(batch)
        except BaseException as exc:
            self._fail_unfinished(batch, exc)
            raise
        finally:
            self._degraded_running -= 1
            if self._degraded_q:
                self._schedule_degraded()

    # ----------------------------------------------------------------- waiting

    def _wait(self, f: _Flight) -> None:
        """Another writer holds the lease: check again later, with jittered backoff."""
        loop = self._loop
        assert loop is not None
        self._stats.busy += 1
        now = loop.time()
        if now >= f.deadline:
            self._stats.wait_timeouts += 1
            self._fail(
                f,
                WaitTimeout(
                    f"another writer held this value for more than {self._wait_timeout_s} s"
                ),
            )
            return
        f.backoff = min(f.backoff * 2, self._max_backoff_s) if f.backoff else self._min_backoff_s
        due = now + f.backoff * (0.5 + random.random())
        # Round up to a shared tick so that waiters wake (and re-claim) together in one
        # batch instead of one timer and one tiny claim call each.
        due = min(math.ceil(due / _WAKE_TICK_S) * _WAKE_TICK_S, f.deadline)
        self._wait_seq += 1
        heapq.heappush(self._waiting, (due, self._wait_seq, f))
        if self._waiting[0][2] is f:
            if self._wait_timer is not None:
                self._wait_timer.cancel()
            self._wait_timer = loop.call_at(due, self._wake)

    def _wake(self) -> None:
        """Move every waiter that is due back into the claim queue, as one batch."""
        loop = self._loop
        assert loop is not None
        self._wait_timer = None
        now = loop.time()
        waiting = self._waiting
        while waiting and waiting[0][0] <= now:
            self._claim_q.append(heapq.heappop(waiting)[2])
        if self._claim_q:
            self._schedule(claims=True)
        if waiting:
            self._wait_timer = loop.call_at(waiting[0][0], self._wake)

    def _resolve(self, f: _Flight, source: Source) -> None:
        if self._inflight.get(f.key) is f:
            del self._inflight[f.key]
        self._local.add(f.kind, f.digest)
        f.done = True
        for waiter in f.waiters:
            if not waiter.done():  # a cancelled caller's future is done already
                waiter.set_result(source)

    def _fail(self, f: _Flight, exc: BaseException) -> None:
        # Failures are not cached: the next save of the value starts afresh.
        if self._inflight.get(f.key) is f:
            del self._inflight[f.key]
        f.done = True
        for waiter in f.waiters:
            if not waiter.done():
                waiter.set_exception(exc)

    def _fail_unfinished(self, batch: list[_Flight], exc: BaseException) -> None:
        if isinstance(exc, asyncio.CancelledError):
            error: BaseException = DedupError("the Gateway was closed before this save finished")
        else:
            log.exception("internal error in a batch", exc_info=exc)
            error = DedupError(f"internal error: {exc!r}")
        for f in batch:
            if f.done or f in self._claim_q or f in self._write_q or f in self._degraded_q:
                continue
            self._fail(f, error)

    once = _embed.once
    get = _embed.get
    filter = _embed.filter


def _row_order(f: _Flight) -> tuple[str, bytes]:
    return (f.kind, f.digest)
