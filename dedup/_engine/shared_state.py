"""The state of one gateway's shared writes (:mod:`dedup._engine.shared`): the settings,
the names of the queue, the election, the heartbeat and the channels (named after the
sink's identity, under one hash tag), the rows waiting for the writer's word and the
writer's term; and what both sides, the claimant's and the writer's, use of it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis

from dedup._claims.protocol import Claims
from dedup._engine.flights import Flight, FlightTable
from dedup._engine.invalidation import Invalidations
from dedup._engine.local import SavedCache
from dedup._engine.shared_wire import SAVED, Wire
from dedup._engine.wait_queue import WaitQueue
from dedup.metrics import Stats
from dedup.types import BatchWriter

__all__ = ["IDLE_S", "Queued", "SharedState"]

log = logging.getLogger("dedup")

IDLE_S = 0.2
"""How long a loop of shared writes idles before it looks again (while Redis is skipped,
or the gateway may not stand for writer); also the margin, beyond the write budget, that
a queued row's caller must have left (:meth:`dedup._engine.shared.SharedWrites.prepare`)."""
_WARN_EVERY_S = 10.0
_NUDGE_GAP_S = 0.02
"""The least time between two beats, renewals or tries for the writer lease that a word on
the fleet's channel brings forward."""


class Queued:
    """A row this gateway queued and still waits for: its flight, the claim's nonce, the
    token its lease holds while queued, the writer's term it waits for (None: none was
    popping), and whether a take-back of it is under way."""

    __slots__ = ("flight", "gone", "nonce", "queued", "returning", "term")

    def __init__(self, flight: Flight, nonce: int, queued: str, term: bytes | None) -> None:
        self.flight = flight
        self.nonce = nonce
        self.queued = queued
        self.term = term
        self.returning = False
        self.gone = False  # its lease was found gone once: the writer's word may be on its way


class SharedState:
    """The state of one Gateway's shared writes and the helpers both sides use; the
    arguments are :class:`dedup._engine.shared.SharedWrites`'s."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        mode: str,
        client: Redis,
        namespace: str,
        wire: Wire,
        claims: Claims,
        sink: BatchWriter,
        flights: FlightTable,
        waits: WaitQueue,
        requeue: Callable[[list[Flight]], None],
        write_here: Callable[[list[Flight]], None],
        stats: Stats,
        redis_failed: Callable[[BaseException], object],
        usable: Callable[[], bool],
        spawn: Callable[[Awaitable[None]], None],
        batch_rows: int,
        linger_s: float,
        lease_s: float,
        write_timeout_s: float,
        write_budget_s: float,
        queue_max: int,
        learn: SavedCache | None,
        invalidations: Invalidations | None = None,
    ) -> None:
        self._loop = loop
        self._mode = mode
        self._client = client
        self._wire = wire
        self._claims = claims
        self._sink = sink
        self._flights = flights
        self._waits = waits
        self._requeue = requeue
        self._write_here = write_here
        self._stats = stats
        self._redis_failed = redis_failed
        self._usable = usable
        self._spawn = spawn
        self._batch_rows = batch_rows
        # A busy writer with fewer rows than this waits for the statement in flight.
        self._fill = max(1, batch_rows // 2)
        # A statement popped while another was in flight and still this small when that
        # one ends keeps topping up until it has waited this long in all.
        self._small = max(1, batch_rows // 8)
        self._small_wait_s = 4 * linger_s
        self._linger_s = linger_s
        # Two statements overlap: one fills while the other waits for its commit. Like
        # the per-process batcher, an idle writer sends at once and a busy one lingers
        # for a fuller statement, so statements stay few under load and waits short.
        self._statements = asyncio.Semaphore(2)
        self._writing = 0
        # Set when a statement ends: a pop that lingers behind one in flight takes its
        # rows then, in one script call, rather than at every ``linger_s``.
        self._ended = asyncio.Event()
        self._popping = False
        self._blocking = False  # the writer waits on an empty queue (a blocking pop)
        self._draining = False  # the writer pops and writes (its lease held)
        # From taking the writer lease until its term has ended: stop() waits for it, so
        # that the engine's cancelling its tasks never cuts the term's end short.
        self._in_term = False
        # The writer's own winners, for its next statement: they need not travel through
        # the queue, be checked, nor be answered over Redis (see :meth:`takes_own`).
        self._own: list[Flight] = []
        self._own_claims = 0  # claims out whose winners join it (see own_claim)
        self._lease_s = lease_s
        self._lease_ms = max(1, int(lease_s * 1000))
        self._writer_lease_s = max(1.0, lease_s)
        # The heartbeat outlives the writer lease by a lease: when a writer dies, the
        # others still count it (and so stand for writer) until its lease has passed to
        # one of them, which then drains the queue.
        self._heartbeat_ttl_ms = max(3500, int(self._writer_lease_s * 2000))
        self._queue_ttl_ms = max(1000, int(lease_s * 2000))
        self._queue_max = queue_max
        # The local tier that learns what the fleet saved (None: off).
        self._learn = learn
        # The local tier's invalidation channels, carried on this listener's subscription.
        self._invalidations = invalidations
        self._write_timeout_s = write_timeout_s
        self._write_budget_s = write_budget_s
        prefix = f"{namespace}:{{w}}:{wire.sink}:"  # one hash tag: every shared key in one slot
        self._queue_key = (prefix + "queue").encode()
        self._fleet_key = (prefix + "fleet").encode()
        self._writer_key = prefix + "writer"
        self._term_key = (prefix + "term").encode()
        # The copy of the writer's last pop (see POP), one key per term, so that a writer
        # never drops the copy of another: named when the term starts.
        self._last_pop_prefix = (prefix + "popped:").encode()
        self._last_pop_key = b""
        self._channels = prefix + "done:"
        self.gateway_id = secrets.token_hex(8)
        self._channel = self._channels + self.gateway_id
        self._saved_channel = self._channels + SAVED
        # Where a writer that stops, or a gateway that joins, says so: any message there
        # is only a nudge (a forged one costs a beat, a renewal and a try for the writer
        # lease, nothing else).
        self._fleet_channel = self._channels + "fleet"
        self._renew_now = asyncio.Event()
        self._stand_now = asyncio.Event()
        self._beat_now = asyncio.Event()
        self._nudges = 0
        self._nonces = itertools.count(1)
        self._pops = itertools.count(1)  # the writer's pop ids (with its term)
        # Rows this gateway queued and still waits for, by key: the flight, its nonce and
        # the writer's term when it was queued (the writer that should pop it).
        self._pending: dict[bytes, Queued] = {}
        self._term = b""
        self._listening = False
        self._fleet = 1
        self._stopping = False
        self._failures = 0
        self._resign = False
        self._rest_until = 0.0
        self._abandoned: set[asyncio.Future[Any]] = set()
        self._warned_at = -_WARN_EVERY_S
        self._unwarned = 0
        self.writer = False
        """True while this gateway holds the writer lease."""

    @property
    def active(self) -> bool:
        """Whether winners should queue their rows (rather than write them here) now."""
        if self._mode == "off" or not self._listening or not self._usable():
            return False
        return self._mode == "on" or self._fleet > 1

    @staticmethod
    async def _pause(nudge: asyncio.Event, seconds: float) -> None:
        """Sleep ``seconds``, or until ``nudge`` is set (a word on the fleet's channel),
        then a moment more, so that a flood of such words cannot make a loop spin."""
        try:
            await asyncio.wait_for(nudge.wait(), seconds)
        except TimeoutError:
            return
        nudge.clear()
        await asyncio.sleep(_NUDGE_GAP_S)

    def _bad(self, reason: str) -> None:
        """A message that cannot be used: count it, and log at most once per interval."""
        self._stats.shared_bad_messages += 1
        self._unwarned += 1
        now = self._loop.time()
        if now - self._warned_at >= _WARN_EVERY_S:
            log.warning(
                "shared writes: skipped %d unusable message(s) in Redis; the last: %s",
                self._unwarned,
                reason,
            )
            self._warned_at, self._unwarned = now, 0
