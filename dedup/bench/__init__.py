"""``dedup bench``: dedup against the textbook pattern and the database alone, from one
command: the plan, the runs (:mod:`.run`, :mod:`.procs`), the strategies compared
(:mod:`.strategies`; :mod:`.plain` is the check on the ``db-only`` baseline), Redis
memory per layout (:mod:`.memory`) and the report.
"""

from __future__ import annotations

from dedup.bench.report import (
    baseline_check,
    cluster_comparison,
    format_cluster_comparison,
    format_layouts,
    format_table,
)
from dedup.bench.run import (
    CLUSTER_PRIMARIES,
    PER_REQUEST,
    STRATEGIES,
    WORKLOADS,
    BenchConfig,
    Planned,
    RunResult,
    ServerPids,
    bench_command,
    config_from_flags,
    plan,
    run_bench,
    run_one,
    workload_values,
)
from dedup.bench.strategies import REDIS_FREE

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
    "baseline_check",
    "bench_command",
    "cluster_comparison",
    "config_from_flags",
    "format_cluster_comparison",
    "format_layouts",
    "format_table",
    "plan",
    "run_bench",
    "run_one",
    "workload_values",
]
