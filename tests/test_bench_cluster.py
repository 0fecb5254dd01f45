"""``dedup bench`` on a Redis Cluster (issue 15): ``--cluster`` runs every Redis run on one
Redis and on a throwaway 3-primary cluster side by side, and ``--redis-url
redis+cluster://`` benches a given cluster alone. Tiny sizes; behaviour, never timings."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dedup import bench
from dedup.errors import DedupError
from tests.servers import PostgresCluster, RedisClusterServers
from tests.test_bench import ROOT, _check_run

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster_servers() -> Iterator[RedisClusterServers]:
    with RedisClusterServers(3, 0, node_timeout_ms=2000) as servers:
        yield servers


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_bench_cluster_runs_one_redis_and_the_cluster_side_by_side(
    pg_url: str, tmp_path: Path
) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "dedup", "bench", "--cluster", "--requests", "2000",
         "--processes", "1", "--concurrency", "16", "--workloads", "zipf,uniform",
         "--memory-values", "2000", "--database-url", pg_url, "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=170, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[-1] == "rows == unique values for every run: PASS"
    for heading in ("redis", "RT/req", "batch/req", "RT/batch", "srvRT/req"):
        assert heading in lines[0]
    report = json.loads((tmp_path / "bench.json").read_text())
    runs = report["runs"]
    # Each workload: db-only once (no Redis), dedup on one Redis, then on the cluster.
    assert [(r["workload"], r["strategy"], r["cluster"], r["redis_nodes"]) for r in runs] == [
        (w, s, cluster, nodes)
        for w in ("zipf", "uniform")
        for s, cluster, nodes in (("db-only", False, 0), ("dedup", False, 1), ("dedup", True, 3))
    ]
    for r in runs:
        _check_run(r)
        assert r["requests"] == 2000 and r["processes"] == 1 and r["concurrency"] == 16
        assert r["pg_cpu_s"] is None  # the database was given by URL
        if r["strategy"] == "db-only":
            assert r["redis_batches"] == 0 and r["redis_server_calls_by_node"] == {"": 0}
            continue
        # The bench started both Redis kinds: their CPU (every node's, summed) is known.
        assert r["redis_cpu_s"] is not None and r["redis_cpu_s"] >= 0, r
        assert 1 <= r["redis_batches"] <= r["redis_round_trips"], r
        by_node = r["redis_server_calls_by_node"]
        assert sum(by_node.values()) == r["redis_server_calls"]
        if r["cluster"]:
            # One pipeline per node per batch: at most 3 round trips a batch, plus a
            # script load on each node (NOSCRIPT: 2 more each) and a few slot-map reads.
            assert r["redis_round_trips"] <= 3 * r["redis_batches"] + 30, r
            assert r["redis_round_trips_per_batch"] > 1, r
            assert len(by_node) == 3 and all(n > 0 for n in by_node.values()), r
            assert r["redis_round_trips_per_node_per_request"] == pytest.approx(
                r["redis_round_trips_per_request"] / 3
            )
        else:
            assert list(by_node) == [""], r
            assert r["redis_round_trips"] <= r["redis_batches"] + 10, r
    rows = [line for line in lines if line.startswith(("zipf ", "uniform "))]
    assert sum(" cluster3 " in line for line in rows) == 2, rows
    assert all(line.endswith("PASS") for line in rows[:6]), rows
    # The comparison: dedup on the cluster against dedup on one Redis, per workload.
    comparison = report["cluster"]["comparison"]
    assert report["cluster"]["primaries"] == 3
    assert [(c["workload"], c["strategy"]) for c in comparison] == [
        ("zipf", "dedup"),
        ("uniform", "dedup"),
    ]
    for c in comparison:
        one, cluster = (r for r in runs if r["workload"] == c["workload"] and r["redis_nodes"])
        assert c["rps"] == [one["rps"], cluster["rps"]]
        assert c["rps_ratio"] == pytest.approx(cluster["rps"] / one["rps"])
        assert c["batches_per_request"] == [
            one["redis_batches_per_request"],
            cluster["redis_batches_per_request"],
        ]
        assert isinstance(c["target_rps_met"], bool)
        assert isinstance(c["target_round_trips_met"], bool)
        assert c["passed"]
    out = run.stdout
    assert "Redis Cluster (3 primaries) against one Redis" in out
    assert out.count("script calls per node (INFO commandstats)") == 2
    assert "note: redis-benchmark ceiling: on the one Redis only" in out
    assert report["memory"]["redis_bytes_per_saved_value"] > 0
    assert report["memory"]["cluster_redis_bytes_per_saved_value"] > 0
    # The throwaway cluster was stopped at the end.
    seed = int(report["cluster"]["url"].rsplit(":", 1)[1])
    assert not _port_open(seed)


def test_bench_on_a_cluster_url_every_strategy(
    cluster_servers: RedisClusterServers, pg_cluster: PostgresCluster, pg_url: str, tmp_path: Path
) -> None:
    """``--redis-url redis+cluster://`` alone: every strategy runs on the cluster, its
    rows are marked, server calls and CPU are summed over the nodes, and what cannot be
    measured on a cluster says so."""
    cfg = bench.BenchConfig(
        requests=1000, concurrency=(8,), processes=(1,), workloads=("zipf",),
        strategies=bench.STRATEGIES, zipf_values=2000, memory_values=1000,
    )  # fmt: skip
    report = bench.run_bench(
        cfg,
        redis_url=cluster_servers.url,
        pg_url=pg_url,
        redis_port=None,
        out_dir=tmp_path,
        log=lambda line: None,
        pids=bench.ServerPids(tuple(n.pid for n in cluster_servers.nodes), pg_cluster.pid),
    )
    runs = report["runs"]
    assert [(r["strategy"], r["cluster"], r["redis_nodes"]) for r in runs] == [
        ("textbook", True, 3),
        ("redis-lock", True, 3),
        ("db-only", False, 0),
        ("db-plain", False, 0),
        ("dedup", True, 3),
    ]
    # /proc counts CPU in 10 ms ticks: a run this small may use less on the nodes (dedup
    # sends a few script calls), so each run has a reading and the runs together use some.
    assert sum(r["redis_cpu_s"] for r in runs if r["strategy"] not in bench.REDIS_FREE) > 0
    for r in runs:
        _check_run(r)
        assert r["pg_cpu_s"] > 0, r
        if r["strategy"] not in bench.REDIS_FREE:
            assert r["redis_cpu_s"] is not None and r["redis_cpu_s"] >= 0, r
            assert len(r["redis_server_calls_by_node"]) == 3, r
            assert r["redis_server_calls"] > 0, r
        if r["strategy"] in bench.PER_REQUEST:
            assert r["redis_batches"] == r["redis_round_trips"] >= r["requests"], r
    assert "cluster" not in report  # nothing to compare with
    assert "redis_script_calls_per_s_pipelined_32" not in report["ceilings"]
    assert any(n.startswith("redis-benchmark ceiling: skipped") for n in report["notes"])
    assert report["memory"]["redis_bytes_per_saved_value"] > 0
    table = bench.format_table(report)
    assert table.count(" cluster3 ") == 3
    assert "note: redis_bytes_per_saved_value: on the cluster" in table


def test_cluster_plan_twins_every_redis_run() -> None:
    cfg = bench.config_from_flags(
        cluster=True, processes="1,2", concurrency="8,16", strategies="textbook,db-only,dedup"
    )
    shapes = [
        (r.workload, r.strategy, r.processes, r.concurrency, r.cluster) for r in bench.plan(cfg)
    ]
    assert shapes[:8] == [
        ("zipf", "textbook", 1, 8, False), ("zipf", "textbook", 1, 8, True),
        ("zipf", "db-only", 1, 8, False),
        ("zipf", "dedup", 1, 8, False), ("zipf", "dedup", 1, 8, True),
        ("zipf", "db-only", 2, 8, False),
        ("zipf", "dedup", 2, 8, False), ("zipf", "dedup", 2, 8, True),
    ]  # fmt: skip
    plain = bench.plan(dataclasses.replace(cfg, cluster=False))
    assert [r for r in bench.plan(cfg) if not r.cluster] == plain
    assert sum(r.cluster for r in bench.plan(cfg)) == sum(r.strategy != "db-only" for r in plain)


def test_cluster_flag_refuses_a_cluster_url(tmp_path: Path) -> None:
    """--cluster starts its own cluster: a cluster URL with it is refused before anything
    starts."""
    with pytest.raises(DedupError, match="without --cluster"):
        bench.bench_command(
            quick=False,
            redis_url="redis+cluster://127.0.0.1:1",
            database_url="postgresql://127.0.0.1:1/none",
            out_dir=tmp_path,
            cfg=bench.config_from_flags(cluster=True),
        )
    run = subprocess.run(
        [sys.executable, "-m", "dedup", "bench", "--cluster", "--redis-url",
         "redis+cluster://127.0.0.1:1", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode != 0
    assert "without --cluster" in run.stderr and "Traceback" not in run.stderr
