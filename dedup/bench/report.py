"""The report of a ``dedup bench`` run: its table, the fleet and Redis Cluster comparisons,
the marker layouts' memory, and the chart.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dedup.bench.strategies import PER_REQUEST, REDIS_FREE

__all__ = [
    "COLUMNS",
    "baseline_check",
    "cluster_comparison",
    "format_baseline_check",
    "format_cluster_comparison",
    "format_layouts",
    "format_table",
]

# dedup's targets on a cluster against one Redis, shown next to the figures.
_TARGET_RPS_RATIO = 0.8
_TARGET_ROUND_TRIPS_RATIO = 2.0


def cluster_comparison(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each cluster run next to its one-Redis twin (same workload, strategy and shape):
    requests/s, round trips and batches per request, and their ratios cluster / one."""
    singles = {_shape(r): r for r in runs if not r["cluster"] and r["redis_nodes"]}
    rows = []
    for c in runs:
        one = singles.get(_shape(c)) if c["cluster"] else None
        if one is None:
            continue

        def ratio(key: str, one: dict[str, Any] = one, c: dict[str, Any] = c) -> float | None:
            return float(c[key]) / float(one[key]) if one[key] else None

        row: dict[str, Any] = {
            "workload": c["workload"],
            "strategy": c["strategy"],
            "processes": c["processes"],
            "concurrency": c["concurrency"],
            "rate": c["rate"],
            "primaries": c["redis_nodes"],
            "rps": [one["rps"], c["rps"]],
            "rps_ratio": ratio("rps"),
            "round_trips_per_request": [
                one["redis_round_trips_per_request"],
                c["redis_round_trips_per_request"],
            ],
            "round_trips_ratio": ratio("redis_round_trips_per_request"),
            "batches_per_request": [
                one["redis_batches_per_request"],
                c["redis_batches_per_request"],
            ],
            "batches_ratio": ratio("redis_batches_per_request"),
            "round_trips_per_batch": [
                one["redis_round_trips_per_batch"],
                c["redis_round_trips_per_batch"],
            ],
            "round_trips_per_node_per_request": c["redis_round_trips_per_node_per_request"],
            "server_calls_by_node": c["redis_server_calls_by_node"],
            "passed": bool(one["passed"] and c["passed"]),
        }
        if c["strategy"] == "dedup":
            rps_ratio, trips_ratio = row["rps_ratio"], row["round_trips_ratio"]
            row["target_rps_met"] = rps_ratio is not None and rps_ratio >= _TARGET_RPS_RATIO
            row["target_round_trips_met"] = (
                trips_ratio is not None and trips_ratio <= _TARGET_ROUND_TRIPS_RATIO
            )
        rows.append(row)
    return rows


def baseline_check(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ``db-only`` run next to its ``db-plain`` twin (same workload and shape): the
    baseline dedup is compared with, as a share of the same work written plainly. A
    ratio well under 1 means the baseline is weak and dedup's ratios to it flatter."""
    plain = {_shape(r)[:1] + _shape(r)[2:]: r for r in runs if r["strategy"] == "db-plain"}
    rows = []
    for r in runs:
        twin = plain.get(_shape(r)[:1] + _shape(r)[2:]) if r["strategy"] == "db-only" else None
        if twin is None:
            continue
        rows.append(
            {
                "workload": r["workload"],
                "processes": r["processes"],
                "concurrency": r["concurrency"],
                "rate": r["rate"],
                "rps": [r["rps"], twin["rps"]],
                "rps_ratio": r["rps"] / twin["rps"] if twin["rps"] else None,
                "cpu_us_per_request": [
                    r["gateway_cpu_us_per_request"],
                    twin["gateway_cpu_us_per_request"],
                ],
                "rows_sent_per_unique": [r["rows_sent_per_unique"], twin["rows_sent_per_unique"]],
            }
        )
    return rows


def format_baseline_check(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The lines of :func:`baseline_check`."""
    lines = [
        "db-only against db-plain (the same work written plainly; same stream and shape):",
        f"{'workload':<8} {'procs':>5} {'callers':>7} {'offered':>9} {'db-only':>9} "
        f"{'db-plain':>9} {'ratio':>5}  {'cpu us/req':>13}  {'rows/uniq':>13}",
    ]
    for r in rows:
        lines.append(
            f"{r['workload']:<8} {r['processes']:>5} {r['concurrency']:>7} "
            + (f"{'closed':>9}" if r["rate"] is None else f"{r['rate']:>9,.0f}")
            + f" {r['rps'][0]:>9,.0f} {r['rps'][1]:>9,.0f} {_fmt(r['rps_ratio'], '.2f', 5)}"
            f"  {r['cpu_us_per_request'][0]:>5.2f} / {r['cpu_us_per_request'][1]:<5.2f}"
            f"  {r['rows_sent_per_unique'][0]:>5.3f} / {r['rows_sent_per_unique'][1]:<5.3f}"
        )
    return lines


def _shape(r: dict[str, Any]) -> tuple[Any, ...]:
    return r["workload"], r["strategy"], r["processes"], r["concurrency"], r["rate"]


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
    colors = {
        "db-only": "#cc6677",
        "db-plain": "#ddcc77",
        "dedup": "#4477aa",
        "dedup (cluster)": "#228833",
    }
    for series in dict.fromkeys(_series(r) for r in fleet):
        mine = sorted((r for r in fleet if _series(r) == series), key=lambda r: r["processes"])
        x = [r["processes"] for r in mine]
        color, strategy = colors.get(series), series
        axes[0].plot(x, [r["db_statements_per_unique"] for r in mine], "o-", color=color,
                     label=f"{strategy}: statements (client)")  # fmt: skip
        axes[0].plot(x, [r["db_xacts_per_unique"] for r in mine], "s--", color=color,
                     label=f"{strategy}: transactions (PostgreSQL)")  # fmt: skip
        axes[1].plot(x, [r["rows_sent_per_unique"] for r in mine], "o-", color=color,
                     label=strategy)  # fmt: skip
        axes[2].plot(x, [r["rps"] for r in mine], "o-", color=color, label=f"{strategy} (closed)")
        for rate in dict.fromkeys(r["rate"] for r in runs if r["rate"] is not None):
            opened = sorted(
                (r for r in runs if _series(r) == series and r["rate"] == rate),
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


def _series(r: dict[str, Any]) -> str:
    """The chart's name of a run's line: its strategy, marked when on a cluster."""
    return f"{r['strategy']} (cluster)" if r["cluster"] else str(r["strategy"])


def _fmt(value: float | None, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


COLUMNS = (
    # (heading, width): see docs/performance.md for what each one means.
    ("workload", 8), ("strategy", 10), ("redis", 8), ("procs", 5), ("callers", 7),
    ("offered", 9), ("req/s", 9), ("p50 ms", 7), ("p99 ms", 8), ("RT/req", 7),
    ("batch/req", 9), ("RT/batch", 8), ("srvRT/req", 9),
    ("stmt/uniq", 9), ("xact/uniq", 9), ("rows/uniq", 9), ("xact/s", 7),
    ("cpu us/req", 10), ("cpu us/uniq", 11), ("redis cpu", 9), ("pg cpu", 7),
    ("x(a)", 5), ("x(c)", 5), ("local %", 9),
)  # fmt: skip


def format_table(report: dict[str, Any]) -> str:
    """The result table: one line per run, then ceilings and memory."""
    runs = report["runs"]
    head = " ".join(f"{h:<{w}}" if i < 3 else f"{h:>{w}}" for i, (h, w) in enumerate(COLUMNS))
    lines = [head + "  rows==unique", "-" * (len(head) + 14)]

    def rps_of(strategy: str, r: dict[str, Any], *, same_shape: bool) -> float | None:
        for x in runs:
            if (
                x["workload"] == r["workload"]
                and x["strategy"] == strategy
                # db-only uses no Redis: one run serves the rows of both Redis kinds.
                and (strategy in REDIS_FREE or x["cluster"] == r["cluster"])
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
        redis = "-" if not r["redis_nodes"] else "one"
        if r["cluster"]:
            redis = f"cluster{r['redis_nodes']}"
        cells = [
            f"{r['workload']:<8}",
            f"{r['strategy']:<10}",
            f"{redis:<8}",
            f"{r['processes']:>5}",
            f"{r['concurrency']:>7}",
            f"{'closed':>9}" if r["rate"] is None else f"{r['rate']:>9,.0f}",
            f"{r['rps']:>9,.0f}",
            f"{r['p50_ms']:>7.3f}",
            f"{r['p99_ms']:>8.2f}",
            f"{r['redis_round_trips_per_request']:>7.4f}",
            f"{r['redis_batches_per_request']:>9.4f}",
            _fmt(r["redis_round_trips_per_batch"] if r["redis_batches"] else None, ".2f", 8),
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
            f"{_local_share(r):>9}",
        ]
        lines.append(" ".join(cells) + f"  {'PASS' if r['passed'] else 'FAIL'}")
    comparison = report.get("cluster", {}).get("comparison")
    if comparison:
        lines += ["", *format_cluster_comparison(comparison)]
    if report.get("baseline_check"):
        lines += ["", *format_baseline_check(report["baseline_check"])]
    lines.append("")
    scalars = {k: v for k, v in report["memory"].items() if k != "layouts"}
    for k, v in {**report["ceilings"], **scalars}.items():
        lines.append(f"{k:<40} {v:>14,.1f}" if isinstance(v, float) else f"{k:<40} {v:>14}")
    lines += [f"note: {note}" for note in report.get("notes", ())]
    layouts = report["memory"].get("layouts")
    if layouts:
        lines += ["", *format_layouts(layouts)]
    return "\n".join(lines)


def _local_share(r: dict[str, Any]) -> str:
    """The share of requests the local tier answered: the process's, or the lowest and
    highest of the processes' ("-" for strategies without one)."""
    shares = r.get("local_share") or []
    if not any(shares):
        return "-"
    low, high = min(shares), max(shares)
    return (
        f"{100 * low:.0f}"
        if round(100 * low) == round(100 * high)
        else (f"{100 * low:.0f}-{100 * high:.0f}")
    )


def format_cluster_comparison(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The lines of :func:`cluster_comparison`: one Redis against the cluster, per run."""
    primaries = max(r["primaries"] for r in rows)
    lines = [
        f"Redis Cluster ({primaries} primaries) against one Redis, same stream and shape "
        f"(one -> cluster; dedup's targets: >= {_TARGET_RPS_RATIO:g}x req/s, <= "
        f"{_TARGET_ROUND_TRIPS_RATIO:g}x round trips per request):",
        f"{'workload':<8} {'strategy':<10} {'procs':>5} {'callers':>7} {'offered':>9} "
        f"{'req/s one':>10} {'cluster':>9} {'ratio':>5}  {'RT/req one -> cluster':<25} "
        f"{'batch/req one -> cluster':<25} {'RT/node/req':>11}  targets",
    ]

    def pair(values: list[float], ratio: float | None) -> str:
        text = f"{values[0]:.4f} -> {values[1]:.4f}"
        return f"{text} ({ratio:.2f}x)" if ratio is not None else text

    for r in rows:
        targets = "-"
        if "target_rps_met" in r:
            targets = (
                f"req/s {'met' if r['target_rps_met'] else 'MISSED'}, "
                f"RT {'met' if r['target_round_trips_met'] else 'MISSED'}"
            )
        rps_ratio = _fmt(r["rps_ratio"], ".2f", 5)
        lines.append(
            f"{r['workload']:<8} {r['strategy']:<10} {r['processes']:>5} {r['concurrency']:>7} "
            + (f"{'closed':>9}" if r["rate"] is None else f"{r['rate']:>9,.0f}")
            + f" {r['rps'][0]:>10,.0f} {r['rps'][1]:>9,.0f} {rps_ratio}  "
            f"{pair(r['round_trips_per_request'], r['round_trips_ratio']):<25} "
            f"{pair(r['batches_per_request'], r['batches_ratio']):<25} "
            f"{r['round_trips_per_node_per_request']:>11.4f}  {targets}"
        )
    by_node = [r for r in rows if r["strategy"] == "dedup"] or list(rows)
    for r in by_node:
        calls = r["server_calls_by_node"]
        total = sum(calls.values()) or 1
        shares = ", ".join(f"{node} {100 * n / total:.0f} %" for node, n in sorted(calls.items()))
        lines.append(
            f"  {r['workload']} {r['strategy']} {r['processes']} proc(s): script calls per "
            f"node (INFO commandstats) {shares}"
        )
    return lines


_LAYOUT_NOTES = {
    "compact": "the default",
    "keys": "one key per value (the layout before compact markers)",
}


def format_layouts(layouts: dict[str, dict[str, Any]]) -> list[str]:
    """Redis bytes per saved value of each marker layout, one line each."""
    first = next(iter(layouts.values()))
    buckets = next((r["marker_buckets"] for r in layouts.values() if r["marker_buckets"]), None)
    lines = [
        f"Redis bytes per saved value by marker layout: {first['values']:,} values"
        + (f", {buckets:,} buckets" if buckets else "")
        + f", each on a redis-server {first['redis_version']} of its own",
        f"{'layout':<12} {'bytes/value':>11} {'keys':>10} {'saves/s':>9}  notes",
    ]
    for name, r in layouts.items():
        note = _LAYOUT_NOTES.get(name, "")
        if "fp_measured" in r:
            note = (
                f"Bloom at {100 * r['fp_configured']:g} %: false positives "
                f"{100 * r['fp_measured']:.2f} % of {r['fp_probes']:,} new values; the "
                f"bitmaps alone {r['bloom_bytes_per_value']:.2f} bytes/value"
            )
        if r["dup_answers_saved"] != 1.0:
            note += f"; only {r['dup_answers_saved']:.4f} of saved values answered saved!"
        lines.append(
            f"{name:<12} {r['bytes_per_value']:>11.1f} {r['keys']:>10,} "
            f"{r['saves_per_s']:>9,.0f}  {note}"
        )
    return lines
