"""Degraded mode: when Redis cannot serve, the database's unique key decides alone.

The circuit breaker (:mod:`dedup._engine.breaker`) opens after ``breaker_failures``
consecutive connection errors, or on one timeout. While it is open, claims and
writes skip Redis: values go to an admission queue, bounded in length
(``degraded_max_queue``) and in waiting time (``degraded_queue_timeout_s``), and
from it to at most ``degraded_max_statements`` database statements at once (the
normal write batches in flight count against the same bound). Past either bound
a save raises :class:`~dedup.errors.Overloaded`. A probe, one per jittered
cooldown, closes the circuit when Redis serves again, and what still waits goes
back to the claims.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dedup._engine.batcher import Batcher
from dedup._engine.breaker import CircuitBreaker
from dedup._engine.flights import Flight, FlightTable
from dedup._redis.server import unwritable_reason
from dedup.errors import Overloaded
from dedup.metrics import Stats

__all__ = ["REASONS", "DegradedMode"]

REASONS = {
    "unreachable": "is unreachable or too slow",
    "oom": "is full (maxmemory reached, noeviction)",
    "readonly": "is read-only (a replica, as after a failover)",
    "misconf": "refuses writes (MISCONF: snapshots failing)",
}
"""Why Redis can be skipped: the reason codes of ``/readyz``, the metrics and the logs."""

log = logging.getLogger("dedup")

WriteAlone = Callable[[list[Flight]], Awaitable[None]]
OnError = Callable[[list[Flight], BaseException], None]


class DegradedMode:
    """The breaker, its probe and the admission queue of one Gateway.

    ``probe`` is one attempt to use Redis again (it raises if Redis cannot serve);
    ``write_alone`` is the degraded write step (it answers or fails its callers);
    ``on_error`` learns a batch whose write step raised; values come from the
    ``claims`` and ``writes`` queues (whose write batches in flight count against
    ``max_statements``) and go back to ``claims`` when Redis serves again.
    """

    __slots__ = (
        "_batch_size",
        "_claims",
        "_flights",
        "_loop",
        "_max_queue",
        "_max_statements",
        "_on_error",
        "_probe_once",
        "_probing",
        "_queue_timeout_s",
        "_running",
        "_scheduled",
        "_spawn",
        "_stats",
        "_timer",
        "_write_alone",
        "_writes",
        "breaker",
        "queue",
        "reason",
    )  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        breaker: CircuitBreaker,
        flights: FlightTable,
        stats: Stats,
        batch_size: int,
        max_statements: int,
        max_queue: int,
        queue_timeout_s: float,
        probe: Callable[[], Awaitable[None]],
        spawn: Callable[[Awaitable[None]], None],
        write_alone: WriteAlone,
        on_error: OnError,
        claims: Batcher,
        writes: Batcher,
    ) -> None:
        self._loop = loop
        self.breaker = breaker
        self._flights = flights
        self._stats = stats
        self._batch_size = batch_size
        self._max_statements = max_statements
        self._max_queue = max_queue
        self._queue_timeout_s = queue_timeout_s
        self._probe_once = probe
        self._spawn = spawn
        self._write_alone = write_alone
        self._on_error = on_error
        self._claims = claims
        self._writes = writes
        self._probing = False
        self._running = 0
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self.queue: list[Flight] = []
        self.reason = ""
        """Why Redis is skipped, one of :data:`REASONS` (empty while the circuit is closed)."""

    @property
    def active(self) -> bool:
        """True while Redis is skipped (open or half-open circuit)."""
        return not self.breaker.closed

    def success(self) -> None:
        """A Redis call answered."""
        self.breaker.success()

    def redis_failed(self, exc: BaseException, *, may_time_out: bool = True) -> bool:
        """Report a failed Redis call to the breaker; True while Redis is to be skipped.

        Connection errors count toward ``breaker_failures``; a timeout (the call waited
        ``redis_timeout_s``) opens the circuit at once, unless ``may_time_out`` is
        False (a readiness PING with its own short bound). Errors Redis answered with
        (a script error, say) prove it is up and do not count.
        """
        refused = unwritable_reason(exc)
        if refused is not None:
            # Up, but it cannot take writes (full, a replica, failing snapshots): every
            # claim would fail alike, so the database decides until a write succeeds.
            if self.breaker.closed:
                self.breaker.trip()
                self.opened(refused, repr(exc))
            return True
        timeout = isinstance(exc, RedisTimeoutError | TimeoutError)
        unreachable = timeout or isinstance(exc, RedisConnectionError | OSError)
        if unreachable and self.breaker.failure(timeout=timeout and may_time_out):
            self.opened("unreachable", repr(exc))
        return not self.breaker.closed

    def opened(self, reason: str, detail: str) -> None:
        """The circuit has just opened (or starts open): count it, say why, probe."""
        self._stats.breaker_opens += 1
        self.reason = reason
        log.warning(
            "Redis %s (%s): circuit open, serving through the database alone",
            REASONS.get(reason, reason),
            detail,
        )
        if not self._probing:
            self._probing = True
            self._spawn(self._probe())

    def start_open(self, detail: str) -> None:
        """Open the circuit before the first call (Redis was down at start)."""
        self.breaker.trip()
        self.opened("unreachable", f"at start: {detail}")

    async def _probe(self) -> None:
        """While the circuit is open: one probe per cooldown until Redis serves again."""
        breaker = self.breaker
        try:
            while not breaker.closed:
                await asyncio.sleep(breaker.probe_delay_s())
                if not breaker.try_probe():
                    continue
                self._stats.redis_round_trips += 1
                try:
                    await self._probe_once()
                except Exception as exc:  # any failure keeps Redis skipped
                    log.debug("Redis probe failed: %r", exc)
                    breaker.probe_done(False)
                else:
                    breaker.probe_done(True)
        finally:
            self._probing = False
        self.reason = ""
        log.warning("Redis answers again: circuit closed, normal mode resumes")
        if self.queue:
            self.schedule()  # hands the queue back to the claims
        if self._claims.queue:
            self._claims.schedule()

    def take(self, flights: list[Flight]) -> bool:
        """While Redis is skipped, queue ``flights`` for degraded writes (refusing those
        beyond the queue bound) and return True; else return False and take nothing."""
        if self.breaker.closed:
            return False
        until = self._loop.time() + self._queue_timeout_s
        queue = self.queue
        for f in flights:
            if len(queue) >= self._max_queue:
                self._stats.overloaded += 1
                self._flights.fail(
                    f, lambda: Overloaded("degraded mode: the database queue is full; retry later")
                )
            else:
                f.queued_until = until
                queue.append(f)
        self.schedule()
        return True

    def schedule(self) -> None:
        """Flush the admission queue at the end of this loop iteration."""
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._flush)

    def schedule_if_queued(self) -> None:
        """After a normal write batch: a statement slot may have freed up."""
        if self.queue:
            self.schedule()

    def _flush(self) -> None:
        """Refuse values queued too long; start statements while under the bound."""
        self._scheduled = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        queue = self.queue
        if self.breaker.closed:
            # Redis is back: what still waits is claimed as usual (the normal bounds apply).
            self._claims.extend(queue)
            self.queue = []
            return
        # Entries share one timeout and are appended in time order: the expired are a
        # prefix. The timer may fire up to the loop's clock resolution early: 1 ms slack.
        now = self._loop.time() + 0.001
        expired = 0
        while expired < len(queue) and queue[expired].queued_until <= now:
            expired += 1
        if expired:
            stale = queue[:expired]
            del queue[:expired]
            self._stats.overloaded += expired
            message = f"degraded mode: not written within {self._queue_timeout_s} s; retry later"
            for f in stale:
                self._flights.fail(f, lambda: Overloaded(message))
        while queue and self._running + self._writes.running < self._max_statements:
            batch = queue[: self._batch_size]
            del queue[: self._batch_size]
            self._running += 1
            self._spawn(self._run(batch))
        if queue:
            self._timer = self._loop.call_at(queue[0].queued_until, self._flush)

    async def _run(self, batch: list[Flight]) -> None:
        """One statement for a degraded batch: the unique key alone decides ``created``."""
        try:
            await self._write_alone(batch)
        except BaseException as exc:
            self._on_error(batch, exc)
            raise
        finally:
            self._running -= 1
            if self.queue:
                self.schedule()

    def clear(self) -> list[Flight]:
        """Stop the timer and take every queued flight out (at close)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        taken, self.queue = self.queue, []
        return taken
