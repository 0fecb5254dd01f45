"""The strategies ``dedup bench`` compares, and the driver of one run in one process.

- ``textbook``: per request GET the saved marker, SET NX PX a lock, re-check, INSERT
  one row, SET the marker, release with a compare-and-delete script;
- ``redis-lock``: redis-py's ``Lock`` around the re-check and the insert, with the marker;
- ``db-only``: no Redis; an in-process LRU (as many entries as the Gateway's default
  ``local_cache_size``) and singleflight, and one sorted multi-row
  ``INSERT ... ON CONFLICT DO NOTHING`` per event-loop tick;
- ``db-plain``: the same work written the plain way (:mod:`dedup.bench.plain`), a check
  that ``db-only`` stays as fast as the database alone can be;
- ``dedup``: the :class:`~dedup.Gateway`.

Each runs on one Redis or on a Redis Cluster (``redis+cluster://``): the textbook and
redis-lock strategies send single-key commands and single-key scripts, which a cluster
client routes by key, one command per round trip as on one Redis.

:func:`run_one` drives one of them in this process, in a closed loop (``concurrency``
callers) or an open loop (a fixed timetable), and keeps every request's latency.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
import resource
import secrets
import time
from array import array
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncpg
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster

from dedup import Gateway
from dedup._engine.local import SavedCache
from dedup._values import digest
from dedup.bench.plain import PlainDbOnly
from dedup.options import GatewayOptions
from dedup.store import keep_session
from dedup.urls import CLUSTER_SCHEMES

__all__ = [
    "INSERT_MANY",
    "INSERT_ONE",
    "KIND",
    "PER_REQUEST",
    "REDIS_FREE",
    "RELEASE",
    "STRATEGIES",
    "Saver",
    "percentiles",
    "run_one",
]

KIND = "bench"
STRATEGIES = ("textbook", "redis-lock", "db-only", "db-plain", "dedup")
# One Redis lock per request: far too slow for the fleet sweep, and they add nothing
# to it; they run in one process, on every workload, at the first concurrency.
PER_REQUEST = ("textbook", "redis-lock")
REDIS_FREE = ("db-only", "db-plain")
"""Strategies that never touch Redis: ``--cluster`` runs them once, not on the cluster."""

INSERT_ONE = """
INSERT INTO dedup_items (kind, digest, value) VALUES ($1, $2, $3)
ON CONFLICT (kind, digest) DO NOTHING
"""
INSERT_MANY = """
INSERT INTO dedup_items (kind, digest, value)
SELECT * FROM unnest($1::text[], $2::bytea[], $3::text[])
ON CONFLICT (kind, digest) DO NOTHING
RETURNING digest
"""

RELEASE = """
-- KEYS[1]: the lock key; ARGV[1]: the holder's token
-- Returns: 1 if the lock was ours and is deleted, else 0
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# The open loop's timetable is kept by a dispatcher that wakes at least this often
# (never busy-waits: that would count as the gateway's CPU).
_TICK_S = 0.001


# ----------------------------------------------------------------------------- strategies


class _Counter:
    """Client-side counts shared by a strategy's requests."""

    def __init__(self) -> None:
        self.redis = 0
        self.batches = 0  # sequential round trips (the per-request strategies: all of them)
        self.statements = 0
        self.rows_sent = 0


Saver = Callable[[str], Awaitable[bool]]
AnyRedis = Redis | RedisCluster


async def _per_request_client(redis_url: str, connections: int) -> AnyRedis:
    """The textbook's and redis-lock's client: a pool of ``connections`` (per node on a
    cluster), enough that no caller ever finds it empty.

    A cluster client reads its slot map here, before the clock starts: left to its first
    commands, the callers' concurrent first calls each rebuild the map, and redis-py
    closes the connections of the nodes it replaces while other callers use them
    (``'NoneType' object has no attribute 'writelines'``)."""
    for scheme in CLUSTER_SCHEMES:
        if redis_url.startswith(scheme):
            plain = redis_url.replace("+cluster", "", 1)
            cluster = RedisCluster.from_url(plain, max_connections=connections)
            await cluster.initialize()
            return cluster
    return Redis.from_pool(ConnectionPool.from_url(redis_url, max_connections=connections))


async def _textbook(r: AnyRedis, pool: asyncpg.Pool, c: _Counter, ns: str) -> Saver:
    release = r.register_script(RELEASE)

    async def save(value: str) -> bool:
        d = digest(value)
        saved, lock = f"{ns}:s:".encode() + d, f"{ns}:l:".encode() + d
        while True:
            c.redis += 1
            if await r.get(saved):
                return False
            token = secrets.token_hex(8)
            c.redis += 1
            if await r.set(lock, token, nx=True, px=5000):
                try:
                    c.redis += 1
                    if await r.get(saved):  # saved while we took the lock
                        return False
                    c.statements += 1
                    c.rows_sent += 1
                    status = await pool.execute(INSERT_ONE, KIND, d, value)
                    c.redis += 1
                    await r.set(saved, b"1")
                    return bool(status == "INSERT 0 1")
                finally:
                    c.redis += 1
                    await release(keys=[lock], args=[token])
            await asyncio.sleep(0.001 + random.random() * 0.002)

    return save


async def _redis_lock(r: AnyRedis, pool: asyncpg.Pool, c: _Counter, ns: str) -> Saver:
    async def save(value: str) -> bool:
        d = digest(value)
        saved = f"{ns}:s:".encode() + d
        c.redis += 1
        if await r.get(saved):
            return False
        lock = r.lock(f"{ns}:l:".encode() + d, timeout=5, sleep=0.002, blocking_timeout=30)
        c.redis += 1  # acquire (plus one per retry, counted by the server only)
        async with lock:
            c.redis += 1
            if await r.get(saved):
                c.redis += 1  # release
                return False
            c.statements += 1
            c.rows_sent += 1
            status = await pool.execute(INSERT_ONE, KIND, d, value)
            c.redis += 2  # marker + release
            await r.set(saved, b"1")
        return bool(status == "INSERT 0 1")

    return save


class _DbOnly:
    """The strongest Redis-free baseline: LRU + singleflight + one sorted INSERT per tick."""

    def __init__(self, pool: asyncpg.Pool, c: _Counter, max_batch: int = 512) -> None:
        self.pool, self.c, self.max_batch = pool, c, max_batch
        # The same memory as the Gateway's local tier by default: a fair baseline.
        self.local = SavedCache(GatewayOptions().local_cache_size)
        # A tier answers only while its invalidation channel is heard (the Gateway's
        # forgets). db-only forgets nothing and has no channel: its tier always answers.
        self.local.until = math.inf
        self.inflight: dict[bytes, asyncio.Future[bool]] = {}
        self.queue: list[tuple[bytes, str]] = []
        self.scheduled = False
        self.running = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def save(self, value: str) -> bool:
        # The same local tier as the Gateway's, its fronts included (a repeat found by
        # its text), so that the baseline is as fast as dedup's own repeats.
        front = self.local.fronts.get(KIND)
        if front is not None and value in front:
            return False
        d = digest(value)
        if (KIND, d) in self.local:
            self.local.promote(KIND, value, self.local.key(KIND, d))
            return False
        # Callers await the shared future itself: the bench never cancels one, and a
        # shield would cost each of them an extra future and two callbacks.
        fut = self.inflight.get(d)
        if fut is not None:
            await fut
            return False
        fut = asyncio.get_running_loop().create_future()
        self.inflight[d] = fut
        self.queue.append((d, value))
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)
        return await fut

    def flush(self) -> None:
        self.scheduled = False
        while self.queue and self.running < 4:
            batch, self.queue = self.queue[: self.max_batch], self.queue[self.max_batch :]
            self.running += 1
            task = asyncio.get_running_loop().create_task(self.write(batch))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def write(self, batch: list[tuple[bytes, str]]) -> None:
        try:
            batch.sort()
            self.c.statements += 1
            self.c.rows_sent += len(batch)
            try:
                recs = await self.pool.fetch(
                    INSERT_MANY, [KIND] * len(batch), [d for d, _ in batch], [v for _, v in batch]
                )
            except Exception as exc:
                for d, _ in batch:
                    self.inflight.pop(d).set_exception(exc)
                return
            inserted = {bytes(rec[0]) for rec in recs}
            self.local.add_many(KIND, [d for d, _ in batch])
            pop = self.inflight.pop
            for d, _ in batch:
                pop(d).set_result(d in inserted)
        finally:
            self.running -= 1
            if self.queue and not self.scheduled:
                self.scheduled = True
                asyncio.get_running_loop().call_soon(self.flush)


# ------------------------------------------------------------------------------ one run


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _closed_loop(
    save: Saver, values: Sequence[str], concurrency: int, latencies: array[float]
) -> tuple[float, int, int]:
    """``concurrency`` callers, each saving its next value as soon as it has an answer."""
    ticket = iter(range(len(values)))
    created = errors = 0

    async def caller() -> None:
        nonlocal created, errors
        clock = time.perf_counter
        for i in ticket:
            t0 = clock()
            try:
                ok = await save(values[i])  # never `created += await ...`: that loses updates
            except Exception:
                errors += 1
            else:
                created += ok
            latencies[i] = clock() - t0

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return time.perf_counter() - started, created, errors


async def _open_loop(
    save: Saver, values: Sequence[str], rate: float, outstanding: int, latencies: array[float]
) -> tuple[float, int, int]:
    """Request ``i`` is due at ``i / rate`` s, whether or not earlier ones were answered.

    ``outstanding`` callers take the due requests in order; when all of them are busy
    the timetable slips, and since latency counts from the scheduled time, the slip
    shows in the percentiles (no coordinated omission). The dispatcher releases the
    due requests about every millisecond (it never busy-waits), which adds up to about
    a millisecond to a request's latency. No task or future per request: a busy
    caller takes the next due request directly, an idle one waits to be woken.
    """
    loop = asyncio.get_running_loop()
    clock = time.perf_counter
    n = len(values)
    created = errors = 0
    taken = released = 0  # requests [taken, released) are due and not started yet
    idle: collections.deque[asyncio.Future[None]] = collections.deque()
    started = clock()

    async def caller() -> None:
        nonlocal created, errors, taken
        while True:
            if taken < released:
                i = taken
                taken += 1
            elif released >= n:
                return
            else:
                wake: asyncio.Future[None] = loop.create_future()
                idle.append(wake)
                await wake
                continue
            try:
                ok = await save(values[i])
            except Exception:
                errors += 1
            else:
                created += ok
            latencies[i] = clock() - (started + i / rate)

    callers = [loop.create_task(caller()) for _ in range(min(outstanding, n))]
    while released < n:
        released = min(n, int((clock() - started) * rate) + 1)
        for _ in range(min(len(idle), released - taken)):
            idle.popleft().set_result(None)
        if released < n:
            await asyncio.sleep(max(_TICK_S, started + released / rate - clock()))
    while idle:  # nothing more to take: let them end
        idle.popleft().set_result(None)
    await asyncio.gather(*callers)
    return clock() - started, created, errors


def percentiles(latencies: Sequence[float]) -> dict[str, float]:
    """p50, p99 (nearest rank) and the maximum, in milliseconds."""
    ordered = sorted(latencies)
    if not ordered:
        return {"p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}

    def rank(q: float) -> float:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1000

    return {"p50_ms": rank(0.50), "p99_ms": rank(0.99), "max_ms": ordered[-1] * 1000}


async def run_one(
    strategy: str,
    values: Sequence[str],
    concurrency: int,
    redis_url: str,
    pg_url: str,
    *,
    rate: float | None = None,
    ready: Callable[[], Awaitable[None]] | None = None,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run ``strategy`` over ``values`` in this process; returns its counts and timings.

    A closed loop of ``concurrency`` callers, or with ``rate`` an open loop offering
    ``rate`` requests/s with at most ``concurrency`` in flight. ``ready`` is awaited
    once everything is open, just before the clock starts. ``options`` are Gateway
    options for ``dedup`` (``bench/latency_tradeoff.py``). The result's
    ``latencies`` holds every request's latency in seconds, in stream order.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}")
    c = _Counter()
    r: AnyRedis | None = None
    # Every strategy gets the sink's pool settings: no reset query on release.
    pool = await asyncpg.create_pool(pg_url, min_size=4, max_size=32, reset=keep_session)
    gw: Gateway | None = None
    plain: PlainDbOnly | None = None
    try:
        if strategy == "textbook":
            r = await _per_request_client(redis_url, concurrency + 8)
            save = await _textbook(r, pool, c, "tb")
        elif strategy == "redis-lock":
            r = await _per_request_client(redis_url, concurrency + 8)
            save = await _redis_lock(r, pool, c, "rl")
        elif strategy == "db-only":
            save = _DbOnly(pool, c).save
        elif strategy == "db-plain":
            plain = PlainDbOnly(pool, KIND, GatewayOptions().local_cache_size)
            save = plain.save
        else:
            gw = Gateway(redis_url, pg_url, namespace="bench", **(options or {}))
            await gw.open()

            async def save(value: str) -> bool:
                assert gw is not None
                return (await gw.save(KIND, value)).created

        if ready is not None:
            await ready()
        latencies = array("d", bytes(8 * len(values)))
        cpu0 = _own_cpu_s()
        if rate is None:
            seconds, created, errors = await _closed_loop(save, values, concurrency, latencies)
        else:
            seconds, created, errors = await _open_loop(save, values, rate, concurrency, latencies)
        cpu = _own_cpu_s() - cpu0
        c.batches = c.redis  # one command at a time, each awaited before the next
        if plain is not None:
            c.statements, c.rows_sent = plain.statements, plain.rows_sent
        local = 0  # answered by this process's local tier (dedup only)
        if gw is not None:
            # Counted after the close: until then this process may still be the fleet's
            # shared writer, writing rows of processes that are not finished yet.
            await gw.aclose()
            stats = gw.stats()
            gw = None
            c.redis, c.batches, c.statements, c.rows_sent = (
                stats.redis_round_trips,
                stats.redis_batches,
                stats.db_statements,
                stats.db_rows_sent,
            )
            local = stats.local
        return {
            "seconds": seconds,
            **percentiles(latencies),
            "redis_round_trips": c.redis,
            "redis_batches": c.batches,
            "db_statements": c.statements,
            "rows_sent": c.rows_sent,
            "created": created,
            "errors": errors,
            "gateway_cpu_s": cpu,
            "local_share": local / max(len(values), 1),
            "latencies": latencies,
        }
    finally:
        if gw is not None:
            await gw.aclose()
        await pool.close()  # backends flush their statistics when they exit
        if r is not None:
            await r.aclose()
