"""Step 3 of a save: one claim script call decides a whole batch.

Per value the script answers saved (``S``: the caller is answered ``redis``),
won (``W``: this process holds the lease and the value goes to the write queue)
or busy (``B``: another writer holds it; the value waits and is claimed again).
A claim that fails because Redis is unreachable hands its batch to degraded mode,
where the database decides: the claim may or may not have run.
"""

from __future__ import annotations

import asyncio

from redis.exceptions import RedisError

from dedup._claims.protocol import Claims
from dedup._engine.batcher import Batcher
from dedup._engine.degraded import DegradedMode
from dedup._engine.flights import Flight, FlightTable
from dedup._engine.shared import SharedWrites
from dedup._engine.wait_queue import WaitQueue
from dedup.errors import Unavailable
from dedup.metrics import Stats

__all__ = ["ClaimStage"]


class ClaimStage:
    """Sends claim batches and routes each value by the script's answer."""

    __slots__ = ("_claims", "_degraded", "_flights", "_loop", "_stats", "_waits", "_writes",
                 "shared")  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        claims: Claims,
        flights: FlightTable,
        stats: Stats,
        degraded: DegradedMode,
        waits: WaitQueue,
        writes: Batcher,
    ) -> None:
        self._loop = loop
        self._claims = claims
        self._flights = flights
        self._stats = stats
        self._degraded = degraded
        self._waits = waits
        self._writes = writes
        self.shared: SharedWrites | None = None
        """The fleet's write queue, when this Gateway may use it."""

    async def run(self, batch: list[Flight]) -> None:
        """Claim ``batch`` in one script call and route every value by its answer."""
        shared_writes = self.shared
        if shared_writes is not None:  # the fleet writer's word may have answered some
            batch = [f for f in batch if not f.done]
            # Queued rows still without a word as their callers' deadlines near.
            due = [f for f in batch if f.shared and shared_writes.waiting(f)]
            if due:
                batch = [f for f in batch if not (f.shared and shared_writes.waiting(f))]
                # (the rest first: the rows taken back below are written, not claimed)
                try:
                    await shared_writes.take_back(due, due=True)
                except (RedisError, OSError) as exc:
                    self._stats.redis_errors += 1
                    self._degraded.redis_failed(exc)
                    for f in due:  # the writer's word may still come, else they time out
                        self._waits.wait(f)
            if not batch:
                return
        started = self._loop.time()
        try:
            letters = await self._claims.claim([f.key for f in batch])
        except (RedisError, OSError) as exc:
            self._stats.redis_errors += 1
            if self._degraded.redis_failed(exc):
                # The claim may or may not have run; either way the database decides.
                self._degraded.take(batch)
                return
            message = f"Redis failed a claim: {exc!r}"
            for f in batch:
                self._flights.fail(f, lambda: Unavailable(message, component="redis"))
            return
        self._degraded.success()
        self._stats.claim_batches += 1
        writes, resolve, wait = self._writes.queue, self._flights.resolve, self._waits.wait
        owner = self.shared
        shared = owner if owner is not None and owner.active else None
        queued: list[Flight] = []
        won = False
        saved = 0
        for f, letter in zip(batch, letters, strict=True):
            if letter == "W":
                f.claimed_at = started
                if f.shared:
                    # Its row went to the fleet's writer once and the lease was lost
                    # meanwhile: won again, it is written here.
                    writes.append(f)
                    won = True
                elif shared is not None:
                    f.shared = True
                    queued.append(f)
                else:
                    writes.append(f)
                    won = True
            elif letter == "S":
                saved += 1
                resolve(f, "redis")
            else:
                wait(f)
        self._stats.redis += saved
        if won:
            self._writes.schedule()
        if queued:
            assert shared is not None
            try:
                here = await shared.enqueue(queued)
            except (RedisError, OSError) as exc:
                # The leases are ours either way: write these here, or degraded.
                self._stats.redis_errors += 1
                self._degraded.redis_failed(exc)
                here = queued
            if here:
                self._writes.extend(here)
