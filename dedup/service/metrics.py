"""The service's metrics: what it counts, and the Prometheus text of the whole service.

Stored with ``prometheus_client``. With ``--workers N`` the supervisor gives every
run a fresh ``PROMETHEUS_MULTIPROC_DIR`` (see :mod:`dedup.service.supervisor`): each worker
writes its values to files of its own there (prometheus_client's multiprocess mode),
and a scrape answered by any worker merges every file, so it shows the whole service.
A worker that died keeps its counts in the totals (its files stay); its live gauges
are dropped by the supervisor (``mark_process_dead``). With one process the metrics
live in a registry of this process.

Cost: every counter (responses, items, and the Gateway's :meth:`~dedup.Gateway.stats`)
and every histogram bucket (request latency, batch size) is counted in plain numbers
and pushed as deltas by :meth:`ServiceMetrics.flush`, about once a second and before
each scrape, so a request pays no lock and no file write for them.
"""

from __future__ import annotations

import math
import os
import time
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from dedup._engine.degraded import REASONS
from dedup.metrics import Stats
from dedup.service.openapi import (
    BATCH_PATH,
    FORGET_BATCH_PATH,
    FORGET_PATH,
    SAVE_PATH,
    SOURCES,
)

__all__ = [
    "BATCH_BUCKETS",
    "CONTENT_TYPE",
    "LATENCY_BUCKETS_S",
    "MULTIPROC_ENV",
    "PUSH_INTERVAL_S",
    "ServiceMetrics",
]

LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds of the request latency histogram, in seconds."""
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
"""Upper bounds of the batch size histogram, in items."""
PUSH_INTERVAL_S = 1.0
"""How often each worker pushes its counters' deltas to the shared files."""
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client's variable: set, the values are kept in files in that folder."""
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text exposition format that :func:`generate_latest` writes."""

_STAT_HELP = {
    "redis_round_trips": "Script calls and other commands sent to Redis.",
    "redis_batches": "Claim, commit and abort batches sent to Redis (one per batch, any nodes).",
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
    "shared_rows_queued": "Rows this gateway queued for the fleet's shared writer.",
    "shared_rows_own": "Rows this gateway wrote as the fleet's writer without queuing them.",
    "shared_statements": "Statements this gateway wrote as the fleet's shared writer.",
    "shared_rows_returned": "Queued rows this gateway took back and wrote itself.",
    "shared_queue_full": "Rows written here because the shared queue was at shared_queue_max.",
    "shared_bad_messages": "Shared-writes rows and answers skipped as malformed or forged.",
    "shared_learned": "Values the local tier learned from the fleet's saved-values broadcast.",
    "shared_busy_answered": "Busy values answered by the fleet's saved-values broadcast.",
    "tombstones_drained": "Rows deleted outside dedup whose markers this gateway cleared.",
    "marker_resets": "Times this gateway reset every marker (the database lost writes; reconcile).",
}


class _Buckets:
    """One histogram's observations, counted in plain numbers and pushed to it as deltas
    (:meth:`Histogram.observe` takes a lock per call, and writes a file in multiprocess
    mode). The push adds to the histogram's own values (its ``_buckets`` and ``_sum``,
    which ``observe`` adds to likewise): prometheus_client has no public call for it."""

    __slots__ = ("_bounds", "_histogram", "_pushed", "_pushed_sum", "counts", "total")

    def __init__(self, histogram: Histogram, bounds: tuple[float, ...]) -> None:
        self._histogram = histogram
        self._bounds = (*bounds, math.inf)
        self.counts = [0] * len(self._bounds)
        self.total = 0.0
        self._pushed = [0] * len(self._bounds)
        self._pushed_sum = 0.0

    def observe(self, amount: float) -> None:
        """Count one observation (in the first bucket whose bound is at least ``amount``)."""
        self.counts[bisect_left(self._bounds, amount)] += 1
        self.total += amount

    def push(self) -> None:
        """Add what was observed since the last push to the histogram."""
        buckets = self._histogram._buckets
        for i, n in enumerate(self.counts):
            if n != self._pushed[i]:
                buckets[i].inc(n - self._pushed[i])
                self._pushed[i] = n
        if self.total != self._pushed_sum:
            self._histogram._sum.inc(self.total - self._pushed_sum)
            self._pushed_sum = self.total


class ServiceMetrics:
    """The metrics of one worker process, and the rendering of the whole service's.

    ``multiprocess_dir`` (default: ``$PROMETHEUS_MULTIPROC_DIR``) is the folder shared
    by the workers of one run; None keeps the metrics in this process. prometheus_client
    picks its storage when first imported, so the variable must be set before that
    (the supervisor sets it before spawning the workers).
    """

    def __init__(self, multiprocess_dir: str | None = None) -> None:
        self.started = time.time()
        self.multiprocess_dir = multiprocess_dir or os.environ.get(MULTIPROC_ENV) or None
        self.responses: dict[tuple[str, int], int] = {}
        self.items = 0
        self.forget_items = 0
        self.forgotten = 0
        self.connections_refused = 0
        self._pushed_refused = 0
        self._pushed_responses: dict[tuple[str, int], int] = {}
        self._pushed_items = 0
        self._pushed_forget = (0, 0)
        self._pushed_stats: dict[str, int] = {}
        self._registry = CollectorRegistry()
        # Multiprocess mode: the values go to files; the collector reads every worker's.
        own = None if self.multiprocess_dir else self._registry
        if self.multiprocess_dir:
            MultiProcessCollector(self._registry, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]

        self._responses = Counter(
            "dedup_http_responses",
            "HTTP responses by route and status code.",
            ["route", "code"],
            registry=own,
        )
        latency = Histogram(
            "dedup_http_request_duration_seconds",
            "Time from the request reaching the application to its response, by route.",
            ["route"],
            buckets=LATENCY_BUCKETS_S,
            registry=own,
        )
        self._latency = {
            path: _Buckets(latency.labels(path), LATENCY_BUCKETS_S)
            for path in (SAVE_PATH, BATCH_PATH, FORGET_PATH, FORGET_BATCH_PATH)
        }
        batch_items = Histogram(
            "dedup_http_batch_items",
            "Items per accepted batch request.",
            buckets=BATCH_BUCKETS,
            registry=own,
        )
        self._batch_items = _Buckets(batch_items, BATCH_BUCKETS)
        self._items = Counter(
            "dedup_http_items", "Items accepted for saving (single + batch).", registry=own
        )
        self._refused = Counter(
            "dedup_http_connections_refused",
            "Connections closed at accept because max_connections were open.",
            registry=own,
        )
        forget_items = Counter(
            "dedup_http_forget_items",
            "Values answered by /v1/forget and /v1/forget/batch, by result: forgotten (a row "
            "was deleted) or no_row (there was none).",
            ["result"],
            registry=own,
        )
        self._forgotten = forget_items.labels("forgotten")
        self._no_row = forget_items.labels("no_row")
        for series in (self._forgotten, self._no_row):
            series.inc(0)  # both series exist (at 0) before any forget
        answers = Counter(
            "dedup_answers",
            "Successful saves by where the answer came from.",
            ["source"],
            registry=own,
        )
        self._answers = {source: answers.labels(source) for source in SOURCES}
        self._stats: dict[str, Counter] = {}
        for name in Stats().as_dict():
            if name not in self._answers:
                self._stat_counter(name, own)
        self._own = own
        # live*: only the workers alive now count (the supervisor marks the dead ones).
        self._pending = Gauge(
            "dedup_pending",
            "Values in flight (summed over the live workers).",
            multiprocess_mode="livesum",
            registry=own,
        )
        self._degraded = Gauge(
            "dedup_degraded",
            "1 while a worker serves through the database alone (Redis down or slow: "
            "circuit open); the largest over the live workers.",
            multiprocess_mode="livemax",
            registry=own,
        )
        reasons = Gauge(
            "dedup_degraded_reason",
            "1 for the reason a worker skips Redis: unreachable, oom (full), readonly (a "
            "replica) or misconf (snapshots failing); the largest over the live workers.",
            ["reason"],
            multiprocess_mode="livemax",
            registry=own,
        )
        self._reasons = {reason: reasons.labels(reason) for reason in REASONS}
        # min: the first worker's start, i.e. when this run's counters started from zero.
        start = Gauge(
            "process_start_time_seconds",
            "Start time of the service's counters (Unix time).",
            multiprocess_mode="min",
            registry=own,
        )
        start.set(self.started)

    def _stat_counter(self, name: str, registry: CollectorRegistry | None) -> Counter:
        counter = self._stats[name] = Counter(
            f"dedup_{name}", _STAT_HELP.get(name, f"Gateway counter {name}."), registry=registry
        )
        counter.inc(0)  # the series exists (at 0) before anything happened
        return counter

    def response(self, route: str, status: int, seconds: float) -> None:
        """Count one response of ``route`` (a known path or ``"other"``)."""
        key = (route, status)
        self.responses[key] = self.responses.get(key, 0) + 1
        histogram = self._latency.get(route)
        if histogram is not None:
            histogram.observe(seconds)

    def batch(self, items: int) -> None:
        """Count one accepted batch request of ``items`` items."""
        self._batch_items.observe(items)

    def forgets(self, items: int, forgotten: int) -> None:
        """Count ``items`` values answered by a forget request, ``forgotten`` of which had a
        row that was deleted."""
        self.forget_items += items
        self.forgotten += forgotten

    def flush(self, stats: Stats, *, pending: int, degraded: bool, reason: str = "") -> None:
        """Push what was counted since the last flush, and the gauges' values now."""
        for key, n in self.responses.items():
            delta = n - self._pushed_responses.get(key, 0)
            if delta:
                self._responses.labels(key[0], str(key[1])).inc(delta)
                self._pushed_responses[key] = n
        for buckets in (*self._latency.values(), self._batch_items):
            buckets.push()
        if self.items != self._pushed_items:
            self._items.inc(self.items - self._pushed_items)
            self._pushed_items = self.items
        if self.connections_refused != self._pushed_refused:
            self._refused.inc(self.connections_refused - self._pushed_refused)
            self._pushed_refused = self.connections_refused
        pushed_items, pushed_forgotten = self._pushed_forget
        if (self.forget_items, self.forgotten) != self._pushed_forget:
            forgotten = self.forgotten - pushed_forgotten
            no_row = (self.forget_items - self.forgotten) - (pushed_items - pushed_forgotten)
            if forgotten:
                self._forgotten.inc(forgotten)
            if no_row:
                self._no_row.inc(no_row)
            self._pushed_forget = (self.forget_items, self.forgotten)
        for name, value in stats.as_dict().items():
            delta = value - self._pushed_stats.get(name, 0)
            if delta <= 0:  # counters only grow; nothing new
                continue
            self._pushed_stats[name] = value
            answers = self._answers.get(name)
            if answers is not None:
                answers.inc(delta)
            else:
                counter = self._stats.get(name) or self._stat_counter(name, self._own)
                counter.inc(delta)
        self._pending.set(pending)
        self._degraded.set(int(degraded))
        for code, gauge in self._reasons.items():
            gauge.set(int(code == reason))

    def render(self, stats: Stats, *, pending: int, degraded: bool, reason: str = "") -> bytes:
        """The Prometheus text exposition (format 0.0.4): this process's latest counts
        first flushed, then every worker's merged (or this process's alone)."""
        self.flush(stats, pending=pending, degraded=degraded, reason=reason)
        return generate_latest(self._registry)
