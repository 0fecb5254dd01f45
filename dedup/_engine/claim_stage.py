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
from typing import Any

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
    answered already, values queued for the fleet's writer wait for its word): ``won``
    to the write queue, ``busy`` to the wait queue, ``skipped`` (the whole batch, Redis
    failing) to degraded mode."""

    __slots__ = ("busy", "skipped", "won")

    def __init__(self, won: list[Flight], busy: list[Flight], skipped: list[Flight]) -> None:
        self.won = won
        self.busy = busy
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
        where the others go. With shared writes, the rows of the values it wins are
        queued for the fleet's writer by a second script in the same round trip; those
        wait for the writer's word and are in no list of the result. The fleet's writer
        queues nothing: its winners join its next statement (and are in no list either)."""
        owner = self._shared
        shared = owner if owner is not None and owner.active else None
        if shared is None or not shared.takes_own():
            return await self._run(batch, shared, own=False)
        with shared.own_claim():  # its pops wait for these winners, not on the queue
            return await self._run(batch, shared, own=True)

    async def _run(self, batch: list[Flight], shared: SharedWrites | None, *, own: bool) -> Claimed:
        started = self._loop.time()
        # A value whose row went to the writer once and whose lease was lost meanwhile
        # is not queued again: won again, it is written here.
        prepared = (
            None if shared is None or own else shared.prepare([f for f in batch if not f.shared])
        )
        keys = [f.key for f in batch]
        reply: Any = None
        try:
            if prepared is None:
                letters = await self._claims.claim(keys)
            else:
                letters, reply = await self._claims.claim_then(keys, prepared.call)
        except (RedisError, OSError) as exc:
            if shared is not None and prepared is not None:
                shared.unprepare(prepared)  # never known to be queued: decided below
            self._stats.redis_errors += 1
            if self._degraded.redis_failed(exc):
                # The claim may or may not have run; either way the database decides.
                return Claimed([], [], batch)
            message = f"Redis failed a claim: {exc!r}"
            for f in batch:
                self._flights.fail(f, lambda: Unavailable(message, component="redis"))
            return Claimed([], [], [])
        self._degraded.success()
        self._stats.claim_batches += 1
        queued: set[bytes] = set()
        if shared is not None and prepared is not None:
            won_keys = {key for key, letter in zip(keys, letters, strict=True) if letter == "W"}
            queued = shared.settle(prepared, reply, won_keys)
        resolve = self._flights.resolve
        won: list[Flight] = []
        busy: list[Flight] = []
        saved = 0
        for f, letter in zip(batch, letters, strict=True):
            if letter == "W":
                f.claimed_at = started
                if shared is not None and not own:
                    f.shared = True
                if f.done or f.key in queued:
                    continue  # its row waits for the writer (whose word may be in already)
                won.append(f)
            elif letter == "S":
                saved += 1
                resolve(f, "redis")
            else:
                busy.append(f)
        self._stats.redis += saved
        if own and shared is not None:
            won = shared.add_own(won)  # those it cannot take (it stopped writing): here
        return Claimed(won, busy, [])
