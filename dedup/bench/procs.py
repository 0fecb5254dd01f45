"""The processes of a ``dedup bench`` run and the servers' own counts around it.

Every run is one or more OS processes (``python -c ...worker_main``), each with its
round-robin share of the stream and of the callers, started together. The parent
merges the processes' raw latencies (real percentiles), sums their CPU time
(``getrusage`` around the run) and reads the servers' own counts: Redis commands from
``INFO commandstats`` (of every primary on a Redis Cluster, and per node),
transactions from ``pg_stat_database``, and the CPU time of the redis-server processes
(every node of a cluster) and of PostgreSQL when the bench started them. Between runs
:func:`reset` removes the bench's own keys and rows, never others'.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from dedup._redis.connect import connect_redis, unlink_matching
from dedup.bench.strategies import KIND, PER_REQUEST, percentiles, run_one
from dedup.loop import run as run_loop
from dedup.store.sinks import PG_FORGETTING
from dedup.testing.process import _descendants

if TYPE_CHECKING:
    from dedup.bench import Planned

__all__ = [
    "NAMESPACES",
    "ServerPids",
    "admin_client",
    "count_rows",
    "reset",
    "run_processes",
    "value_of",
    "worker_main",
]

COUNT_ROWS = "SELECT count(*) FROM dedup_items WHERE kind = $1"
XACTS = (
    "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
)
_WORKER_TIMEOUT_S = 3600.0


# ------------------------------------------------------------------- server-side counts


def admin_client(redis_url: str) -> Redis | RedisCluster:
    """A client of the bench's own reads and resets: one Redis or a Redis Cluster
    (``redis+cluster://``), by the URL."""
    return connect_redis(redis_url, max_connections=8, timeout_s=60.0)


async def _server_calls(redis_url: str) -> dict[str, dict[str, int]]:
    """Calls per command from INFO commandstats, per primary (``""`` for one Redis)."""
    r = admin_client(redis_url)
    try:
        answers: dict[str, dict[str, Any]] = {}
        if isinstance(r, RedisCluster):
            await r.initialize()
            for node in r.get_primaries():
                answers[node.name] = await r.info("commandstats", target_nodes=node)
        else:
            answers[""] = await r.info("commandstats")
    finally:
        await r.aclose()
    return {
        node: {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
        for node, stats in answers.items()
    }


def _top_level_calls_by_node(
    strategy: str, before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]
) -> dict[str, int]:
    """:func:`_top_level_calls` of each primary (``""`` for one Redis)."""
    return {
        node: max(_top_level_calls(strategy, before.get(node, {}), calls), 0)
        for node, calls in after.items()
    }


def _top_level_calls(strategy: str, before: dict[str, int], after: dict[str, int]) -> int:
    """Commands the clients sent, from the server's INFO commandstats.

    commandstats also counts the commands a script runs inside, so those are taken
    out: for dedup, every command named in the package's Lua scripts (the gateway sends
    script calls only); the textbook and redis-py releases run one GET (and a DEL when
    the lock is theirs) per script call.
    """
    # Connection handshakes (redis-py's CLIENT SETINFO, SELECT, AUTH; a cluster
    # client's CLUSTER SLOTS and COMMAND) and our own INFO reads are per connection,
    # not per request: left out.
    handshake = ("info", "client|setinfo", "select", "auth", "hello")
    delta = {k: v - before.get(k, 0) for k, v in after.items() if k not in handshake}
    per_connection = ("config", "cluster", "command")
    total = sum(v for k, v in delta.items() if not k.startswith(per_connection))
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
        # The bench's own modules are not the gateway: their scripts (the textbook's
        # release) are counted like any command.
        if name.startswith("dedup.") and not name.startswith(("dedup.bench", "dedup.testing")):
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
    """The redis-server and postmaster PIDs of servers the bench started (else None).

    ``redis`` is one PID, or a tuple of them: every node of a Redis Cluster, whose CPU
    is summed."""

    redis: int | tuple[int, ...] | None = None
    postgres: int | None = None

    @property
    def redis_pids(self) -> tuple[int, ...]:
        """The redis-server PIDs (none when the bench did not start the Redis)."""
        if self.redis is None:
            return ()
        return (self.redis,) if isinstance(self.redis, int) else tuple(self.redis)


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
    """CPU seconds so far of redis-server (every node of a cluster, summed) and of
    PostgreSQL (postmaster and backends).

    A backend that exits moves its time into the postmaster's reaped-children figure,
    so a difference of two readings counts every backend that ran between them.
    """
    redis_pids = pids.redis_pids
    redis_s = sum(_proc_cpu_s(p) for p in redis_pids) if redis_pids else None
    pg_s = None
    if pids.postgres is not None:
        pg_s = sum(_proc_cpu_s(p) for p in [pids.postgres, *_descendants(pids.postgres)])
    return redis_s, pg_s


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


# --------------------------------------------------------------------------- processes


def value_of(rank: int) -> str:
    """The value saved for ``rank`` of a stream (the same in every process and run)."""
    return f"user-{rank:09d}@example.com"


def worker_main() -> None:
    """A process of a run: reads its job (JSON), opens, says "ready", waits for "go", runs.

    Its latencies go to the job's file (raw doubles), its counts to stdout (JSON).
    """
    job = json.loads(sys.stdin.readline())
    ranks = array("l")
    ranks.frombytes(Path(job["ranks"]).read_bytes())
    values = [value_of(rank) for rank in ranks]

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


def run_processes(
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
            [sys.executable, "-c", "from dedup.bench.procs import worker_main; worker_main()"],
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
    by_node = _top_level_calls_by_node(run.strategy, calls0, run_loop(_server_calls(redis_url)))
    latencies = array("d")
    for job in jobs:
        latencies.frombytes(Path(job["latencies"]).read_bytes())
    total: dict[str, Any] = {
        k: sum(r[k] for r in results)
        for k in (
            "redis_round_trips",
            "redis_batches",
            "db_statements",
            "rows_sent",
            "created",
            "errors",
        )
    }
    return {
        **total,
        "concurrency": sum(callers),
        "seconds": max(r["seconds"] for r in results),
        **percentiles(latencies),
        "redis_server_calls": sum(by_node.values()),
        "redis_server_calls_by_node": by_node,
        "db_server_xacts": max(xacts, 0),
        "gateway_cpu_s": sum(r["gateway_cpu_s"] for r in results),
        "local_share": [r["local_share"] for r in results],
        "process_seconds": [r["seconds"] for r in results],
        "process_cpu_s": [r["gateway_cpu_s"] for r in results],
        "redis_cpu_s": _minus(redis1, redis0),
        "pg_cpu_s": _minus(pg1, pg0),
    }


# ------------------------------------------------------------------------ between runs


NAMESPACES = ("tb", "rl", "bench", "mem")


async def reset(redis_url: str, pg_url: str) -> None:
    """Remove what earlier runs left: only the bench's own keys and rows, never others'."""
    r = admin_client(redis_url)
    try:
        for ns in NAMESPACES:
            await unlink_matching(r, f"{ns}:*")
    finally:
        await r.aclose()
    conn = await asyncpg.connect(pg_url)
    try:
        async with conn.transaction():
            # The bench's own delete, as dedup's: no tombstones (its keys are gone too).
            await conn.execute(PG_FORGETTING)
            await conn.execute("DELETE FROM dedup_items WHERE kind = $1", KIND)
        await conn.execute("VACUUM dedup_items")
        with contextlib.suppress(asyncpg.PostgresError):  # needs superuser; best effort
            await conn.execute("CHECKPOINT")
    finally:
        await conn.close()


async def count_rows(pg_url: str) -> int:
    conn = await asyncpg.connect(pg_url)
    try:
        return int(await conn.fetchval(COUNT_ROWS, KIND))
    finally:
        await conn.close()
