"""``dedup bench`` on tiny sizes: its plan, table and JSON (behaviour, never timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import redis

from dedup import bench
from dedup.bench.strategies import percentiles
from dedup.errors import DedupError
from tests.servers import PostgresCluster, RedisServer

ROOT = Path(__file__).resolve().parent.parent
FLEET = ("db-only", "db-plain", "dedup")  # the strategies of the process sweep, in order


def _check_run(r: dict[str, Any]) -> None:
    """The invariants of every run, whatever its strategy and shape."""
    assert r["passed"] and r["rows"] == r["unique"] == r["created"], r
    assert r["errors"] == 0, r
    assert 0 <= r["p50_ms"] <= r["p99_ms"] <= r["max_ms"], r
    assert r["gateway_cpu_s"] > 0 and r["gateway_cpu_us_per_request"] > 0, r
    assert r["gateway_cpu_us_per_unique"] >= r["gateway_cpu_us_per_request"], r
    assert r["rps"] > 0 and r["seconds"] > 0, r
    # Per process: the run's time is its slowest process's, its CPU their sum.
    assert len(r["process_seconds"]) == len(r["process_cpu_s"]) == r["processes"], r
    assert max(r["process_seconds"]) == r["seconds"], r
    assert sum(r["process_cpu_s"]) == pytest.approx(r["gateway_cpu_s"]), r
    assert r["db_statements"] >= 1 and r["db_server_xacts"] >= 1, r
    assert r["rows_sent"] >= r["unique"], r
    if r["strategy"] == "dedup":
        assert r["rows_sent"] == r["unique"], r  # no duplicate ever reached the database
    if r["strategy"] in ("db-only", "db-plain"):
        assert r["redis_round_trips"] == r["redis_server_calls"] == 0, r
        if r["processes"] == 1:
            # Its LRU answers every repeat of a saved value (none is evicted from a
            # stream this small) and its singleflight every repeat in flight: each
            # value reaches the database once.
            assert r["rows_sent"] == r["unique"], r
    if r["strategy"] == "textbook":
        assert r["redis_round_trips"] >= r["requests"], r  # at least one per request


def _check_layouts(memory: dict[str, Any], values: int) -> None:
    """Issue 12: bytes per saved value of each marker layout (sane, never timed)."""
    layouts = memory["layouts"]
    assert list(layouts) == ["compact", "keys", "approximate"], layouts
    for name, row in layouts.items():
        assert row["layout"] == name and row["values"] == values, row
        assert row["bytes_per_value"] > 0, row
        assert row["committed"] <= values and row["keys"] >= 1, row
    assert layouts["compact"]["committed"] == layouts["keys"]["committed"] == values
    assert layouts["compact"]["dup_answers_saved"] == layouts["keys"]["dup_answers_saved"] == 1.0
    assert layouts["compact"]["bytes_per_value"] < layouts["keys"]["bytes_per_value"], layouts
    assert layouts["keys"]["keys"] == values  # one per value
    assert layouts["compact"]["keys"] <= layouts["compact"]["marker_buckets"]
    approximate = layouts["approximate"]
    assert 0.0 <= approximate["fp_measured"] <= 0.1, approximate
    assert approximate["fp_configured"] == 0.01 and approximate["fp_probes"] >= 10_000


async def test_bench_cli_runs_every_strategy_and_shape(
    redis_url: str, pg_url: str, tmp_path: Path
) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        client.set("someone-elses-key", "stays")
    finally:
        client.close()
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(
            "INSERT INTO dedup_items (kind, digest, value) VALUES ('other', '\\x00', 'stays')"
        )
    finally:
        await conn.close()

    # Every strategy on both workloads, closed and open loops, in one process and at one
    # concurrency: each run costs a worker process and a database reset whatever its size,
    # the plan of several concurrencies is test_default_plan_holds_the_fleet_and_the_target_rows'
    # and two processes are test_bench_reads_the_servers_cpu_when_it_knows_their_pids'.
    run = subprocess.run(
        [sys.executable, "-m", "dedup", "bench", "--quick", "--requests", "500",
         "--strategies", "textbook,redis-lock,db-only,db-plain,dedup", "--processes", "1",
         "--concurrency", "8", "--rate", "4000", "--outstanding", "32",
         "--memory-values", "10k",
         "--redis-url", redis_url, "--database-url", pg_url, "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=170, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[-1] == "rows == unique values for every run: PASS"
    for heading in ("req/s", "p99 ms", "xact/uniq", "rows/uniq", "cpu us/uniq", "pg cpu"):
        assert heading in lines[0]
    report = json.loads((tmp_path / "bench.json").read_text())
    runs = report["runs"]
    shapes = {
        (r["workload"], r["strategy"], r["processes"], r["concurrency"], r["rate"]) for r in runs
    }
    assert shapes == {
        *(("zipf", s, 1, 8, None) for s in ("textbook", "redis-lock")),
        *(("zipf", s, 1, 8, None) for s in FLEET),
        *(("zipf", s, 1, 32, 4000.0) for s in FLEET),
        *(("uniform", s, 1, 8, None) for s in bench.STRATEGIES),
    }
    assert len(runs) == len(shapes) == len(bench.plan(bench.config_from_flags(
        quick=True, requests=500, strategies="textbook,redis-lock,db-only,db-plain,dedup",
        processes="1", concurrency="8", rate="4000", outstanding=32,
    )))  # fmt: skip
    for r in runs:
        _check_run(r)
        assert r["requests"] == 500
        # URLs were given: the bench did not start the servers, so it cannot tell their CPU.
        assert r["redis_cpu_s"] is None and r["pg_cpu_s"] is None
        if r["strategy"] == "dedup" and r["processes"] == 1:
            # The client's count is what the server saw (one process, nobody else), give
            # or take the per-connection setup (script loads, a subscription).
            client, server = r["redis_round_trips"], r["redis_server_calls"]
            assert abs(client - server) <= 10 + 0.02 * server, r
    # db-only beside db-plain on every shape both ran, in the JSON and the table.
    check = report["baseline_check"]
    assert [(c["workload"], c["processes"], c["concurrency"], c["rate"]) for c in check] == [
        (r["workload"], r["processes"], r["concurrency"], r["rate"])
        for r in runs
        if r["strategy"] == "db-only"
    ]
    by_shape = {(r["workload"], r["strategy"], r["processes"], r["concurrency"], r["rate"]): r
                for r in runs}  # fmt: skip
    for c in check:
        shape = c["workload"], c["processes"], c["concurrency"], c["rate"]
        db_only, plain = (by_shape[(shape[0], s, *shape[1:])] for s in ("db-only", "db-plain"))
        assert c["rps"] == [db_only["rps"], plain["rps"]], c
        assert c["rps_ratio"] == pytest.approx(db_only["rps"] / plain["rps"]), c
    summary = run.stdout[run.stdout.index("db-only against db-plain") :]
    assert len(summary.split("\n\n")[0].splitlines()) == 2 + len(check), summary
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert report["memory"]["redis_bytes_per_saved_value"] > 0
    assert report["config"]["memory_values"] == report["memory"]["memory_values"] == 10_000
    _check_layouts(report["memory"], 10_000)
    summary = run.stdout[run.stdout.index("by marker layout") :]
    for name in ("compact", "keys", "approximate"):
        assert f"\n{name} " in summary, summary
    assert report["ceilings"]["bulk_copy_rows_per_s"] > 0
    # It removed its own keys and rows only.
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.get("someone-elses-key") == b"stays"
    finally:
        client.close()
    conn = await asyncpg.connect(pg_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM dedup_items WHERE kind = 'other'") == 1
        assert await conn.fetchval("SELECT count(*) FROM dedup_items WHERE kind = 'bench'") == 0
    finally:
        await conn.close()


def test_bench_reads_the_servers_cpu_when_it_knows_their_pids(
    redis_server: RedisServer, pg_cluster: PostgresCluster, pg_url: str, tmp_path: Path
) -> None:
    """Multi-process closed and open loops, with the servers' PIDs: CPU of all three."""
    cfg = bench.BenchConfig(
        requests=4000, concurrency=(16,), processes=(2,), workloads=("zipf",),
        rates=(8000.0,), outstanding=64, zipf_values=20_000, memory_values=10_000,
    )  # fmt: skip
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    report = bench.run_bench(
        cfg,
        redis_url=redis_server.url,
        pg_url=pg_url,
        redis_port=redis_server.port,
        out_dir=tmp_path,
        log=lambda line: None,
        pids=bench.ServerPids(redis_server.pid, pg_cluster.pid),
    )
    runs = report["runs"]
    assert [(r["strategy"], r["processes"], r["rate"]) for r in runs] == [
        ("db-only", 2, None), ("dedup", 2, None), ("db-only", 2, 8000.0), ("dedup", 2, 8000.0),
    ]  # fmt: skip
    for r in runs:
        _check_run(r)
        assert r["pg_cpu_s"] > 0, r  # every run inserts its rows
        assert r["redis_cpu_s"] >= 0, r
    assert sum(r["redis_cpu_s"] for r in runs if r["strategy"] == "dedup") > 0
    _check_layouts(report["memory"], 10_000)
    table = bench.format_table(report)
    assert len(table.splitlines()) >= 2 + len(runs) + 2 + len(report["memory"]["layouts"])
    assert "bytes per saved value by marker layout" in table
    assert json.loads((tmp_path / "bench.json").read_text())["memory"] == report["memory"]
    assert (tmp_path / "bench.json").exists()


def test_default_plan_holds_the_fleet_and_the_target_rows() -> None:
    runs = bench.plan(bench.BenchConfig())
    shapes = [(r.workload, r.strategy, r.processes, r.concurrency, r.rate) for r in runs]
    assert shapes == [
        *(("zipf", s, n, 256, None) for n in (1, 4, 8, 16) for s in ("db-only", "dedup")),
        ("zipf", "db-only", 1, 1024, None),
        ("zipf", "dedup", 1, 1024, None),
        *(("uniform", s, 1, c, None) for c in (256, 1024) for s in ("db-only", "dedup")),
    ]
    assert bench.BenchConfig().requests == 1_000_000
    with_rate = bench.plan(bench.config_from_flags(rate="200k", processes="1,8"))
    opened = [(r.processes, r.concurrency, r.rate) for r in with_rate if r.rate is not None]
    assert opened == [(1, 1024, 200_000.0)] * 2 + [(8, 1024, 200_000.0)] * 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"requests": 0}, "--requests"),
        ({"processes": "1,x"}, "--processes"),
        ({"processes": "0"}, "--processes"),
        ({"workloads": "zipf,normal"}, "--workloads"),
        ({"strategies": "dedup,fast"}, "--strategies"),
        ({"rate": "-5"}, "--rate"),
        ({"rate": "nan"}, "--rate"),
        ({"concurrency": "4", "processes": "1,8"}, "--concurrency"),
        ({"outstanding": 0}, "--outstanding"),
        ({"memory_values": "0"}, "--memory-values"),
        ({"memory_values": "many"}, "--memory-values"),
    ],
)
def test_flags_that_make_no_sense_are_refused(flags: dict[str, Any], message: str) -> None:
    with pytest.raises(DedupError, match=message):
        bench.config_from_flags(**flags)


def test_percentiles_are_of_the_merged_latencies() -> None:
    """Issue 14: a fleet's p99 is the p99 of all its requests, not its worst process's."""
    one = [0.001] * 1000
    other = [0.001] * 985 + [0.050] * 15  # this process alone: p99 50 ms
    assert percentiles(other)["p99_ms"] == pytest.approx(50.0)
    merged = percentiles(one + other)  # 15 slow of 2,000 is under 1 %
    assert merged == {
        "p50_ms": pytest.approx(1.0),
        "p99_ms": pytest.approx(1.0),
        "max_ms": pytest.approx(50.0),
    }
    assert percentiles([0.001] * 980 + [0.1] * 20)["p99_ms"] == pytest.approx(100.0)
    assert percentiles([]) == {"p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
