"""The service's metrics: what it counts itself, and their Prometheus text rendering.

Responses by route and status, request latency and batch sizes are counted here;
the Gateway's own counters (:meth:`dedup.Gateway.stats`) are added at render time.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence

from dedup.metrics import Stats
from dedup.openapi import BATCH_PATH, SAVE_PATH, SOURCES

__all__ = ["BATCH_BUCKETS", "LATENCY_BUCKETS_S", "Histogram", "ServiceMetrics"]

LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds of the request latency histogram, in seconds."""
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
"""Upper bounds of the batch size histogram, in items."""


class Histogram:
    """A Prometheus histogram: cumulative buckets with the given upper bounds, sum, count."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Count one observation (a bucket holds values <= its bound)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        """The exposition lines of this histogram; ``labels`` like ``route="/x"``."""
        sep = "," if labels else ""
        out = []
        cumulative = 0
        for bound, n in zip((*self.bounds, None), self.counts, strict=True):
            cumulative += n
            le = "+Inf" if bound is None else _number(bound)
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {cumulative}')
        braces = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{braces} {_number(self.sum)}")
        out.append(f"{name}_count{braces} {self.count}")
        return out


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(float(x))


_STAT_HELP = {
    "redis_round_trips": "Script calls and other commands sent to Redis.",
    "db_statements": "Statements sent to the database sink.",
    "db_rows_sent": "Rows offered to the database (including rows that existed already).",
    "claim_batches": "Claim script calls that succeeded.",
    "write_batches": "Write statements (one per batch of winners).",
    "busy": "Claims answered 'another writer holds it' (each re-checked later).",
    "reclaims": "Winners whose lease was nearly spent and was renewed before writing.",
    "lost_leases": "Rows committed after the lease had passed to someone else.",
    "wait_timeouts": "Saves that waited longer than wait_timeout_s for another writer.",
    "redis_errors": "Redis calls that failed.",
    "db_errors": "Database writes that failed.",
    "overloaded": "Saves refused because too many were in flight (or, degraded, queued too long).",
    "breaker_opens": "Times the circuit opened because Redis failed or stalled (degraded mode).",
    "degraded_answers": "Values answered by a degraded write (Redis skipped); also in write/db.",
}


class ServiceMetrics:
    """What the service counts itself: responses by route and status, latency and batch sizes.

    The Gateway's own counters come from :meth:`Gateway.stats` at render time.
    """

    def __init__(self) -> None:
        self.started = time.time()
        self.responses: dict[tuple[str, int], int] = {}
        self.latency = {path: Histogram(LATENCY_BUCKETS_S) for path in (SAVE_PATH, BATCH_PATH)}
        self.batch_items = Histogram(BATCH_BUCKETS)
        self.items = 0

    def response(self, route: str, status: int, seconds: float) -> None:
        """Count one response of ``route`` (a known path or ``"other"``)."""
        key = (route, status)
        self.responses[key] = self.responses.get(key, 0) + 1
        histogram = self.latency.get(route)
        if histogram is not None:
            histogram.observe(seconds)

    def render(self, stats: Stats, *, pending: int, degraded: bool) -> str:
        """The Prometheus text exposition (format 0.0.4) of this process."""
        out: list[str] = []

        def header(name: str, kind: str, text: str) -> None:
            out.append(f"# HELP {name} {text}")
            out.append(f"# TYPE {name} {kind}")

        header("dedup_http_responses_total", "counter", "HTTP responses by route and status code.")
        for (route, status), n in sorted(self.responses.items()):
            out.append(f'dedup_http_responses_total{{route="{route}",code="{status}"}} {n}')
        header(
            "dedup_http_request_duration_seconds",
            "histogram",
            "Time from the request reaching the application to its response, by route.",
        )
        for route, histogram in self.latency.items():
            out += histogram.lines("dedup_http_request_duration_seconds", f'route="{route}"')
        header("dedup_http_batch_items", "histogram", "Items per accepted batch request.")
        out += self.batch_items.lines("dedup_http_batch_items")
        header("dedup_http_items_total", "counter", "Items accepted for saving (single + batch).")
        out.append(f"dedup_http_items_total {self.items}")

        counters = stats.as_dict()
        header("dedup_answers_total", "counter", "Successful saves by where the answer came from.")
        for source in SOURCES:
            out.append(f'dedup_answers_total{{source="{source}"}} {counters.pop(source, 0)}')
        for name, value in counters.items():
            metric = f"dedup_{name}_total"
            header(metric, "counter", _STAT_HELP.get(name, f"Gateway counter {name}."))
            out.append(f"{metric} {value}")

        header("dedup_pending", "gauge", "Values in flight in this process.")
        out.append(f"dedup_pending {pending}")
        header(
            "dedup_degraded",
            "gauge",
            "1 while serving through the database alone (Redis down or slow: circuit open).",
        )
        out.append(f"dedup_degraded {int(degraded)}")
        header("process_start_time_seconds", "gauge", "Start time of this process (Unix time).")
        out.append(f"process_start_time_seconds {_number(self.started)}")
        return "\n".join(out) + "\n"
