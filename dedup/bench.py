"""``dedup bench``: dedup against the textbook pattern and the database alone, in one run.

Strategies, each on the same stream, concurrency, Redis and PostgreSQL, with the
Redis keys and rows of earlier runs removed between runs (only the bench's own):

- ``textbook``: per request GET the saved marker, SET NX PX a lock, re-check,
  INSERT one row, SET the marker, release with a compare-and-delete script;
- ``redis-lock``: redis-py's ``Lock`` around the re-check and the insert, with the marker;
- ``db-only``: no Redis; an in-process LRU and singleflight, and one sorted multi-row
  ``INSERT ... ON CONFLICT DO NOTHING`` per event-loop tick;
- ``dedup``: the :class:`~dedup.Gateway`.

Client-counted Redis round trips are checked against the server's ``INFO
commandstats`` and statements against PostgreSQL's ``pg_stat_database``.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import os
import random
import resource
import secrets
import shutil
import subprocess
import sys
import time
import tracemalloc
from array import array
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from redis.asyncio import ConnectionPool, Redis

from dedup.claims import unlink_matching
from dedup.demo import make_stream
from dedup.gateway import Gateway
from dedup.keys import digest
from dedup.local import SavedCache
from dedup.loop import run as run_loop
from dedup.store import keep_session

__all__ = ["BenchConfig", "RunResult", "run_bench"]

KIND = "bench"
STRATEGIES = ("textbook", "redis-lock", "db-only", "dedup")

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


@dataclass
class BenchConfig:
    """Sizes of one bench run."""

    requests: int = 200_000
    concurrency: int = 256
    zipf_values: int = 1_000_000
    uniform_values: int = 10_000_000
    processes: tuple[int, ...] = (1, 2, 4)
    memory_values: int = 1_000_000
    seed: int = 1


@dataclass
class RunResult:
    """What one strategy did on one workload."""

    strategy: str
    workload: str
    processes: int
    requests: int
    unique: int
    seconds: float
    p50_ms: float
    p99_ms: float
    redis_round_trips: int
    redis_server_calls: int
    db_statements: int
    db_server_xacts: int
    rows_sent: int
    rows: int
    errors: int
    created: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rps(self) -> float:
        """Requests per second."""
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def passed(self) -> bool:
        """Exactly one row per unique value, and as many ``created`` answers."""
        return self.rows == self.unique == self.created and self.errors == 0


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


async def _server_calls(r: Redis) -> dict[str, int]:
    stats: dict[str, Any] = await r.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def _top_level_calls(strategy: str, before: dict[str, int], after: dict[str, int]) -> int:
    """Commands the clients sent, from the server's INFO commandstats.

    commandstats also counts the commands a script runs inside, so those are taken
    out: dedup's scripts run GET/SET/PEXPIRE/DEL only inside scripts; the textbook and
    redis-py releases run one GET (and a DEL when the lock is theirs) per script call.
    """
    # Connection handshakes (redis-py's CLIENT SETINFO, SELECT, AUTH) and our own
    # INFO reads are per connection, not per request: left out.
    handshake = ("info", "client|setinfo", "select", "auth", "hello")
    delta = {k: v - before.get(k, 0) for k, v in after.items() if k not in handshake}
    total = sum(v for k, v in delta.items() if not k.startswith("config"))
    if strategy == "dedup":
        nested = sum(delta.get(k, 0) for k in ("get", "set", "pexpire", "del"))
    elif strategy in ("textbook", "redis-lock"):
        nested = delta.get("evalsha", 0) + delta.get("eval", 0) + delta.get("del", 0)
    else:
        nested = 0
    return total - nested


async def _server_xacts(pg_url: str) -> int:
    """Transactions PostgreSQL counted for this database (each statement here is one)."""
    await asyncio.sleep(0.2)  # let exiting backends report
    conn = await asyncpg.connect(pg_url)
    try:
        return int(await conn.fetchval(XACTS))
    finally:
        await conn.close()


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


async def run_one(
    strategy: str, values: Sequence[str], concurrency: int, redis_url: str, pg_url: str
) -> dict[str, Any]:
    """Run ``strategy`` over ``values`` in this process; returns raw counts and timings."""
    c = _Counter()
    xacts0 = await _server_xacts(pg_url)
    r = Redis.from_pool(ConnectionPool.from_url(redis_url, max_connections=concurrency + 8))
    # Every strategy gets the sink's pool settings: no reset query on release.
    pool = await asyncpg.create_pool(pg_url, min_size=4, max_size=32, reset=keep_session)
    gw: Gateway | None = None
    db_only: _DbOnly | None = None
    try:
        calls0 = await _server_calls(r)
        if strategy == "textbook":
            save = await _textbook(r, pool, c, "tb")
        elif strategy == "redis-lock":
            save = await _redis_lock(r, pool, c, "rl")
        elif strategy == "db-only":
            db_only = _DbOnly(pool, c)
            save = db_only.save
        elif strategy == "dedup":
            gw = Gateway(redis_url, pg_url, namespace="bench")
            await gw.open()

            async def save(value: str) -> bool:
                assert gw is not None
                return (await gw.save(KIND, value)).created

        else:
            raise ValueError(f"unknown strategy {strategy!r}")
        latencies = array("d", bytes(8 * len(values)))
        ticket = iter(range(len(values)))
        created = errors = 0

        async def worker() -> None:
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
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
        if gw is not None:
            stats = gw.stats()
            c.redis, c.statements, c.rows_sent = (
                stats.redis_round_trips,
                stats.db_statements,
                stats.db_rows_sent,
            )
            await gw.aclose()
            gw = None
        calls = _top_level_calls(strategy, calls0, await _server_calls(r))
        await pool.close()  # backends flush their statistics when they exit
        xacts = await _server_xacts(pg_url) - xacts0 - 1
        ordered = sorted(latencies)
        return {
            "seconds": seconds,
            "p50_ms": ordered[len(ordered) // 2] * 1000,
            "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000,
            "redis_round_trips": c.redis,
            "redis_server_calls": max(calls, 0),
            "db_statements": c.statements,
            "db_server_xacts": max(xacts, 0),
            "rows_sent": c.rows_sent,
            "created": created,
            "errors": errors,
        }
    finally:
        if gw is not None:
            await gw.aclose()
        await pool.close()
        await r.aclose()


def _values(workload: str, cfg: BenchConfig) -> list[str]:
    n = cfg.zipf_values if workload == "zipf" else cfg.uniform_values
    s = 1.1 if workload == "zipf" else 0.0
    if s == 0.0:
        rng = random.Random(cfg.seed)
        ranks: Sequence[int] = [rng.randrange(n) for _ in range(cfg.requests)]
    else:
        ranks = make_stream(cfg.requests, n, s, cfg.seed)
    return [f"user-{rank:09d}@example.com" for rank in ranks]


async def _count_rows(pg_url: str) -> int:
    conn = await asyncpg.connect(pg_url)
    try:
        return int(await conn.fetchval(COUNT_ROWS, KIND))
    finally:
        await conn.close()


def _worker_main() -> None:
    """Child process of a multi-process run: reads a job as JSON, waits for "go", runs it."""
    job = json.loads(sys.stdin.readline())
    values = job["values"]

    async def main() -> dict[str, Any]:
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        return await run_one(
            job["strategy"], values, job["concurrency"], job["redis_url"], job["pg_url"]
        )

    result = run_loop(main())
    print(json.dumps(result), flush=True)


def _run_processes(
    strategy: str, values: list[str], n: int, cfg: BenchConfig, redis_url: str, pg_url: str
) -> dict[str, Any]:
    """N OS processes, each a share of the stream (round robin), started together."""
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
        for i, p in enumerate(procs):
            assert p.stdin is not None and p.stdout is not None
            job = {
                "strategy": strategy,
                "values": values[i::n],
                "concurrency": max(1, cfg.concurrency // n),
                "redis_url": redis_url,
                "pg_url": pg_url,
            }
            p.stdin.write(json.dumps(job) + "\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a bench worker failed to start")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            p.wait(timeout=600)
            results.append(json.loads(line))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    total: dict[str, Any] = {
        k: sum(r[k] for r in results)
        for k in ("redis_round_trips", "db_statements", "rows_sent", "created", "errors")
    }
    total["seconds"] = max(r["seconds"] for r in results)
    total["p50_ms"] = max(r["p50_ms"] for r in results)
    total["p99_ms"] = max(r["p99_ms"] for r in results)
    # Server-side counts are global: each worker measured the whole server.
    total["redis_server_calls"] = max(r["redis_server_calls"] for r in results)
    total["db_server_xacts"] = max(r["db_server_xacts"] for r in results)
    return total


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
) -> dict[str, Any]:
    """Run every strategy on both workloads, the multi-process runs, ceilings and memory."""
    results: list[RunResult] = []
    report: dict[str, Any] = {"config": asdict(cfg), "runs": [], "ceilings": {}, "memory": {}}
    for workload in ("zipf", "uniform"):
        values = _values(workload, cfg)
        unique = len(set(values))
        for strategy in STRATEGIES:
            run_loop(_reset(redis_url, pg_url))
            log(f"{workload:<8} {strategy:<11} 1 process ...")
            raw = run_loop(run_one(strategy, values, cfg.concurrency, redis_url, pg_url))
            rows = run_loop(_count_rows(pg_url))
            results.append(RunResult(strategy, workload, 1, len(values), unique, rows=rows, **raw))
        if workload == "zipf":
            for strategy in ("db-only", "dedup"):
                for n in cfg.processes:
                    if n == 1:
                        continue
                    run_loop(_reset(redis_url, pg_url))
                    log(f"{workload:<8} {strategy:<11} {n} processes ...")
                    raw = _run_processes(strategy, values, n, cfg, redis_url, pg_url)
                    rows = run_loop(_count_rows(pg_url))
                    results.append(
                        RunResult(strategy, workload, n, len(values), unique, rows=rows, **raw)
                    )
        report["ceilings"].update(run_loop(_insert_ceiling(pg_url, values)))
    report["ceilings"].update(_redis_ceiling(redis_url, redis_port))
    report["memory"] = run_loop(_memory(redis_url, pg_url, cfg.memory_values))
    run_loop(_reset(redis_url, pg_url))
    report["ceilings"]["cpu_count"] = os.cpu_count()
    report["ceilings"]["max_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report["runs"] = [{**asdict(r), "rps": r.rps, "passed": r.passed} for r in results]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2))
    chart = _chart(results, out_dir / "bench.png")
    if chart:
        report["chart"] = str(chart)
    return report


def _chart(results: Sequence[RunResult], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, workload in zip(axes, ("zipf", "uniform"), strict=True):
        runs = [r for r in results if r.workload == workload and r.processes == 1]
        ax.bar([r.strategy for r in runs], [r.rps for r in runs], color="#4477aa")
        ax.set_title(f"{workload}: requests/s (1 process)")
        ax.set_ylabel("requests/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_table(report: dict[str, Any]) -> str:
    """The result table: one line per run, then ratios, ceilings and memory."""
    runs = report["runs"]
    head = (
        f"{'workload':<8} {'strategy':<11} {'procs':>5} {'req/s':>9} {'p50 ms':>7} "
        f"{'p99 ms':>8} {'RT/req':>8} {'srvRT/req':>9} {'stmt/uniq':>9} {'rows/uniq':>9} "
        f"{'x(a)':>6} {'x(c)':>6}  rows==unique"
    )
    lines = [head, "-" * len(head)]
    for r in runs:
        base = {
            s: next(
                x["rps"]
                for x in runs
                if x["workload"] == r["workload"] and x["strategy"] == s and x["processes"] == 1
            )
            for s in ("textbook", "db-only")
        }
        n, u = r["requests"], max(r["unique"], 1)
        lines.append(
            f"{r['workload']:<8} {r['strategy']:<11} {r['processes']:>5} {r['rps']:>9,.0f} "
            f"{r['p50_ms']:>7.2f} {r['p99_ms']:>8.2f} {r['redis_round_trips'] / n:>8.4f} "
            f"{r['redis_server_calls'] / n:>9.4f} {r['db_statements'] / u:>9.4f} "
            f"{r['rows_sent'] / u:>9.3f} {r['rps'] / base['textbook']:>6.1f} "
            f"{r['rps'] / base['db-only']:>6.2f}  {'PASS' if r['passed'] else 'FAIL'}"
        )
    lines.append("")
    for k, v in {**report["ceilings"], **report["memory"]}.items():
        lines.append(f"{k:<40} {v:>14,.1f}" if isinstance(v, float) else f"{k:<40} {v:>14}")
    return "\n".join(lines)


QUICK = BenchConfig(
    requests=20_000,
    concurrency=128,
    zipf_values=100_000,
    uniform_values=1_000_000,
    processes=(1, 2),
    memory_values=50_000,
)


def bench_command(
    *,
    quick: bool,
    redis_url: str | None,
    database_url: str | None,
    out_dir: Path,
    requests: int | None = None,
) -> int:
    """``dedup bench``: start throwaway servers unless URLs are given, run, print, exit 0/1."""
    from contextlib import ExitStack

    from dedup.migrate import upgrade
    from dedup.servers import PostgresCluster, RedisServer

    cfg = QUICK if quick else BenchConfig()
    if requests is not None:
        cfg = BenchConfig(**{**asdict(cfg), "requests": requests})

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with ExitStack() as stack:
        port: int | None = None
        if redis_url is None:
            server = stack.enter_context(RedisServer())
            redis_url, port = server.url, server.port
        elif redis_url.startswith("redis://127.0.0.1:"):
            port = int(redis_url.split(":")[2].split("/")[0])
        if database_url is None:
            cluster = stack.enter_context(PostgresCluster())
            database_url = cluster.create_database("bench")
        upgrade(database_url)
        log(f"bench: {cfg}")
        report = run_bench(
            cfg, redis_url=redis_url, pg_url=database_url, redis_port=port, out_dir=out_dir, log=log
        )
    print(format_table(report))
    print(
        f"\nJSON: {out_dir / 'bench.json'}"
        + (f"  chart: {report['chart']}" if "chart" in report else "")
    )
    ok = all(r["passed"] for r in report["runs"])
    print(f"rows == unique values for every run: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1
