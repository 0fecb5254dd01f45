"""The engine of an open Gateway: its stages, wired together once at open.

A new value goes from the flight table (step 2) to the claim queue; the claim
stage (step 3) answers it or says where it goes, and the Engine sends it to the
write queue, the wait queue, the fleet's writer or degraded mode; the write stage
(steps 4 and 5) writes and commits. Degraded mode takes the claim and write queues
over while Redis is skipped. The stages hold no queue downstream of them: they
return what they decided and the Engine routes it. Every stage runs once per
batch, never once per value; only :meth:`FlightTable.join` runs per new value.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from redis.asyncio import Redis

from dedup._engine.backends import Backends
from dedup._engine.batcher import Batcher
from dedup._engine.breaker import CircuitBreaker
from dedup._engine.claim_stage import ClaimStage
from dedup._engine.degraded import DegradedMode
from dedup._engine.flights import Flight, FlightTable
from dedup._engine.forget import Forgetter
from dedup._engine.guardian import Guardian
from dedup._engine.invalidation import Invalidations
from dedup._engine.local import SavedCache
from dedup._engine.shared import SharedWrites
from dedup._engine.shared_wire import Wire, sink_id
from dedup._engine.wait_queue import WaitQueue
from dedup._engine.write_stage import RowWriter, WriteStage
from dedup._redis.connect import SentinelMuxPool, follow_primary, per_node, probe_write
from dedup._values import Limits
from dedup.errors import ConfigError, DedupError, Unavailable
from dedup.metrics import Stats
from dedup.options import GatewayOptions
from dedup.store import sink_identity

__all__ = ["Engine"]

log = logging.getLogger("dedup")

_CLOSED = "the Gateway was closed before this save finished"

OOM_HEADROOM = 0.9
"""After ``oom``, the circuit closes only once Redis uses at most this share of maxmemory."""


class Engine:
    """The flight table, the claim and write queues and stages, the wait queue and
    degraded mode of one open Gateway, and the tasks they run."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        options: GatewayOptions,
        backends: Backends,
        local: SavedCache,
        stats: Stats,
    ) -> None:
        assert backends.claims is not None and backends.sink is not None
        self._loop = loop
        self._options = options
        self._backends = backends
        self._tasks: set[asyncio.Task[None]] = set()
        # Built in dependency order, nothing patched afterwards. The queues come first:
        # they hold flights and know no stage; what their batches do is the Engine's
        # route for them (_claim, _write, _divert, _wrote below), which runs a stage
        # and sends on what the stage returns. Everything that hands values back hands
        # them to the claim queue, which therefore exists before all of them.
        self.claim_queue = Batcher(
            loop,
            max_running=options.max_claim_batches,
            send=self._claim,
            spawn=self.spawn,
            on_error=self.fail_unfinished,
            divert=self._divert,
            size=options.max_batch,
            min_fill=options.min_fill,
        )
        self.write_queue = Batcher(
            loop,
            max_running=options.max_write_batches,
            send=self._write,
            spawn=self.spawn,
            on_error=self.fail_unfinished,
            # Winners too go through the degraded admission: one bound on statements.
            divert=self._divert,
            after=self._wrote,
            size=options.max_batch,
            min_fill=options.min_fill,
        )
        self.flights = FlightTable(
            loop,
            max_pending=options.max_pending,
            wait_timeout_s=options.wait_timeout_s,
            local=local,
            stats=stats,
            start=self.claim_queue.add,
        )
        self.waits = WaitQueue(
            loop,
            flights=self.flights,
            stats=stats,
            min_backoff_s=options.min_backoff_s,
            max_backoff_s=options.max_backoff_s,
            wait_timeout_s=options.wait_timeout_s,
            requeue=self.claim_queue.extend,
        )
        rows = RowWriter(
            sink=backends.sink,
            flights=self.flights,
            stats=stats,
            write_timeout_s=options.write_timeout_s,
        )
        self.degraded = DegradedMode(
            loop,
            breaker=CircuitBreaker(
                failures=options.breaker_failures, cooldown_s=options.breaker_cooldown_s
            ),
            flights=self.flights,
            stats=stats,
            batch_size=options.max_batch,
            max_statements=options.degraded_max_statements,
            max_queue=options.degraded_max_queue,
            queue_timeout_s=options.degraded_queue_timeout_s,
            probe=self._probe,
            spawn=self.spawn,
            write_alone=rows.write_alone,
            on_error=self.fail_unfinished,
            claims=self.claim_queue,
            writes=self.write_queue,
        )
        assert backends.redis is not None
        self.invalidations = Invalidations(
            client=backends.redis,
            namespace=options.namespace,
            secret=options.secret,
            local=local,
            claims=backends.claims,
            usable=lambda: not self.degraded.active,
            spawn=self.spawn,
        )
        self.shared = self._shared_writes(loop, options, backends, local, stats)
        self.forgetter = Forgetter(
            loop,
            claims=backends.claims,
            keys=backends.keys,
            sink=backends.default_sink,
            invalidations=self.invalidations,
            degraded=lambda: self.degraded.active,
            approximate=backends.claims.layout == "approximate",
            wait_timeout_s=options.wait_timeout_s,
        )
        # Tombstones need a forget (not in approximate mode: a Bloom filter cannot drop
        # a value); the database's position needs the default sink.
        self.guardian = Guardian(
            loop,
            client=backends.redis,
            namespace=options.namespace,
            claims=backends.claims,
            sink=None if backends.claims.layout == "approximate" else backends.default_sink,
            forgetter=self.forgetter,
            invalidations=self.invalidations,
            stats=stats,
            usable=lambda: not self.degraded.active,
            spawn=self.spawn,
        )
        self.write_stage = WriteStage(
            loop,
            claims=backends.claims,
            rows=rows,
            flights=self.flights,
            stats=stats,
            degraded=self.degraded,
            lease_s=options.lease_s,
            write_budget_s=options.write_budget_s,
            # In a fleet, what this gateway writes itself is announced as the writer's is.
            announce=None if self.shared is None else self.shared.announce,
        )
        self.claim_stage = ClaimStage(
            loop,
            claims=backends.claims,
            flights=self.flights,
            stats=stats,
            degraded=self.degraded,
            shared=self.shared,
        )
        if self.shared is not None:
            self.shared.start()
        # The shared listener, when there is one, carries the invalidation channels.
        self.invalidations.start(own_listener=self.shared is None)
        self.guardian.start()
        if isinstance(backends.redis, Redis) and isinstance(
            backends.redis.connection_pool, SentinelMuxPool
        ):
            self.spawn(follow_primary(backends.redis))
        if backends.redis_down_at_open:
            self.degraded.start_open(backends.redis_down_at_open)

    def _shared_writes(
        self,
        loop: asyncio.AbstractEventLoop,
        options: GatewayOptions,
        backends: Backends,
        local: SavedCache,
        stats: Stats,
    ) -> SharedWrites | None:
        """The fleet's write queue, when this Gateway may use it (None otherwise)."""
        assert backends.claims is not None and backends.sink is not None
        identity = sink_identity(backends.sink)
        if options.shared_mode == "on" and identity is None:
            raise ConfigError(
                "shared_writes='on' needs a sink that declares its identity (an `identity` "
                "attribute naming its database and table): gateways write each other's rows "
                "only when their sinks write the same table"
            )
        if options.shared_mode == "off" or identity is None:
            return None
        assert isinstance(backends.redis, Redis)
        degraded = self.degraded
        return SharedWrites(
            loop,
            mode=options.shared_mode,
            client=backends.redis,
            namespace=options.namespace,
            wire=Wire(
                sink=sink_id(identity, options.secret),
                secret=options.secret,
                keys=backends.keys,
                limits=Limits(
                    max_value_bytes=options.max_value_bytes,
                    max_payload_bytes=options.max_payload_bytes,
                ),
            ),
            claims=backends.claims,
            sink=backends.sink,
            flights=self.flights,
            waits=self.waits,
            requeue=self.claim_queue.extend,
            write_here=self.write_queue.extend,
            stats=stats,
            redis_failed=degraded.redis_failed,
            usable=lambda: not degraded.active,
            spawn=self.spawn,
            batch_rows=options.max_batch,
            linger_s=options.shared_linger_ms / 1000,
            lease_s=options.lease_s,
            write_timeout_s=options.write_timeout_s,
            write_budget_s=options.write_budget_s,
            queue_max=options.shared_queue_max,
            learn=local if options.shared_learn else None,
            invalidations=self.invalidations,
        )

    # The routes: each runs once per batch (or per flush), never once per value.

    async def _claim(self, batch: list[Flight]) -> None:
        """A claim batch: the claim stage decides, and each value goes where it said."""
        stage = self.claim_stage
        if self.shared is not None:
            batch, busy = await stage.take_back_due(batch)
            if busy:
                wait = self.waits.wait
                for f in busy:
                    wait(f)
            if not batch:
                return
        claimed = await stage.run(batch)
        if claimed.won:
            self.write_queue.extend(claimed.won)
        if claimed.busy:
            wait = self.waits.wait
            for f in claimed.busy:
                wait(f)
        if claimed.skipped:
            self.degraded.take(claimed.skipped)

    async def _write(self, batch: list[Flight]) -> None:
        """A write batch: winners short of lease are claimed again (renewing it) at once,
        or given up once their callers' wait is over; the others written."""
        fresh, stale = self.write_stage.split(batch)
        late: list[Flight] = []
        if stale:
            now = self._loop.time()
            late = [f for f in stale if f.deadline <= now]
            self.claim_queue.extend([f for f in stale if f.deadline > now] if late else stale)
        if fresh:
            await self.write_stage.run(fresh)
        if late:
            await self.write_stage.give_up(late)

    def _divert(self, flights: list[Flight]) -> bool:
        """At a queue's flush: while Redis is skipped, degraded mode takes the whole queue."""
        return self.degraded.take(flights)

    def _wrote(self) -> None:
        """A write batch ended: a degraded statement may start in its place."""
        self.degraded.schedule_if_queued()

    async def _probe(self) -> None:
        """One attempt to use Redis again; raises while it cannot be used."""
        backends = self._backends
        if not backends.eviction_checked:
            try:
                await backends.check_redis()  # never use a Redis that may evict keys
            except ConfigError as exc:
                log.error("Redis is reachable but unsafe, so it stays unused: %s", exc)
                raise
            return
        client = backends.redis
        assert client is not None
        # A write, not a PING: a full, read-only or MISCONF Redis answers PING.
        await asyncio.wait_for(
            probe_write(client, self._options.namespace), self._options.redis_timeout_s
        )
        if self.degraded.reason == "oom":
            # A tiny probe fits in the last bytes below maxmemory, a claim batch may
            # not: close only with headroom, or the circuit flaps at the limit.
            info: Any = await asyncio.wait_for(client.info("memory"), self._options.redis_timeout_s)
            for node in per_node(info):
                limit = int(node.get("maxmemory", 0))
                if limit and int(node.get("used_memory", 0)) > limit * OOM_HEADROOM:
                    raise Unavailable("Redis is still nearly full", component="redis")

    @property
    def settling(self) -> bool:
        """Whether a claim or write batch still runs: a write's markers' commit follows
        its answers, so a batch may outlast every flight it had."""
        return bool(self.claim_queue.running or self.write_queue.running)

    def spawn(self, coro: Awaitable[None]) -> None:
        """Run ``coro`` as a task owned by the engine (cancelled at :meth:`stop`)."""
        task: asyncio.Task[None] = self._loop.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def fail_unfinished(self, batch: list[Flight], exc: BaseException) -> None:
        """A batch raised (cancelled at close, or a bug): fail its unanswered values."""
        if isinstance(exc, asyncio.CancelledError):
            message = _CLOSED
        else:
            log.exception("internal error in a batch", exc_info=exc)
            message = f"internal error: {exc!r}"
        queued = {id(f) for f in self.claim_queue.queue}
        queued.update(id(f) for f in self.write_queue.queue)
        queued.update(id(f) for f in self.degraded.queue)
        for f in batch:
            if not f.done and id(f) not in queued:
                self.flights.fail(f, lambda: DedupError(message))

    async def stop(self) -> None:
        """Cancel the engine's tasks and fail every value still in flight."""
        self.invalidations.stop()
        if self.shared is not None:
            await self.shared.stop()
        leftovers = self.waits.clear() + self.degraded.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        leftovers += self.claim_queue.clear() + self.write_queue.clear() + self.degraded.clear()
        for flight in leftovers:
            self.flights.fail(flight, lambda: DedupError(_CLOSED))
        self.flights.fail_all(lambda: DedupError(_CLOSED))
