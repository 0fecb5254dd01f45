"""``dedup demo``: replay a synthetic analytics stream through a Gateway and check the table.

The stream is Zipf-distributed over ``values`` distinct values spread over a few
kinds, so a few values arrive very often and many arrive once. The run ends
with ``rows in table == unique values: PASS`` when the table holds exactly one
row per distinct value of the stream and exactly that many saves answered
``created=True``.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from dedup.errors import DedupError
from dedup.gateway import Gateway

__all__ = ["DEMO_KINDS", "DemoReport", "make_stream", "run_demo"]

DEMO_KINDS = ("demo.email", "demo.phone", "demo.device", "demo.url")
DEMO_NAMESPACE = "dedup-demo"


def make_stream(events: int, values: int, zipf: float, seed: int) -> array[int]:
    """Ranks of ``events`` draws from Zipf(``zipf``) over ``values`` ranks (0 is hottest)."""
    if events < 1 or values < 1:
        raise ValueError("events and values must be at least 1")
    if zipf < 0:
        raise ValueError("zipf must be >= 0 (0 is uniform)")
    rng = random.Random(seed)
    cum = list(itertools.accumulate(1.0 / (k**zipf) for k in range(1, values + 1)))
    return array("l", rng.choices(range(values), cum_weights=cum, k=events))


def value_of(rank: int) -> tuple[str, str]:
    """The (kind, value) of a rank: kinds take turns, values look like real data."""
    kind = DEMO_KINDS[rank % len(DEMO_KINDS)]
    return kind, f"{kind.removeprefix('demo.')}-{rank:08d}"


@dataclass
class DemoReport:
    """What a demo run measured."""

    events: int
    unique: int
    rows: int
    created: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float
    stats: dict[str, int]

    @property
    def passed(self) -> bool:
        """One row per unique value, each created exactly once, and no failed save."""
        return self.rows == self.unique == self.created and self.errors == 0


async def _progress(done: list[int], total: int, out: TextIO, started: float) -> None:
    while True:
        await asyncio.sleep(0.2)
        _draw(done[0], total, out, started)


def _draw(n: int, total: int, out: TextIO, started: float) -> None:
    width = 30
    filled = width * n // total
    rate = n / max(time.perf_counter() - started, 1e-9)
    out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {n:>10,}/{total:,} {rate:>10,.0f} ev/s")
    out.flush()


async def run_demo(
    gateway_kwargs: dict[str, Any],
    *,
    events: int,
    values: int,
    zipf: float,
    concurrency: int,
    seed: int,
    out: TextIO,
) -> DemoReport:
    """Purge the demo's kinds, replay the stream, and count the rows."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    stream = make_stream(events, values, zipf, seed)
    unique = len(set(stream))
    names = [value_of(r) for r in range(values)]
    kwargs = dict(gateway_kwargs)
    kwargs["namespace"] = DEMO_NAMESPACE  # never the production namespace: purge clears it
    latencies = array("d", bytes(8 * events))
    done = [0]
    created = 0
    errors = 0

    async with Gateway(**kwargs) as gw:
        await gw.purge(DEMO_KINDS)
        ticket: Iterator[int] = iter(range(events))

        async def producer() -> None:
            nonlocal created, errors
            save, clock = gw.save, time.perf_counter
            for i in ticket:
                kind, value = names[stream[i]]
                t0 = clock()
                try:
                    result = await save(kind, value, {"seq": i})
                except DedupError as exc:
                    errors += 1
                    if errors <= 5:
                        print(f"\nsave failed: {exc}", file=sys.stderr)
                else:
                    created += result.created
                latencies[i] = clock() - t0
                done[0] += 1

        started = time.perf_counter()
        bar = asyncio.create_task(_progress(done, events, out, started)) if out.isatty() else None
        try:
            await asyncio.gather(*(producer() for _ in range(concurrency)))
        finally:
            if bar is not None:
                bar.cancel()
        seconds = time.perf_counter() - started
        if bar is not None:
            _draw(done[0], events, out, started)
            out.write("\n")
        rows = await gw.count_rows(DEMO_KINDS)
        stats = gw.stats().as_dict()

    ordered = sorted(latencies)
    return DemoReport(
        events=events,
        unique=unique,
        rows=rows,
        created=created,
        errors=errors,
        seconds=seconds,
        p50_ms=ordered[len(ordered) // 2] * 1000,
        p99_ms=ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000,
        stats=stats,
    )


def format_report(report: DemoReport) -> str:
    """The summary table; its last line is the PASS/FAIL verdict."""
    s, n = report.stats, report.events
    lines = [
        ("events", f"{n:,}"),
        ("unique values", f"{report.unique:,}"),
        ("seconds", f"{report.seconds:.2f}"),
        ("events/s", f"{n / report.seconds:,.0f}"),
        ("p50 latency", f"{report.p50_ms:.3f} ms"),
        ("p99 latency", f"{report.p99_ms:.3f} ms"),
        ("answers: local", f"{s['local']:,}"),
        ("answers: inflight", f"{s['inflight']:,}"),
        ("answers: redis", f"{s['redis']:,}"),
        ("answers: db", f"{s['db']:,}"),
        ("answers: write (created)", f"{s['write']:,}"),
        ("failed saves", f"{report.errors:,}"),
        ("Redis round trips / event", f"{s['redis_round_trips'] / n:.5f}"),
        ("DB statements / event", f"{s['db_statements'] / n:.5f}"),
        ("rows sent to DB / unique value", f"{s['db_rows_sent'] / max(report.unique, 1):.3f}"),
        ("rows in table", f"{report.rows:,}"),
    ]
    width = max(len(k) for k, _ in lines)
    body = [f"{k:<{width}}  {v:>14}" for k, v in lines]
    verdict = "PASS" if report.passed else "FAIL"
    return "\n".join([*body, f"rows in table == unique values: {verdict}"])
