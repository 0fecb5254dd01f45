"""``dedup bench``: dedup against the textbook pattern and the database alone, from one
process to a fleet of them.

Strategies (``textbook``, ``redis-lock``, ``db-only``, ``dedup``), each on the same
stream, Redis and PostgreSQL, with the Redis keys and rows of earlier runs removed
between runs (only the bench's own). The Redis is one server or a Redis Cluster
(``redis+cluster://``); with ``cluster=True`` (``--cluster``) every run that uses Redis
runs twice, on one Redis and then on a 3-primary cluster, same stream and shape, and the
report compares the two. This module is the plan (:class:`BenchConfig`, :func:`plan`),
the driver (:func:`run_bench`, :func:`bench_command`) and the report (the table, the
JSON and the chart); the rest is in:

- :mod:`dedup.bench.strategies`: the strategies and :func:`run_one`, one run in one
  process, closed or open loop, with every request's latency;
- :mod:`dedup.bench.procs`: the OS processes of a run, their merged latencies and
  summed CPU, the servers' own counts (``INFO commandstats`` of every primary,
  ``pg_stat_database``, ``/proc``), and the reset between runs;
- :mod:`dedup.bench.memory`: Redis bytes per saved value, of the gateway and of each
  marker layout.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import asyncpg

from dedup._values import digest
from dedup.bench.memory import gateway_memory, measure_layouts
from dedup.bench.procs import ServerPids, count_rows, reset, run_processes, value_of
from dedup.bench.report import _chart, baseline_check, cluster_comparison, format_table
from dedup.bench.strategies import KIND, PER_REQUEST, REDIS_FREE, STRATEGIES, run_one
from dedup.cli.demo import make_stream
from dedup.errors import DedupError
from dedup.loop import run as run_loop
from dedup.urls import CLUSTER_SCHEMES, redact

__all__ = [
    "CLUSTER_PRIMARIES",
    "PER_REQUEST",
    "REDIS_FREE",
    "STRATEGIES",
    "WORKLOADS",
    "BenchConfig",
    "Planned",
    "RunResult",
    "ServerPids",
    "bench_command",
    "config_from_flags",
    "plan",
    "run_bench",
    "run_one",
    "workload_values",
]

WORKLOADS = ("zipf", "uniform")
CLUSTER_PRIMARIES = 3
"""Primaries of the throwaway Redis Cluster of ``--cluster`` (no replicas)."""


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
    # Values saved for the memory figures: through the gateway, and in each marker layout.
    memory_values: int = 1_000_000
    seed: int = 1
    # Every run that uses Redis runs twice: on one Redis, then on a throwaway Redis
    # Cluster of CLUSTER_PRIMARIES primaries (same stream and shape), compared in the report.
    cluster: bool = False

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
        need(self.memory_values >= 1, "--memory-values must be at least 1")
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
    cluster: bool = False  # on the Redis Cluster of ``--cluster`` rather than the Redis


def plan(cfg: BenchConfig) -> list[Planned]:
    """The runs of ``cfg``, in order.

    The first workload runs every strategy at every process count with the first
    concurrency (the fleet view; strategies interleaved so that the ones compared are
    measured close together), then in one process at the other concurrencies, then
    open-loop at every rate and process count. Every other workload runs in one
    process at every concurrency. Per-request strategies run once per workload only,
    in one process at the first concurrency. With ``cfg.cluster``, each run of a
    strategy that uses Redis is followed at once by its twin on the cluster (measured
    close together, like the strategies).
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
    if not cfg.cluster:
        return runs
    twinned: list[Planned] = []
    for run in runs:
        twinned.append(run)
        if run.strategy not in REDIS_FREE:
            twinned.append(replace(run, cluster=True))
    return twinned


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
    # The Redis of the run: a cluster or not, and its primaries (0: the strategy uses none).
    cluster: bool
    redis_nodes: int
    redis_round_trips: int  # counted by the clients; on a cluster, one per node pipeline
    # Sequential round trips counted by the clients: the gateway's claim, commit and abort
    # batches (one each however many nodes it spans); every command of the others.
    redis_batches: int
    redis_server_calls: int  # counted by Redis (INFO commandstats), scripts' own calls out
    redis_server_calls_by_node: dict[str, int]  # the same, per primary ("" for one Redis)
    db_statements: int  # counted by the clients
    db_server_xacts: int  # counted by PostgreSQL (pg_stat_database), gateways' open to close
    rows_sent: int
    rows: int
    errors: int
    created: int
    gateway_cpu_s: float  # user + system CPU of the gateway processes during the run
    redis_cpu_s: float | None  # of redis-server, when the bench started it
    pg_cpu_s: float | None  # of the postmaster and all its backends, when the bench started it
    # Per process, the share of its requests its local tier answered (dedup; 0 otherwise).
    local_share: list[float] = field(default_factory=list)
    # Per process, its time from first request to last answer, and its CPU: the run lasts
    # as long as the slowest (with shared writes, often the fleet's writer).
    process_seconds: list[float] = field(default_factory=list)
    process_cpu_s: list[float] = field(default_factory=list)
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
            "redis_batches_per_request": self.redis_batches / n,
            # The nodes a batch reaches: 1 on one Redis, up to the primaries on a cluster.
            "redis_round_trips_per_batch": self.redis_round_trips / max(self.redis_batches, 1),
            "redis_round_trips_per_node_per_request": (
                self.redis_round_trips / max(self.redis_nodes, 1) / n
            ),
            "redis_server_calls_per_request": self.redis_server_calls / n,
            "db_statements_per_unique": self.db_statements / u,
            "db_xacts_per_unique": self.db_server_xacts / u,
            "rows_sent_per_unique": self.rows_sent / u,
            "db_statements_per_s": self.db_statements / s,
            "db_xacts_per_s": self.db_server_xacts / s,
            "gateway_cpu_us_per_request": 1e6 * self.gateway_cpu_s / n,
            "gateway_cpu_us_per_unique": 1e6 * self.gateway_cpu_s / u,
        }


# ------------------------------------------------------------------------------ streams


def _ranks(workload: str, cfg: BenchConfig) -> array[int]:
    """The stream of ``workload``: ranks of values, hottest first for Zipf(1.1)."""
    if workload == "uniform":
        rng = random.Random(cfg.seed)
        n = cfg.uniform_values
        return array("l", (rng.randrange(n) for _ in range(cfg.requests)))
    return make_stream(cfg.requests, cfg.zipf_values, 1.1, cfg.seed)


def workload_values(workload: str, cfg: BenchConfig) -> list[str]:
    """The stream of ``workload`` as the values saved."""
    return [value_of(rank) for rank in _ranks(workload, cfg)]


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


# ------------------------------------------------------------------------------- driver


def _is_cluster(redis_url: str) -> bool:
    return redis_url.startswith(CLUSTER_SCHEMES)


def run_bench(
    cfg: BenchConfig,
    *,
    redis_url: str,
    pg_url: str,
    redis_port: int | None,
    out_dir: Path,
    log: Callable[[str], None],
    pids: ServerPids | None = None,
    cluster_url: str | None = None,
    cluster_pids: ServerPids | None = None,
) -> dict[str, Any]:
    """Run the :func:`plan` of ``cfg``, then the ceilings and memory (the gateway's, and
    each marker layout's at ``memory_values``); write JSON and chart.

    ``redis_url`` is one Redis or a cluster (``redis+cluster://``); with ``cfg.cluster``
    the plan's cluster runs go to ``cluster_url`` (required then), whose servers'
    PIDs are ``cluster_pids``. The redis-benchmark ceiling is measured on one Redis only
    (its ``EVAL`` keys are not routed by slot), and said so in the report's notes."""
    cfg.validate()
    if cfg.cluster and cluster_url is None:
        raise DedupError("cluster runs need the cluster's URL (cluster_url)")
    pids = pids or ServerPids()
    cluster_pids = cluster_pids or ServerPids()
    results: list[RunResult] = []
    report: dict[str, Any] = {
        "config": asdict(cfg),
        "runs": [],
        "ceilings": {},
        "memory": {},
        "notes": [],
    }
    notes: list[str] = report["notes"]
    streams: dict[str, tuple[array[int], int]] = {}
    with tempfile.TemporaryDirectory(prefix="dedup-bench-") as tmp:
        for run in plan(cfg):
            if run.workload not in streams:
                ranks = _ranks(run.workload, cfg)
                streams[run.workload] = ranks, len(set(ranks))
                report["ceilings"].update(
                    run_loop(_insert_ceiling(pg_url, [value_of(x) for x in set(ranks)]))
                )
            ranks, unique = streams[run.workload]
            url, run_pids = redis_url, pids
            if run.cluster:
                assert cluster_url is not None
                url, run_pids = cluster_url, cluster_pids
            run_loop(reset(url, pg_url))
            how = "closed loop" if run.rate is None else f"open loop, {run.rate:,.0f} req/s"
            where = " on the cluster" if run.cluster else ""
            log(
                f"{run.workload:<8} {run.strategy:<11} {run.processes:>2} process(es), "
                f"{run.concurrency} {'callers' if run.rate is None else 'in flight'}, {how}"
                f"{where} ..."
            )
            raw = run_processes(run, ranks, url, pg_url, run_pids, Path(tmp))
            rows = run_loop(count_rows(pg_url))
            uses_redis = run.strategy not in REDIS_FREE
            results.append(
                RunResult(
                    run.strategy,
                    run.workload,
                    run.processes,
                    rate=run.rate,
                    requests=len(ranks),
                    unique=unique,
                    rows=rows,
                    cluster=uses_redis and _is_cluster(url),
                    redis_nodes=len(raw["redis_server_calls_by_node"]) if uses_redis else 0,
                    **raw,
                )
            )
    if _is_cluster(redis_url):
        notes.append(
            "redis-benchmark ceiling: skipped, the Redis is a cluster (its EVAL keys are not "
            "routed by slot); a node's ceiling is one redis-server's: run the bench on one"
        )
    else:
        report["ceilings"].update(_redis_ceiling(redis_url, redis_port))
        if cfg.cluster:
            notes.append(
                "redis-benchmark ceiling: on the one Redis only (each cluster node is the "
                "same redis-server; redis-benchmark's EVAL keys are not routed by slot)"
            )
    report["memory"] = run_loop(gateway_memory(redis_url, pg_url, cfg.memory_values))
    run_loop(reset(redis_url, pg_url))
    if _is_cluster(redis_url):
        notes.append(
            "redis_bytes_per_saved_value: on the cluster, used_memory summed over its primaries"
        )
    if cluster_url is not None and cfg.cluster:
        log(f"memory   gateway     {cfg.memory_values:,} values on the cluster ...")
        on_cluster = run_loop(gateway_memory(cluster_url, pg_url, cfg.memory_values, local=False))
        report["memory"]["cluster_redis_bytes_per_saved_value"] = on_cluster[
            "redis_bytes_per_saved_value"
        ]
        run_loop(reset(cluster_url, pg_url))
        notes.append(
            "cluster_redis_bytes_per_saved_value: the same through the gateway on the "
            "cluster, used_memory summed over its primaries"
        )
    report["ceilings"]["cpu_count"] = os.cpu_count()
    report["ceilings"]["max_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Last, each on a redis-server of its own: the runs' Redis is left alone, and the
    # maximum RSS above is the bench's before the layouts' key lists exist.
    report["memory"]["layouts"] = run_loop(measure_layouts(cfg.memory_values, log))
    report["runs"] = [{**asdict(r), **r.derived()} for r in results]
    check = baseline_check(report["runs"])
    if check:
        report["baseline_check"] = check
    comparison = cluster_comparison(report["runs"])
    if comparison:
        report["cluster"] = {
            "url": redact(cluster_url or redis_url),
            "primaries": max(r["redis_nodes"] for r in report["runs"] if r["cluster"]),
            "comparison": comparison,
        }
    out_dir.mkdir(parents=True, exist_ok=True)
    chart = _chart(report["runs"], out_dir / "bench.png")
    if chart:
        report["chart"] = str(chart)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2))
    return report


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
    memory_values: str | None = None,
    cluster: bool = False,
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
    if memory_values is not None:
        try:
            given["memory_values"] = int(_number(memory_values))
        except ValueError:
            raise DedupError(f"--memory-values: not a number: {memory_values!r}") from None
    if cluster:
        given["cluster"] = True
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
    """``dedup bench``: start throwaway servers unless URLs are given, run, print, exit 0/1.

    With ``cfg.cluster`` it also starts a throwaway Redis Cluster (:data:`CLUSTER_PRIMARIES`
    primaries, no replicas; stopped by PID at the end) for the plan's cluster runs;
    ``redis_url`` must then be one Redis or None."""
    from contextlib import ExitStack

    from dedup.store.migrate import upgrade
    from dedup.testing.cluster import RedisClusterServers
    from dedup.testing.servers import PostgresCluster, RedisServer

    if cfg is None:
        cfg = config_from_flags(quick=quick, requests=requests)
    cfg.validate()
    if cfg.cluster and redis_url is not None and _is_cluster(redis_url):
        raise DedupError(
            "--cluster compares one Redis with a throwaway cluster it starts itself: give "
            "--redis-url one Redis (redis://...) or none; to bench your own cluster alone, "
            "give its redis+cluster:// URL without --cluster"
        )

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with ExitStack() as stack:
        port: int | None = None
        redis_pid = pg_pid = None
        cluster_url: str | None = None
        cluster_pids: tuple[int, ...] = ()
        if redis_url is None:
            server = stack.enter_context(RedisServer())
            redis_url, port, redis_pid = server.url, server.port, server.pid
        elif redis_url.startswith("redis://127.0.0.1:"):
            port = int(redis_url.split(":")[2].split("/")[0])
        if cfg.cluster:
            log(f"bench: starting a Redis Cluster ({CLUSTER_PRIMARIES} primaries, no replicas)")
            servers = stack.enter_context(RedisClusterServers(CLUSTER_PRIMARIES, 0))
            cluster_url, cluster_pids = servers.url, tuple(node.pid for node in servers.nodes)
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
            cluster_url=cluster_url,
            cluster_pids=ServerPids(cluster_pids or None, pg_pid),
        )
    print(format_table(report))
    print(
        f"\nJSON: {out_dir / 'bench.json'}"
        + (f"  chart: {report['chart']}" if "chart" in report else "")
    )
    ok = all(r["passed"] for r in report["runs"])
    print(f"rows == unique values for every run: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1
