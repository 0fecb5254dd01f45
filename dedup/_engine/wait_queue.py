"""Waiting, between steps 3 and 4: values whose lease another writer holds.

A busy value is claimed again later, with jittered exponential backoff, until it
is saved, its lease expires (then this process takes it over) or its deadline
(``wait_timeout_s``) passes. Waiters are kept in one heap and woken on a shared
5 ms tick, so that they re-claim together in one batch rather than with one timer
and one tiny claim call each. With shared writes, the fleet's saved-values broadcast
answers a busy value as soon as its row is committed (:meth:`WaitQueue.saved`),
rather than at its next claim.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import random
from collections.abc import Callable

from dedup._engine.flights import Flight, FlightTable
from dedup.errors import WaitTimeout
from dedup.metrics import Stats

__all__ = ["WaitQueue"]

WAKE_TICK_S = 0.005
_PURGE_MIN = 64  # heap entries before answered ones are first dropped


class WaitQueue:
    """The heap of busy values and the one timer that wakes the due ones.

    ``requeue`` receives the woken flights (the claim queue), as one list per tick.
    """

    __slots__ = ("_busy", "_flights", "_heap", "_loop", "_max_backoff_s", "_min_backoff_s",
                 "_purge_at", "_rand", "_requeue", "_seq", "_stats", "_timer",
                 "_wait_timeout_s")  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        flights: FlightTable,
        stats: Stats,
        min_backoff_s: float,
        max_backoff_s: float,
        wait_timeout_s: float,
        requeue: Callable[[list[Flight]], None],
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._loop = loop
        self._flights = flights
        self._stats = stats
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._wait_timeout_s = wait_timeout_s
        self._requeue = requeue
        self._rand = rand
        self._heap: list[tuple[float, int, Flight]] = []
        # The busy values among them, by (kind, digest), for :meth:`saved`.
        self._busy: dict[tuple[str, bytes], Flight] = {}
        self._seq = 0
        self._timer: asyncio.TimerHandle | None = None
        self._purge_at = _PURGE_MIN

    def __len__(self) -> int:
        return len(self._heap)

    def wait(self, f: Flight) -> None:
        """Another writer holds ``f``'s lease: claim it again later, or time it out."""
        self._stats.busy += 1
        now = self._loop.time()
        if now >= f.deadline:
            self._stats.wait_timeouts += 1
            message = f"another writer held this value for more than {self._wait_timeout_s} s"
            self._flights.fail(f, lambda: WaitTimeout(message))
            return
        f.backoff = min(f.backoff * 2, self._max_backoff_s) if f.backoff else self._min_backoff_s
        due = now + f.backoff * (0.5 + self._rand())
        # Round up to a shared tick so that waiters wake (and re-claim) together.
        due = min(math.ceil(due / WAKE_TICK_S) * WAKE_TICK_S, f.deadline)
        if not f.shared:  # never a value whose row this process queued (see saved)
            self._busy[(f.kind, f.digest)] = f
        self.recheck_at(f, due)

    def saved(self, kind: str, digests: list[bytes]) -> list[Flight]:
        """The busy values among ``digests`` (of ``kind``), taken out of the wait: their
        rows are committed (the fleet's writer said so), so they are answered now rather
        than claimed again. A value whose row this process once queued for the writer is
        never among them: the writer's word to this process answers it."""
        busy = self._busy
        if not busy:
            return []
        found: list[Flight] = []
        for digest in digests:
            f = busy.pop((kind, digest), None)
            if f is not None and not f.done:
                found.append(f)
        return found

    def recheck_at(self, f: Flight, due: float) -> None:
        """Claim ``f`` again at ``due`` unless it is answered before (a busy value, or a
        row queued for the fleet's writer)."""
        self._seq += 1
        if len(self._heap) >= self._purge_at:
            self._purge()
        heapq.heappush(self._heap, (due, self._seq, f))
        if self._heap[0][2] is f:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_at(due, self._wake)

    def _purge(self) -> None:
        """Drop the entries of answered flights. A row queued for the fleet's writer is
        rechecked near its caller's deadline, seconds away, though its word mostly comes
        within milliseconds: kept until then, every answered flight (its callers' futures,
        its value) would outlive its use by seconds, and be moved into the collector's
        oldest generation, whose full scans grow with it. Amortised: the heap is filtered
        again only once it has doubled."""
        heap = [entry for entry in self._heap if not entry[2].done]
        heapq.heapify(heap)
        self._heap = heap
        self._busy = {k: f for k, f in self._busy.items() if not f.done}
        self._purge_at = max(_PURGE_MIN, 2 * len(heap))

    def _wake(self) -> None:
        """Hand every waiter that is due back to the claims, as one batch."""
        self._timer = None
        now = self._loop.time()
        heap, busy = self._heap, self._busy
        due: list[Flight] = []
        while heap and heap[0][0] <= now:
            f = heapq.heappop(heap)[2]
            if busy and busy.get((f.kind, f.digest)) is f:
                del busy[(f.kind, f.digest)]
            if not f.done:  # answered meanwhile (by the shared writer's word)
                due.append(f)
        self._requeue(due)
        if heap:
            self._timer = self._loop.call_at(heap[0][0], self._wake)

    def clear(self) -> list[Flight]:
        """Stop the timer and take every waiter out (at close)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        taken = [f for _, _, f in self._heap]
        self._heap.clear()
        self._busy.clear()
        return taken
