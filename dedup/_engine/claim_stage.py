"""Step 3 of a save: one claim script call decides a whole batch.

Per value the script answers saved (``S``: the caller is answered ``redis``),
won (``W``: this process holds the lease and the value goes to the write queue)
or busy (``B``: another writer holds it; the value waits and is claimed again).
The stage answers the saved values and returns where the others go
(:class:`Claimed`); the Engine (:mod:`dedup._engine.wiring`) routes them.
A claim that fails because Redis is unreachable hands its batch to degraded mode,
where the database decides: the claim may or may not have run.
"""

from __future__ import annotations

import asyncio

from redis.exceptions import RedisError

from dedup._claims.protocol import Claims
from dedup._engine.degraded import DegradedMode
from dedup._engine.flights import Flight, FlightTable
from dedup._engine.shared import SharedWrites
from dedup.errors import Unavailable
from dedup.metrics import Stats

__all__ = ["ClaimStage", "Claimed"]


class Claimed:
    """What one claim batch decided, for its caller to route (values found saved are
    answered already): ``won`` to the write queue, ``busy`` to the wait queue,
    ``queued`` to the fleet's writer (:meth:`ClaimStage.enqueue`), ``skipped`` (the
    whole batch, Redis failing) to degraded mode."""

    __slots__ = ("busy", "queued", "skipped", "won")

    def __init__(
        self,
        won: list[Flight],
        busy: list[Flight],
        queued: list[Flight],
        skipped: list[Flight],
    ) -> None:
        self.won = won
        self.busy = busy
        self.queued = queued
        self.skipped = skipped


class ClaimStage:
    """Sends claim batches and decides every value by the script's answer.

    ``shared`` is the fleet's write queue, when this Gateway may use it.
    """

    __slots__ = ("_claims", "_degraded", "_flights", "_loop", "_shared", "_stats")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        claims: Claims,
        flights: FlightTable,
        stats: Stats,
        degraded: DegradedMode,
        shared: SharedWrites | None,
    ) -> None:
        self._loop = loop
        self._claims = claims
        self._flights = flights
        self._stats = stats
        self._degraded = degraded
        self._shared = shared

    async def take_back_due(self, batch: list[Flight]) -> tuple[list[Flight], list[Flight]]:
        """With shared writes, before a claim: the values of ``batch`` still to claim, and
        those to wait for (their take-back failed).

        Values the fleet writer's word answered meanwhile are dropped; rows queued for it
        still without a word as their callers' deadlines near are taken back (and written
        here, or claimed again, by :meth:`SharedWrites.take_back`).
        """
        shared_writes = self._shared
        assert shared_writes is not None
        batch = [f for f in batch if not f.done]
        due = [f for f in batch if f.shared and shared_writes.waiting(f)]
        if not due:
            return batch, []
        batch = [f for f in batch if not (f.shared and shared_writes.waiting(f))]
        # (the rest first: the rows taken back below are written, not claimed)
        try:
            await shared_writes.take_back(due, due=True)
        except (RedisError, OSError) as exc:
            self._stats.redis_errors += 1
            self._degraded.redis_failed(exc)
            return batch, due  # the writer's word may still come, else they time out
        return batch, []

    async def run(self, batch: list[Flight]) -> Claimed:
        """Claim ``batch`` in one script call; answer the values found saved and return
        where the others go."""
        started = self._loop.time()
        try:
            letters = await self._claims.claim([f.key for f in batch])
        except (RedisError, OSError) as exc:
            self._stats.redis_errors += 1
            if self._degraded.redis_failed(exc):
                # The claim may or may not have run; either way the database decides.
                return Claimed([], [], [], batch)
            message = f"Redis failed a claim: {exc!r}"
            for f in batch:
                self._flights.fail(f, lambda: Unavailable(message, component="redis"))
            return Claimed([], [], [], [])
        self._degraded.success()
        self._stats.claim_batches += 1
        resolve = self._flights.resolve
        owner = self._shared
        shared = owner if owner is not None and owner.active else None
        won: list[Flight] = []
        busy: list[Flight] = []
        queued: list[Flight] = []
        saved = 0
        for f, letter in zip(batch, letters, strict=True):
            if letter == "W":
                f.claimed_at = started
                if f.shared:
                    # Its row went to the fleet's writer once and the lease was lost
                    # meanwhile: won again, it is written here.
                    won.append(f)
                elif shared is not None:
                    f.shared = True
                    queued.append(f)
                else:
                    won.append(f)
            elif letter == "S":
                saved += 1
                resolve(f, "redis")
            else:
                busy.append(f)
        self._stats.redis += saved
        return Claimed(won, busy, queued, [])

    async def enqueue(self, queued: list[Flight]) -> list[Flight]:
        """Queue the rows of ``queued`` (from :meth:`run`) for the fleet's writer; return
        those to write here instead."""
        assert self._shared is not None
        try:
            return await self._shared.enqueue(queued)
        except (RedisError, OSError) as exc:
            # The leases are ours either way: write these here, or degraded.
            self._stats.redis_errors += 1
            self._degraded.redis_failed(exc)
            return queued
