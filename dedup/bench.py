"""``dedup bench``: dedup against the textbook pattern and the database alone, from one
process to a fleet of them.

Strategies, each on the same stream, Redis and PostgreSQL, with the Redis keys and
rows of earlier runs removed between runs (only the bench's own):

- ``textbook``: per request GET the saved marker, SET NX PX a lock, re-check,
  INSERT one row, SET the marker, release with a compare-and-delete script;
- ``redis-lock``: redis-py's ``Lock`` around the re-check and the insert, with the marker;
- ``db-only``: no Redis; an in-process LRU and singleflight, and one sorted multi-row
  ``INSERT ... ON CONFLICT DO NOTHING`` per event-loop tick;
- ``dedup``: the :class:`~dedup.Gateway`.

Every run is one or more OS processes (``python -c ...bench._worker_main``), each with
its round-robin share of the stream and of the callers, started together. A closed
loop keeps ``concurrency`` callers busy; an open loop (``rate``) offers requests on a
fixed timetable and measures latency from each request's scheduled time. The parent
merges the processes' raw latencies (real percentiles), sums their CPU time
(``getrusage`` around the run) and reads the servers' own counts: Redis round trips
from ``INFO commandstats``, transactions from ``pg_stat_database``, and the CPU time of
the redis-server and PostgreSQL processes when the bench started them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import csv
import json
import math
import os
import random
import re
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from array import array
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import asyncpg
from redis.asyncio import ConnectionPool, Redis

from dedup import Gateway
from dedup.claims import unlink_matching
from dedup.demo import make_stream
from dedup.errors import DedupError
from dedup.keys import digest
from dedup.local import SavedCache
from dedup.loop import run as run_loop
from dedup.servers import _descendants
from dedup.store import keep_session

__all__ = [
    "PER_REQUEST",
    "STRATEGIES",
    "WORKLOADS",
    "BenchConfig",
    "Planned",
    "RunResult",
    "ServerPids",
    "bench_command",
    "config_from_flags",
    "format_table",
    "plan",
    "run_bench",
    "run_one",
]

KIND = "bench"
STRATEGIES = ("textbook", "redis-lock", "db-only", "dedup")
# One Redis lock per request: far too slow for the fleet sweep, and they add nothing
# to it; they run in one process, on every workload, at the first concurrency.
PER_REQUEST = ("textbook", "redis-lock")
WORKLOADS = ("zipf", "uniform")

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
COUNT_ROWS = "SELECT count(*) FROM dedup_items WHERE kind = $1"
XACTS = (
    "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
)

RELEASE = """
-- KEYS[1]: the lock key; ARGV[1]: the holder's token
-- Returns: 1 if the lock was ours and is deleted, else 0
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# The open loop's timetable is kept by a dispatcher that wakes at least this often
# (never busy-waits: that would count as the gateway's CPU).
_TICK_S = 0.001
_WORKER_TIMEOUT_S = 3600.0


@dataclass
class BenchConfig:
    """What one ``dedup bench`` runs (see :func:`plan`)."""

    requests: int = 1_000_000
    # Callers in all, split over the processes of a run. The first value is used for
    # the process sweep; every value runs in one process on every workload.
    concurrency: tuple[int, ...] = (256, 1024)
    processes: tuple[int, ...] = (1, 4, 8, 16)
    workloads: tuple[str, ...] = WORKLOADS
    strategies: tuple[str, ...] = ("db-only", "dedup")
    # Open-loop runs: requests/s offered in all, on the first workload at every
    # process count; empty for none.
    rates: tuple[float, ...] = ()
    # Bound on the requests in flight in an open-loop run (in all, split like callers).
    outstanding: int = 1024
    zipf_values: int = 1_000_000
    uniform_values: int = 10_000_000
    memory_values: int = 1_000_000
    seed: int = 1

    def validate(self) -> None:
        """Raise :class:`DedupError` naming the first flag that makes no sense."""

        def need(ok: bool, message: str) -> None:
            if not ok:
                raise DedupError(message)

        need(self.requests >= 1, "--requests must be at least 1")
        need(bool(self.concurrency), "--concurrency needs at least one value")
        need(all(c >= 1 for c in self.concurrency), "--concurrency values must be >= 1")
        need(bool(self.processes), "--processes needs at least one value")
        need(all(1 <= p <= 256 for p in self.processes), "--processes values must be 1-256")
        need(bool(self.workloads), "--workloads needs at least one value")
        for w in self.workloads:
            need(w in WORKLOADS, f"--workloads: unknown {w!r} (choose from {', '.join(WORKLOADS)})")
        need(bool(self.strategies), "--strategies needs at least one value")
        for s in self.strategies:
            need(
                s in STRATEGIES,
                f"--strategies: unknown {s!r} (choose from {', '.join(STRATEGIES)})",
            )
        need(all(math.isfinite(r) and r > 0 for r in self.rates), "--rate values must be > 0")
        need(self.outstanding >= 1, "--outstanding must be at least 1")
        # Every process gets at least one caller (and one request in flight).
        need(
            self.concurrency[0] >= max(self.processes),
            "--concurrency: the first value must be at least the largest --processes",
        )
        need(
            not self.rates or self.outstanding >= max(self.processes),
            "--outstanding must be at least the largest --processes",
        )


@dataclass(frozen=True)
class Planned:
    """One run of the plan: a strategy on a workload, in ``processes`` processes."""

    workload: str
    strategy: str
    processes: int
    concurrency: int
    rate: float | None = None  # requests/s offered in all; None is a closed loop


def plan(cfg: BenchConfig) -> list[Planned]:
    """The runs of ``cfg``, in order.

    The first workload runs every strategy at every process count with the first
    concurrency (the fleet view; strategies interleaved so that the ones compared are
    measured close together), then in one process at the other concurrencies, then
    open-loop at every rate and process count. Every other workload runs in one
    process at every concurrency. Per-request strategies run once per workload only,
    in one process at the first concurrency.
    """
    runs: list[Planned] = []
    first, more = cfg.concurrency[0], cfg.concurrency[1:]
    fleet = [s for s in cfg.strategies if s not in PER_REQUEST]
    slow = [s for s in cfg.strategies if s in PER_REQUEST]
    for i, workload in enumerate(dict.fromkeys(cfg.workloads)):
        runs += [Planned(workload, s, 1, first) for s in slow]
        if i == 0:
            for n in dict.fromkeys(cfg.processes):
                runs += [Planned(workload, s, n, first) for s in fleet]
        else:
            runs += [Planned(workload, s, 1, first) for s in fleet]
        for c in dict.fromkeys(more):
            runs += [Planned(workload, s, 1, c) for s in fleet]
        if i == 0:
            for rate in dict.fromkeys(cfg.rates):
                for n in dict.fromkeys(cfg.processes):
                    runs += [Planned(workload, s, n, cfg.outstanding, rate) for s in fleet]
    return runs


@dataclass
class RunResult:
    """What one strategy did on one workload, summed over its processes."""

    strategy: str
    workload: str
    processes: int
    concurrency: int  # callers in all; for an open loop, the bound on outstanding requests
    rate: float | None  # requests/s offered in all (open loop), or None (closed loop)
    requests: int
    unique: int
    seconds: float  # first request to last answer (the slowest process)
    p50_ms: float  # percentiles of every request of every process, merged
    p99_ms: float
    max_ms: float
    redis_round_trips: int  # counted by the clients
    redis_server_calls: int  # counted by Redis (INFO commandstats), scripts' own calls out
    db_statements: int  # counted by the clients
    db_server_xacts: int  # counted by PostgreSQL (pg_stat_database), gateways' open to close
    rows_sent: int
    rows: int
    errors: int
    created: int
    gateway_cpu_s: float  # user + system CPU of the gateway processes during the run
    redis_cpu_s: float | None  # of redis-server, when the bench started it
    pg_cpu_s: float | None  # of the postmaster and all its backends, when the bench started it
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rps(self) -> float:
        """Requests per second (for an open loop: the achieved rate)."""
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def passed(self) -> bool:
        """Exactly one row per unique value, and as many ``created`` answers."""
        return self.rows == self.unique == self.created and self.errors == 0

    def derived(self) -> dict[str, Any]:
        """The per-request, per-unique-value and per-second figures of the table."""
        n, u, s = max(self.requests, 1), max(self.unique, 1), self.seconds or math.inf
        return {
            "rps": self.rps,
            "passed": self.passed,
            "redis_round_trips_per_request": self.redis_round_trips / n,
            "redis_server_calls_per_request": self.redis_server_calls / n,
            "db_statements_per_unique": self.db_statements / u,
            "db_xacts_per_unique": self.db_server_xacts / u,
            "rows_sent_per_unique": self.rows_sent / u,
            "db_statements_per_s": self.db_statements / s,
            "db_xacts_per_s": self.db_server_xacts / s,
            "gateway_cpu_us_per_request": 1e6 * self.gateway_cpu_s / n,
            "gateway_cpu_us_per_unique": 1e6 * self.gateway_cpu_s / u,
        }


# ----------------------------------------------------------------------------- strategies


class _Counter:
    """Client-side counts shared by a strategy's requests."""

    def __init__(self) -> None:
        self.redis = 0
        self.statements = 0
        self.rows_sent = 0


Saver = Callable[[str], Awaitable[bool]]


async def _textbook(r: Redis, pool: asyncpg.Pool, c: _Counter, ns: str) -> Saver:
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


async def _redis_lock(r: Redis, pool: asyncpg.Pool, c: _Counter, ns: str) -> Saver:
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
        self.local = SavedCache(100_000)
        self.inflight: dict[bytes, asyncio.Future[bool]] = {}
        self.queue: list[tuple[bytes, str]] = []
        self.scheduled = False
        self.running = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def save(self, value: str) -> bool:
        d = digest(value)
        if (KIND, d) in self.local:
            return False
        fut = self.inflight.get(d)
        if fut is not None:
            await asyncio.shield(fut)
            return False
        fut = asyncio.get_running_loop().create_future()
        self.inflight[d] = fut
        self.queue.append((d, value))
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)
        return await asyncio.shield(fut)

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
            for d, _ in batch:
                self.local.add(KIND, d)
                self.inflight.pop(d).set_result(d in inserted)
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


def _percentiles(latencies: Sequence[float]) -> dict[str, float]:
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
) -> dict[str, Any]:
    """Run ``strategy`` over ``values`` in this process; returns its counts and timings.

    A closed loop of ``concurrency`` callers, or with ``rate`` an open loop offering
    ``rate`` requests/s with at most ``concurrency`` in flight. ``ready`` is awaited
    once everything is open, just before the clock starts. The result's
    ``latencies`` holds every request's latency in seconds, in stream order.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}")
    c = _Counter()
    r: Redis | None = None
    # Every strategy gets the sink's pool settings: no reset query on release.
    pool = await asyncpg.create_pool(pg_url, min_size=4, max_size=32, reset=keep_session)
    gw: Gateway | None = None
    try:
        if strategy == "textbook":
            r = Redis.from_pool(ConnectionPool.from_url(redis_url, max_connections=concurrency + 8))
            save = await _textbook(r, pool, c, "tb")
        elif strategy == "redis-lock":
            r = Redis.from_pool(ConnectionPool.from_url(redis_url, max_connections=concurrency + 8))
            save = await _redis_lock(r, pool, c, "rl")
        elif strategy == "db-only":
            save = _DbOnly(pool, c).save
        else:
            gw = Gateway(redis_url, pg_url, namespace="bench")
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
        if gw is not None:
            stats = gw.stats()
            c.redis, c.statements, c.rows_sent = (
                stats.redis_round_trips,
                stats.db_statements,
                stats.db_rows_sent,
            )
            await gw.aclose()
            gw = None
        return {
            "seconds": seconds,
            **_percentiles(latencies),
            "redis_round_trips": c.redis,
            "db_statements": c.statements,
            "rows_sent": c.rows_sent,
            "created": created,
            "errors": errors,
            "gateway_cpu_s": cpu,
            "latencies": latencies,
        }
    finally:
        if gw is not None:
            await gw.aclose()
        await pool.close()  # backends flush their statistics when they exit
        if r is not None:
            await r.aclose()


# ------------------------------------------------------------------- server-side counts


async def _server_calls(redis_url: str) -> dict[str, int]:
    r = Redis.from_url(redis_url)
    try:
        stats: dict[str, Any] = await r.info("commandstats")
    finally:
        await r.aclose()
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def _top_level_calls(strategy: str, before: dict[str, int], after: dict[str, int]) -> int:
    """Commands the clients sent, from the server's INFO commandstats.

    commandstats also counts the commands a script runs inside, so those are taken
    out: for dedup, every command named in the package's Lua scripts (the gateway sends
    script calls only); the textbook and redis-py releases run one GET (and a DEL when
    the lock is theirs) per script call.
    """
    # Connection handshakes (redis-py's CLIENT SETINFO, SELECT, AUTH) and our own
    # INFO reads are per connection, not per request: left out.
    handshake = ("info", "client|setinfo", "select", "auth", "hello")
    delta = {k: v - before.get(k, 0) for k, v in after.items() if k not in handshake}
    total = sum(v for k, v in delta.items() if not k.startswith("config"))
    if strategy == "dedup":
        nested = sum(delta.get(k, 0) for k in _gateway_script_commands())
    elif strategy in PER_REQUEST:
        nested = delta.get("evalsha", 0) + delta.get("eval", 0) + delta.get("del", 0)
    else:
        nested = 0
    return total - nested


_LUA_CALL = re.compile(r"""redis\.p?call\(\s*['"]([A-Za-z]+)['"]""")


def _gateway_script_commands() -> set[str]:
    """Commands named in the Lua scripts of the loaded ``dedup`` modules (bench's aside)."""
    found: set[str] = set()
    for name, module in list(sys.modules.items()):
        if name.startswith("dedup.") and name != __name__:
            for value in vars(module).values():
                if isinstance(value, str) and "redis." in value:
                    found.update(m.lower() for m in _LUA_CALL.findall(value))
    return found


async def _server_xacts(pg_url: str) -> int:
    """Transactions PostgreSQL counted for this database (each statement here is one).

    The reading connection's own transaction is counted when it exits, after the read.
    """
    await asyncio.sleep(0.2)  # let exiting backends report
    conn = await asyncpg.connect(pg_url)
    try:
        return int(await conn.fetchval(XACTS))
    finally:
        await conn.close()


@dataclass(frozen=True)
class ServerPids:
    """The redis-server and postmaster PIDs of servers the bench started (else None)."""

    redis: int | None = None
    postgres: int | None = None


_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU of ``pid`` and of its children it has reaped (Linux /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    # After "pid (comm) ": state is field 3; utime, stime, cutime, cstime are 14-17.
    fields = stat[stat.rfind(")") + 2 :].split()
    return sum(int(x) for x in fields[11:15]) / _TICKS_PER_S


def _servers_cpu_s(pids: ServerPids) -> tuple[float | None, float | None]:
    """CPU seconds so far of redis-server and of PostgreSQL (postmaster and backends).

    A backend that exits moves its time into the postmaster's reaped-children figure,
    so a difference of two readings counts every backend that ran between them.
    """
    redis_s = _proc_cpu_s(pids.redis) if pids.redis is not None else None
    pg_s = None
    if pids.postgres is not None:
        pg_s = sum(_proc_cpu_s(p) for p in [pids.postgres, *_descendants(pids.postgres)])
    return redis_s, pg_s


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


# --------------------------------------------------------------------------- processes


def _value_of(rank: int) -> str:
    return f"user-{rank:09d}@example.com"


def _ranks(workload: str, cfg: BenchConfig) -> array[int]:
    """The stream of ``workload``: ranks of values, hottest first for Zipf(1.1)."""
    if workload == "uniform":
        rng = random.Random(cfg.seed)
        n = cfg.uniform_values
        return array("l", (rng.randrange(n) for _ in range(cfg.requests)))
    return make_stream(cfg.requests, cfg.zipf_values, 1.1, cfg.seed)


def _values(workload: str, cfg: BenchConfig) -> list[str]:
    """The stream of ``workload`` as the values saved."""
    return [_value_of(rank) for rank in _ranks(workload, cfg)]


def _worker_main() -> None:
    """A process of a run: reads its job (JSON), opens, says "ready", waits for "go", runs.

    Its latencies go to the job's file (raw doubles), its counts to stdout (JSON).
    """
    job = json.loads(sys.stdin.readline())
    ranks = array("l")
    ranks.frombytes(Path(job["ranks"]).read_bytes())
    values = [_value_of(rank) for rank in ranks]

    async def ready() -> None:
        print("ready", flush=True)
        if (await asyncio.to_thread(sys.stdin.readline)).strip() != "go":
            raise SystemExit("bench worker: no go")

    result = run_loop(
        run_one(
            job["strategy"],
            values,
            job["concurrency"],
            job["redis_url"],
            job["pg_url"],
            rate=job["rate"],
            ready=ready,
        )
    )
    latencies: array[float] = result.pop("latencies")
    Path(job["latencies"]).write_bytes(latencies.tobytes())
    print(json.dumps(result), flush=True)


def _split(total: int, n: int) -> list[int]:
    """``total`` spread over ``n`` shares that differ by at most one, each at least 1."""
    base, extra = divmod(total, n)
    return [max(1, base + (i < extra)) for i in range(n)]


def _run_processes(
    run: Planned,
    ranks: array[int],
    redis_url: str,
    pg_url: str,
    pids: ServerPids,
    tmp: Path,
) -> dict[str, Any]:
    """``run.processes`` OS processes, each a round-robin share of the stream, started
    together; their counts summed, their latencies merged, the servers' counts read."""
    n = run.processes
    callers = _split(run.concurrency, n)
    jobs: list[dict[str, Any]] = []
    for i in range(n):
        part = tmp / f"ranks-{i}.bin"
        part.write_bytes(ranks[i::n].tobytes())
        jobs.append(
            {
                "strategy": run.strategy,
                "ranks": str(part),
                "latencies": str(tmp / f"latencies-{i}.bin"),
                "concurrency": callers[i],
                "rate": None if run.rate is None else run.rate / n,
                "redis_url": redis_url,
                "pg_url": pg_url,
            }
        )
    calls0 = run_loop(_server_calls(redis_url))
    xacts0 = run_loop(_server_xacts(pg_url))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", "from dedup.bench import _worker_main; _worker_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    try:
        for p, job in zip(procs, jobs, strict=True):
            assert p.stdin is not None
            p.stdin.write(json.dumps(job) + "\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a bench worker of {run} failed to start")
        redis0, pg0 = _servers_cpu_s(pids)
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"a bench worker of {run} failed (see its error above)")
            results.append(json.loads(line))
        redis1, pg1 = _servers_cpu_s(pids)
        for p in procs:
            p.wait(timeout=_WORKER_TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            for pipe in (p.stdin, p.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):  # a dead worker's pipe
                        pipe.close()
    xacts = run_loop(_server_xacts(pg_url)) - xacts0 - 1  # -1: the first read's own
    calls = _top_level_calls(run.strategy, calls0, run_loop(_server_calls(redis_url)))
    latencies = array("d")
    for job in jobs:
        latencies.frombytes(Path(job["latencies"]).read_bytes())
    total: dict[str, Any] = {
        k: sum(r[k] for r in results)
        for k in ("redis_round_trips", "db_statements", "rows_sent", "created", "errors")
    }
    return {
        **total,
        "concurrency": sum(callers),
        "seconds": max(r["seconds"] for r in results),
        **_percentiles(latencies),
        "redis_server_calls": max(calls, 0),
        "db_server_xacts": max(xacts, 0),
        "gateway_cpu_s": sum(r["gateway_cpu_s"] for r in results),
        "redis_cpu_s": _minus(redis1, redis0),
        "pg_cpu_s": _minus(pg1, pg0),
    }


# ------------------------------------------------------------------------ between runs


NAMESPACES = ("tb", "rl", "bench", "mem")


async def _reset(redis_url: str, pg_url: str) -> None:
    """Remove what earlier runs left: only the bench's own keys and rows, never others'."""
    r = Redis.from_url(redis_url)
    try:
        for ns in NAMESPACES:
            await unlink_matching(r, f"{ns}:*")
    finally:
        await r.aclose()
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("DELETE FROM dedup_items WHERE kind = $1", KIND)
        await conn.execute("VACUUM dedup_items")
        with contextlib.suppress(asyncpg.PostgresError):  # needs superuser; best effort
            await conn.execute("CHECKPOINT")
    finally:
        await conn.close()


async def _count_rows(pg_url: str) -> int:
    conn = await asyncpg.connect(pg_url)
    try:
        return int(await conn.fetchval(COUNT_ROWS, KIND))
    finally:
        await conn.close()


# ------------------------------------------------------------------------------ ceilings


def _redis_ceiling(redis_url: str, port: int | None) -> dict[str, float]:
    """Pipelined script calls per second on the same Redis, via redis-benchmark."""
    exe = shutil.which("redis-benchmark")
    if exe is None or port is None:
        return {}
    out = subprocess.run(
        [exe, "-h", "127.0.0.1", "-p", str(port), "-n", "200000", "-P", "32", "-q", "--csv",
         "EVAL", "local v = redis.call('GET', KEYS[1]) if not v then "
         "redis.call('SET', KEYS[1], 'x', 'PX', 5000) end return 1", "1", "k:__rand_int__"],
        capture_output=True, text=True, timeout=120, check=False,
    ).stdout  # fmt: skip
    for row in csv.reader(out.splitlines()):
        if len(row) > 1 and row[0].upper().startswith("EVAL"):
            return {"redis_script_calls_per_s_pipelined_32": float(row[1])}
    return {}


async def _insert_ceiling(pg_url: str, values: Sequence[str]) -> dict[str, float]:
    """Rows per second of one bulk COPY of the unique rows into the same table."""
    rows = [(KIND, digest(v), v) for v in dict.fromkeys(values)]
    conn = await asyncpg.connect(pg_url)
    try:
        # A scratch copy of the table (same columns, key and WAL logging), dropped after.
        await conn.execute("DROP TABLE IF EXISTS dedup_bench_copy")
        await conn.execute("CREATE TABLE dedup_bench_copy (LIKE dedup_items INCLUDING ALL)")
        t0 = time.perf_counter()
        await conn.copy_records_to_table(
            "dedup_bench_copy", records=rows, columns=["kind", "digest", "value"]
        )
        seconds = time.perf_counter() - t0
        await conn.execute("DROP TABLE dedup_bench_copy")
    finally:
        await conn.close()
    return {"bulk_copy_rows_per_s": len(rows) / seconds}


async def _memory(redis_url: str, pg_url: str, n: int) -> dict[str, float]:
    """Redis bytes per saved value and the local tier's bytes per entry."""
    await _reset(redis_url, pg_url)
    r = Redis.from_url(redis_url)
    try:
        before = int((await r.info("memory"))["used_memory"])
        async with Gateway(redis_url, pg_url, namespace="mem", local_cache_size=0) as gw:
            step = 5000
            for start in range(0, n, step):
                await gw.save_many([(KIND, f"m{i}") for i in range(start, min(n, start + step))])
        after = int((await r.info("memory"))["used_memory"])
    finally:
        await r.aclose()
    # The local tier: everything it allocates (its dict and its keys) per entry, once
    # filled, and again once as many new values went through it (each one evicting): the
    # dict has then been rebuilt under churn, which is the size a long-running gateway keeps.
    size = min(n, 200_000)
    digests = [digest(f"m{i}") for i in range(2 * size)]
    tracemalloc.start()
    cache = SavedCache(size)
    for d in digests[:size]:
        cache.add(KIND, d)
    filled, _ = tracemalloc.get_traced_memory()
    for d in digests[size:]:
        cache.add(KIND, d)
    churned, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(cache) <= size
    return {
        "redis_bytes_per_saved_value": (after - before) / n,
        "local_cache_bytes_per_entry": filled / size,
        "local_cache_bytes_per_entry_churned": churned / size,
        "memory_values": n,
    }


# ------------------------------------------------------------------------------- driver


def run_bench(
    cfg: BenchConfig,
    *,
    redis_url: str,
    pg_url: str,
    redis_port: int | None,
    out_dir: Path,
    log: Callable[[str], None],
    pids: ServerPids | None = None,
) -> dict[str, Any]:
    """Run the :func:`plan` of ``cfg``, then the ceilings and memory; write JSON and chart."""
    cfg.validate()
    pids = pids or ServerPids()
    results: list[RunResult] = []
    report: dict[str, Any] = {"config": asdict(cfg), "runs": [], "ceilings": {}, "memory": {}}
    streams: dict[str, tuple[array[int], int]] = {}
    with tempfile.TemporaryDirectory(prefix="dedup-bench-") as tmp:
        for run in plan(cfg):
            if run.workload not in streams:
                ranks = _ranks(run.workload, cfg)
                streams[run.workload] = ranks, len(set(ranks))
                report["ceilings"].update(
                    run_loop(_insert_ceiling(pg_url, [_value_of(x) for x in set(ranks)]))
                )
            ranks, unique = streams[run.workload]
            run_loop(_reset(redis_url, pg_url))
            how = "closed loop" if run.rate is None else f"open loop, {run.rate:,.0f} req/s"
            log(
                f"{run.workload:<8} {run.strategy:<11} {run.processes:>2} process(es), "
                f"{run.concurrency} {'callers' if run.rate is None else 'in flight'}, {how} ..."
            )
            raw = _run_processes(run, ranks, redis_url, pg_url, pids, Path(tmp))
            rows = run_loop(_count_rows(pg_url))
            results.append(
                RunResult(
                    run.strategy,
                    run.workload,
                    run.processes,
                    rate=run.rate,
                    requests=len(ranks),
                    unique=unique,
                    rows=rows,
                    **raw,
                )
            )
    report["ceilings"].update(_redis_ceiling(redis_url, redis_port))
    report["memory"] = run_loop(_memory(redis_url, pg_url, cfg.memory_values))
    run_loop(_reset(redis_url, pg_url))
    report["ceilings"]["cpu_count"] = os.cpu_count()
    report["ceilings"]["max_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report["runs"] = [{**asdict(r), **r.derived()} for r in results]
    out_dir.mkdir(parents=True, exist_ok=True)
    chart = _chart(report["runs"], out_dir / "bench.png")
    if chart:
        report["chart"] = str(chart)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2))
    return report


def _fleet(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs of the process sweep: first workload, first concurrency, closed loop."""
    fleet = [r for r in runs if r["strategy"] not in PER_REQUEST and r["rate"] is None]
    if not fleet:
        return []
    first = fleet[0]
    return [
        r
        for r in fleet
        if (r["workload"], r["concurrency"]) == (first["workload"], first["concurrency"])
    ]


def _chart(runs: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """The fleet view: statements, transactions, rows and requests/s against processes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fleet = _fleet(runs)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = {"db-only": "#cc6677", "dedup": "#4477aa"}
    for strategy in dict.fromkeys(r["strategy"] for r in fleet):
        mine = sorted((r for r in fleet if r["strategy"] == strategy), key=lambda r: r["processes"])
        x = [r["processes"] for r in mine]
        color = colors.get(strategy)
        axes[0].plot(x, [r["db_statements_per_unique"] for r in mine], "o-", color=color,
                     label=f"{strategy}: statements (client)")  # fmt: skip
        axes[0].plot(x, [r["db_xacts_per_unique"] for r in mine], "s--", color=color,
                     label=f"{strategy}: transactions (PostgreSQL)")  # fmt: skip
        axes[1].plot(x, [r["rows_sent_per_unique"] for r in mine], "o-", color=color,
                     label=strategy)  # fmt: skip
        axes[2].plot(x, [r["rps"] for r in mine], "o-", color=color, label=f"{strategy} (closed)")
        for rate in dict.fromkeys(r["rate"] for r in runs if r["rate"] is not None):
            opened = sorted(
                (r for r in runs if r["strategy"] == strategy and r["rate"] == rate),
                key=lambda r: r["processes"],
            )
            axes[2].plot([r["processes"] for r in opened], [r["rps"] for r in opened], "^:",
                         color=color, label=f"{strategy} (offered {rate:,.0f}/s)")  # fmt: skip
    workload = fleet[0]["workload"] if fleet else ""
    callers = fleet[0]["concurrency"] if fleet else 0
    titles = (
        "database statements per unique value",
        "rows sent per unique value",
        "requests/s (achieved)",
    )
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(f"{title}\n{workload}, {callers} callers in all", fontsize=10)
        ax.set_xlabel("gateway processes")
        ax.set_xticks(sorted({r["processes"] for r in fleet}) or [1])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(value: float | None, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


COLUMNS = (
    # (heading, width): see the README's "Performance" for what each one means.
    ("workload", 8), ("strategy", 10), ("procs", 5), ("callers", 7), ("offered", 9),
    ("req/s", 9), ("p50 ms", 7), ("p99 ms", 8), ("RT/req", 7), ("srvRT/req", 9),
    ("stmt/uniq", 9), ("xact/uniq", 9), ("rows/uniq", 9), ("xact/s", 7),
    ("cpu us/req", 10), ("cpu us/uniq", 11), ("redis cpu", 9), ("pg cpu", 7),
    ("x(a)", 5), ("x(c)", 5),
)  # fmt: skip


def format_table(report: dict[str, Any]) -> str:
    """The result table: one line per run, then ceilings and memory."""
    runs = report["runs"]
    head = " ".join(f"{h:<{w}}" if i < 2 else f"{h:>{w}}" for i, (h, w) in enumerate(COLUMNS))
    lines = [head + "  rows==unique", "-" * (len(head) + 14)]

    def rps_of(strategy: str, r: dict[str, Any], *, same_shape: bool) -> float | None:
        for x in runs:
            if (
                x["workload"] == r["workload"]
                and x["strategy"] == strategy
                and (
                    not same_shape
                    or (x["processes"], x["concurrency"], x["rate"])
                    == (r["processes"], r["concurrency"], r["rate"])
                )
            ):
                return float(x["rps"]) or None
        return None

    for r in runs:
        textbook = rps_of("textbook", r, same_shape=False)
        db_only = rps_of("db-only", r, same_shape=True)
        cells = [
            f"{r['workload']:<8}",
            f"{r['strategy']:<10}",
            f"{r['processes']:>5}",
            f"{r['concurrency']:>7}",
            f"{'closed':>9}" if r["rate"] is None else f"{r['rate']:>9,.0f}",
            f"{r['rps']:>9,.0f}",
            f"{r['p50_ms']:>7.3f}",
            f"{r['p99_ms']:>8.2f}",
            f"{r['redis_round_trips_per_request']:>7.4f}",
            f"{r['redis_server_calls_per_request']:>9.4f}",
            f"{r['db_statements_per_unique']:>9.4f}",
            f"{r['db_xacts_per_unique']:>9.4f}",
            f"{r['rows_sent_per_unique']:>9.3f}",
            f"{r['db_xacts_per_s']:>7,.0f}",
            f"{r['gateway_cpu_us_per_request']:>10.2f}",
            f"{r['gateway_cpu_us_per_unique']:>11.1f}",
            _fmt(r["redis_cpu_s"], ".2f", 9),
            _fmt(r["pg_cpu_s"], ".2f", 7),
            _fmt(None if textbook is None else r["rps"] / textbook, ".1f", 5),
            _fmt(None if db_only is None else r["rps"] / db_only, ".2f", 5),
        ]
        lines.append(" ".join(cells) + f"  {'PASS' if r['passed'] else 'FAIL'}")
    lines.append("")
    for k, v in {**report["ceilings"], **report["memory"]}.items():
        lines.append(f"{k:<40} {v:>14,.1f}" if isinstance(v, float) else f"{k:<40} {v:>14}")
    return "\n".join(lines)


QUICK = BenchConfig(
    requests=20_000,
    concurrency=(128, 512),
    processes=(1, 2),
    rates=(20_000.0,),
    zipf_values=100_000,
    uniform_values=1_000_000,
    memory_values=50_000,
)


def _list(flag: str, text: str, convert: Callable[[str], Any]) -> tuple[Any, ...]:
    try:
        items = tuple(convert(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise DedupError(f"{flag}: not a comma-separated list of numbers: {text!r}") from None
    if not items:
        raise DedupError(f"{flag}: give at least one value")
    return items


def _number(text: str) -> float:
    return float(text.replace("_", "").lower().replace("k", "e3").replace("m", "e6"))


def config_from_flags(
    *,
    quick: bool = False,
    requests: int | None = None,
    concurrency: str | None = None,
    processes: str | None = None,
    workloads: str | None = None,
    strategies: str | None = None,
    rate: str | None = None,
    outstanding: int | None = None,
) -> BenchConfig:
    """The run of ``dedup bench``'s flags: ``--quick`` (or the default) with the flags
    given on top; lists are comma-separated. Raises :class:`DedupError` on nonsense."""
    cfg = QUICK if quick else BenchConfig()
    given: dict[str, Any] = {}
    if requests is not None:
        given["requests"] = requests
    if concurrency is not None:
        given["concurrency"] = _list("--concurrency", concurrency, int)
    if processes is not None:
        given["processes"] = _list("--processes", processes, int)
    if workloads is not None:
        given["workloads"] = _list("--workloads", workloads, str)
    if strategies is not None:
        given["strategies"] = _list("--strategies", strategies, str)
    if rate is not None:
        given["rates"] = () if rate.strip() in ("", "0", "none") else _list("--rate", rate, _number)
    if outstanding is not None:
        given["outstanding"] = outstanding
    cfg = replace(cfg, **given)
    cfg.validate()
    return cfg


def bench_command(
    *,
    quick: bool,
    redis_url: str | None,
    database_url: str | None,
    out_dir: Path,
    requests: int | None = None,
    cfg: BenchConfig | None = None,
) -> int:
    """``dedup bench``: start throwaway servers unless URLs are given, run, print, exit 0/1."""
    from contextlib import ExitStack

    from dedup.migrate import upgrade
    from dedup.servers import PostgresCluster, RedisServer

    if cfg is None:
        cfg = config_from_flags(quick=quick, requests=requests)
    cfg.validate()

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with ExitStack() as stack:
        port: int | None = None
        redis_pid = pg_pid = None
        if redis_url is None:
            server = stack.enter_context(RedisServer())
            redis_url, port, redis_pid = server.url, server.port, server.pid
        elif redis_url.startswith("redis://127.0.0.1:"):
            port = int(redis_url.split(":")[2].split("/")[0])
        if database_url is None:
            cluster = stack.enter_context(PostgresCluster())
            database_url, pg_pid = cluster.create_database("bench"), cluster.pid
        upgrade(database_url)
        log(f"bench: {cfg}")
        log(f"bench: {len(plan(cfg))} runs")
        report = run_bench(
            cfg,
            redis_url=redis_url,
            pg_url=database_url,
            redis_port=port,
            out_dir=out_dir,
            log=log,
            pids=ServerPids(redis_pid, pg_pid),
        )
    print(format_table(report))
    print(
        f"\nJSON: {out_dir / 'bench.json'}"
        + (f"  chart: {report['chart']}" if "chart" in report else "")
    )
    ok = all(r["passed"] for r in report["runs"])
    print(f"rows == unique values for every run: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1
