"""Step 4 across processes: the fleet's winners share one write queue and one writer.

Batching only its own winners, each process sends smaller statements as the fleet
grows (16 processes of 16 callers can never fill a batch past 16 rows). In shared
mode a winner does not write: it pushes its row onto one Redis list. One writer,
elected with the project's own fenced lease (:class:`dedup.lock.Lock`, renewed by
its watchdog and taken over when its holder dies or pauses past it), drains the
list into large sorted statements, commits the markers, and publishes each outcome
on the claimant's own channel; every process answers its callers from those words.

Who shares: only gateways whose sinks have the same identity (the default sink's is
its database URL without the password, plus the table; a custom sink declares one,
or never shares). The queue, the election, the heartbeat and the channels are all
named after that identity, so gateways of several services on one Redis share
markers but each writes its own rows into its own database.

Nothing is acknowledged before the row is committed, and no wait is unbounded:

* a queued row's lease holds a token naming the claim; the claimant renews it while
  it waits (so no other gateway can claim a value whose row is still queued);
* the writer's pop script swaps its term into the lease of every row it pops whose
  lease is still queued (the row's prefix names the lease), then the writer checks
  each row (format, claim, signature with ``shared_secret``, the save's own checks,
  the prefix) and gives back the holds of rows it cannot use, then writes; a claimant
  takes a row back (the lease is its own again) in one script too, only while no
  writer holds it: so a row is written by the writer or by its claimant, never by
  both, and the one ``created=True`` is never lost between them. It takes rows back
  when the writer answers ``r``, when the term it waits for ends or changes, or in
  time for its caller's ``wait_timeout_s``; it writes them itself when the queue is
  full;
* a writer whose statement times out, or fails a few times in a row, hands its rows
  back (``r``), gives up the role and rests a while, so a writer cut off from its
  database never holds up the fleet;
* answers name their claim (gateway and nonce), so a stale answer resolves nothing.

The writer is a gateway too: while it writes for the fleet, the values its own claims win
skip the queue and join its next statement. A writer that stops ends its term and says
so, and a gateway that joins the heartbeat says so, on one channel every gateway of the
sink hears, so that rows are taken back, writers stand and the fleet is counted at once.

The mode: ``shared_writes="auto"`` (the default) writes across processes while
more than one gateway of the same sink is alive (a heartbeat set in Redis), and
per process otherwise, where the extra hop only costs; ``"on"`` and ``"off"`` force it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable, Container, Iterator
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dedup._claims.protocol import Claims
from dedup._engine.flights import Flight, FlightTable
from dedup._engine.local import SavedCache
from dedup._engine.shared_scripts import (
    END_TERM,
    ENQUEUE,
    HEARTBEAT,
    LEAVE,
    POP,
    RENEW,
    TAKE_BACK,
    UNHOLD,
)
from dedup._engine.shared_wire import SAVED, BadMessage, QueuedRow, Wire
from dedup._engine.wait_queue import WaitQueue
from dedup._engine.write_stage import row_order, write_rows
from dedup._redis.mux import Mux
from dedup._redis.script import Script, ScriptCall, run_script, run_together
from dedup.lock import Lock
from dedup.metrics import Stats
from dedup.types import BatchWriter, Row

__all__ = ["Enqueue", "SharedWrites"]

log = logging.getLogger("dedup")


_HEARTBEAT, _LEAVE, _ENQUEUE = Script(HEARTBEAT), Script(LEAVE), Script(ENQUEUE)
_POP, _RENEW, _TAKE_BACK = Script(POP), Script(RENEW), Script(TAKE_BACK)
_UNHOLD, _END_TERM = Script(UNHOLD), Script(END_TERM)
_HEARTBEAT_S = 1.0
_POP_BLOCK_S = 0.1
_IDLE_S = 0.2
_MAX_FAILURES = 3
"""Statements in a row a writer may fail before it gives up the role (a timeout: one)."""
_REST_LEASES = 3
"""Leases a writer that gave up the role waits before standing again."""
_WARN_EVERY_S = 10.0
_NUDGE_GAP_S = 0.02
"""The least time between two beats, renewals or tries for the writer lease that a word on
the fleet's channel brings forward."""
_ANSWER_GRACE_S = 0.25
"""How long a claimant that finds its queued row's lease gone waits for the writer's word
before claiming the value afresh (the word is published before the lease goes)."""


class _Queued:
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


class Enqueue:
    """The rows of one claim batch prepared for the writer's queue: their waits and the
    script call that queues them (see :meth:`SharedWrites.prepare`)."""

    __slots__ = ("call", "entries")

    def __init__(self, entries: list[_Queued], call: ScriptCall) -> None:
        self.entries = entries
        self.call = call


_Words = dict[str, dict[str, list[Any]]]
"""The writer's words of one statement: per claimant gateway, per letter, the flat list
``[key_hex, nonce, ...]`` of :meth:`Wire.answer`."""


_ENDED = b""
"""The term of a row held by a writer whose term ended: never the current one."""


class SharedWrites:
    """The shared write queue of one Gateway: its writer candidate, heartbeat and listener.

    ``mode`` is ``"auto"``, ``"on"`` or ``"off"``; ``sink`` names the sink's
    identity digest (:func:`dedup._engine.shared_wire.sink_id`). :meth:`prepare`
    and :meth:`settle` queue the rows of the values a claim wins, in the claim's round
    trip; :attr:`active` says whether claims should use it now.
    """

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
        self._pending: dict[bytes, _Queued] = {}
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

    def start(self) -> None:
        """Start listening, beating, renewing queued rows and standing for writer."""
        if self._mode == "off":
            return
        self._spawn(self._listen())
        self._spawn(self._beat())
        self._spawn(self._renew())
        self._spawn(self._stand())

    async def stop(self) -> None:
        """Stop popping, let the statements in flight finish (bounded), leave the fleet;
        the engine then cancels the tasks. Rows a stopping writer popped but did not
        write are answered ``r``: their claimants write them."""
        self._stopping = True
        if self._mode == "off":
            return
        # The statements' bound, then a second each for giving up the writer lease and
        # ending the term.
        deadline = self._loop.time() + self._write_timeout_s + 3
        while (  # noqa: ASYNC110
            self._writing or self._popping or self._in_term
        ) and self._loop.time() < deadline:
            await asyncio.sleep(0.005)
        with contextlib.suppress(RedisError, OSError, TimeoutError):  # it expires anyway
            await asyncio.wait_for(_LEAVE(self._client, [self._fleet_key], [self.gateway_id]), 1)

    # ------------------------------------------------------------- claimant side

    def takes_own(self) -> bool:
        """Whether the winners of a claim sent now should join this gateway's own next
        statement as the fleet's writer (:meth:`add_own`) rather than the queue: while it
        writes for the fleet and is not waiting on an empty queue (a blocking pop, which
        they would not wake). Send such a claim under :meth:`own_claim`."""
        return self._writes_own() and not self._blocking

    def _writes_own(self) -> bool:
        return self._draining and not self._resign and not self._stopping and not self._abandoned

    @contextlib.contextmanager
    def own_claim(self) -> Iterator[None]:
        """Around a claim sent while :meth:`takes_own`, until its winners reach
        :meth:`add_own`: meanwhile this writer's pops wait for them rather than on an
        empty queue, where their rows would never arrive."""
        self._own_claims += 1
        try:
            yield
        finally:
            self._own_claims -= 1

    def add_own(self, won: list[Flight]) -> list[Flight]:
        """Take ``won``, the winners of a claim sent under :meth:`own_claim`, into this
        writer's next statement; returns those it cannot take (it stopped writing
        meanwhile): they are written here, per process."""
        if not won or not self._writes_own():
            return won
        self._own += won
        return []

    def _flush_own(self) -> None:
        """The writer stops writing: its own winners not written yet are written here."""
        own, self._own = [f for f in self._own if not f.done], []
        if own:
            self._write_here(own)

    def prepare(self, claiming: list[Flight]) -> Enqueue | None:
        """The rows of ``claiming`` to queue for the writer, as a script call to send right
        behind the claim that takes their leases, in the same round trip: the script
        queues the row of each value whose lease the claim just won (None: nothing to
        queue). Values too close to their deadline to wait for the writer are left out:
        if won, they are written here.

        Every row of it is waited for from now on (the writer may pop, write and answer
        a row before the reply is read here, and its word must find the claim); call
        :meth:`settle` with the reply, or :meth:`unprepare` if the call failed.

        A queued row's lease holds its queued token, renewed while the row waits. The
        writer that pops it swaps in its term before writing (so nobody else takes
        it); this gateway takes it back (the lease is ours again) and writes it here
        when the writer answers ``r``, when the term it waits for ends or changes
        before a writer holds it, or when its caller's ``wait_timeout_s`` leaves just
        enough time to write it. Either the writer or this gateway writes it, never both.
        """
        # Queue only a row whose caller can still wait for the writer a while and then,
        # with no word, have it written here before its deadline: its take-back is due a
        # write budget before the deadline (see settle), so that must be ahead of now.
        soon = self._loop.time() + self._write_budget_s + _IDLE_S
        queued = [f for f in claiming if f.deadline > soon]
        if not queued:
            return None
        gw, token, row = self.gateway_id, self._claims.token, self._wire.row
        nonces = [next(self._nonces) for _ in queued]
        tokens = [f"{token}#{n}" for n in nonces]
        args: list[Any] = [self._queue_max, self._queue_ttl_ms, token, self._lease_ms]
        for f, n, t in zip(queued, nonces, tokens, strict=True):
            args += (t, row(gw, n, t, f.key, f.kind, f.value, f.payload_json))
        pending = self._pending
        entries = [_Queued(f, n, t, None) for f, n, t in zip(queued, nonces, tokens, strict=True)]
        for e in entries:
            pending[e.flight.key] = e
        # The rows carry values in clear: none outlives its use. A row older than a
        # lease is written by its claimant anyway, so the queue of a fleet that died
        # vanishes two leases after its last push.
        call: ScriptCall = (
            _ENQUEUE,
            [self._queue_key, self._term_key, *(f.key for f in queued)],
            args,
        )
        return Enqueue(entries, call)

    def unprepare(self, batch: Enqueue) -> None:
        """The queueing call failed: its rows are not waited for (the caller decides)."""
        for e in batch.entries:
            self._forget(e)

    def settle(self, batch: Enqueue, reply: Any, won: Container[bytes]) -> set[bytes]:
        """The queueing call's ``reply``: the keys whose rows are now queued and wait for
        the writer's word. The others (past the queue's cap, or a lease that is not this
        claim's: the value was saved or busy, or the lease was lost meanwhile) are not
        waited for: the claim's answer decides them. ``won`` are the keys the claim won,
        for the count of rows written here because the queue was full."""
        added, term, flags = reply
        entries = batch.entries
        if not added:  # past the cap: the writer is behind, the claimant writes these
            for e in entries:
                self._forget(e)
            self._stats.shared_queue_full += sum(e.flight.key in won for e in entries)
            return set()
        term = term or None
        flags = flags.decode() if isinstance(flags, bytes) else str(flags)
        pending, recheck, budget = self._pending, self._waits.recheck_at, self._write_budget_s
        queued: set[bytes] = set()
        for e, flag in zip(entries, flags, strict=True):
            if flag != "1":
                self._forget(e)
                continue
            self._stats.shared_rows_queued += 1
            if pending.get(e.flight.key) is e:  # no word yet
                e.term = term
                queued.add(e.flight.key)
                # With no word by then (a lost answer), it is taken back in time.
                recheck(e.flight, e.flight.deadline - budget)
        return queued

    def _forget(self, e: _Queued) -> None:
        """Stop waiting for ``e``'s word (unless the writer's word came first)."""
        if self._pending.get(e.flight.key) is e:
            del self._pending[e.flight.key]

    def waiting(self, f: Flight) -> bool:
        """Whether ``f``'s row is queued and this gateway still waits for its word."""
        entry = self._pending.get(f.key)
        return entry is not None and entry.flight is f

    async def take_back(self, flights: list[Flight], *, due: bool = False) -> None:
        """Take the rows of ``flights`` (queued, with no word yet) back to write them here.

        One script decides each row: taken back (the lease is ours again: written
        here), held by the current writer (its word comes), held by a writer whose term
        ended (its lease runs out unless it answers), or gone (claimed afresh). ``due``:
        their callers' deadline nears, so rows that stay with a writer wait as busy
        values do, ending by the deadline. Redis errors propagate.
        """
        entries = []
        for f in flights:
            entry = self._pending.get(f.key)
            if entry is None or entry.flight is not f:
                continue
            if not entry.returning:
                entry.returning = True
                entries.append(entry)
            elif due:
                # Another take-back of it (a renewal's, or an "r" word's) is under way and
                # may leave it with a writer; this due one was its deadline's re-check, so
                # it waits as a busy value does, or the flight would wait with no end.
                self._waits.wait(f)
        if not entries:
            return
        started = self._loop.time()
        try:
            letters: Any = ""
            term: Any = None
            for i in range(0, len(entries), 1000):
                part = entries[i : i + 1000]
                (got, term), trips = await run_script(
                    self._client,
                    _TAKE_BACK,
                    [self._term_key, *(e.flight.key for e in part)],
                    [self._claims.token, self._lease_ms, *(e.queued for e in part)],
                )
                self._stats.redis_round_trips += trips
                letters += got.decode() if isinstance(got, bytes) else str(got)
        finally:
            for e in entries:
                e.returning = False
        term = term or None
        pending, stats = self._pending, self._stats
        here: list[Flight] = []
        again: list[Flight] = []
        for e, letter in zip(entries, letters, strict=True):
            f = e.flight
            if f.done or pending.get(f.key) is not e:
                continue  # answered meanwhile
            if letter == "o":  # ours again: written here
                del pending[f.key]
                stats.shared_rows_returned += 1
                f.claimed_at = started  # the script renewed the lease
                here.append(f)
            elif letter == "x" and not e.gone:
                # Most often a writer wrote it and marked it saved just now: its word,
                # published first, may still be on its way. Look again a moment later.
                e.gone, e.term = True, _ENDED
                self._waits.recheck_at(f, min(self._loop.time() + _ANSWER_GRACE_S, f.deadline))
            elif letter == "x":  # still gone, no word: claimed afresh (won again, it
                del pending[f.key]  # is written here; saved, it answers created=False)
                stats.shared_rows_returned += 1
                again.append(f)
            else:
                e.term = term if letter == "h" else _ENDED
                if due:
                    self._waits.wait(f)
        if here:
            self._write_here(here)
        if again:
            self._requeue(again)

    async def _take_back_soon(self, flights: list[Flight]) -> None:
        try:
            await self.take_back(flights)
        except (RedisError, OSError) as exc:
            self._redis_failed(exc)

    def _answer(self, message: bytes) -> None:
        """The writer's word on some of our rows: answer their callers."""
        try:
            claims = self._wire.read_answer(message, self.gateway_id)
        except BadMessage as exc:
            self._bad(str(exc))
            return
        pending, resolve, stats = self._pending, self._flights.resolve, self._stats
        back: list[Flight] = []
        for letter, key, nonce in claims:
            entry = pending.get(key)
            if entry is None or entry.nonce != nonce:
                continue  # a stale word, or a claim this gateway does not wait for
            f = entry.flight
            if f.done:
                del pending[key]
                continue
            if letter == "i":
                del pending[key]
                stats.write += 1
                resolve(f, "write")
            elif letter == "e":
                del pending[key]
                stats.db += 1
                resolve(f, "db")
            else:  # "r": the writer did not write it; take it back and write it here
                back.append(f)
        if back:
            self._spawn(self._take_back_soon(back))

    def _learn_saved(self, message: bytes) -> None:
        """The values some gateway of this sink saved: the local tier learns them, so that
        this process answers them without a claim from now on, and those of them that
        wait for another claimant's lease (busy) are answered now."""
        local = self._learn
        if local is None:
            return
        try:
            groups = self._wire.read_saved(message)
        except BadMessage as exc:
            self._bad(str(exc))
            return
        learned = 0
        stats, resolve, saved = self._stats, self._flights.resolve, self._waits.saved
        for kind, digests in groups:
            local.add_many(kind, digests)
            learned += len(digests)
            for f in saved(kind, digests):
                stats.redis += 1
                stats.shared_busy_answered += 1
                resolve(f, "redis")
        stats.shared_learned += learned

    async def _listen(self) -> None:
        """Receive the writer's words on this gateway's channel; resubscribe after errors."""
        channels = [self._channel, self._fleet_channel]
        if self._learn is not None:
            channels.append(self._saved_channel)
        saved, fleet = self._saved_channel.encode(), self._fleet_channel.encode()

        def heard(channel: bytes, data: bytes) -> None:
            if channel == saved:
                self._learn_saved(data)
            elif channel == fleet:
                self._nudges += 1
                if data == b"joined":  # count the fleet again
                    self._beat_now.set()
                else:  # a writer's term ended: take rows back, stand
                    self._renew_now.set()
                    self._stand_now.set()
            else:
                self._answer(data)

        mux: Mux | None = getattr(self._client.connection_pool, "mux", None)
        while not self._stopping:
            if not self._usable():  # never touch a Redis the circuit keeps us off
                await asyncio.sleep(_IDLE_S)
                continue
            try:
                if mux is not None:
                    await self._listen_on(mux, channels, heard)
                else:
                    await self._listen_pubsub(channels, heard)
            except (RedisError, OSError) as exc:
                self._redis_failed(exc)
                await asyncio.sleep(0.2)
            finally:
                self._listening = False

    async def _listen_on(
        self, mux: Mux, channels: list[str], heard: Callable[[bytes, bytes], None]
    ) -> None:
        """Listen on a subscription of the client's own (each message read and handled in
        the connection's callback: a tenth of the CPU of redis-py's ``PubSub``) until the
        circuit opens or the connection is lost."""
        subscription = await mux.subscribe(channels, heard)
        try:
            self._listening = True
            while self._usable():
                await asyncio.wait([subscription.lost], timeout=1)
                if subscription.lost.done():
                    raise ConnectionError("the writer's channel was lost")
        finally:
            subscription.close()

    async def _listen_pubsub(
        self, channels: list[str], heard: Callable[[bytes, bytes], None]
    ) -> None:
        """Listen through redis-py's ``PubSub`` (a client with no shared connection)."""
        pubsub = self._client.pubsub()
        try:
            await pubsub.subscribe(*channels)
            self._listening = True
            while self._usable():
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
                if message is not None and message["type"] == "message":
                    heard(message["channel"], message["data"])
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _renew(self) -> None:
        """A third of a lease apart: renew the leases of the rows this gateway queued, so
        that no other gateway claims a value whose row still waits for the writer, and
        take back the rows whose writer has stopped popping or changed since; while Redis
        is skipped, write them here (:meth:`_write_pending_here`)."""
        while not self._stopping:
            await self._pause(self._renew_now, self._lease_s / 3)
            pending = self._pending
            for key in [k for k, e in pending.items() if e.flight.done]:
                del pending[key]
            if not pending:
                continue
            if not self._usable():
                self._write_pending_here()
                continue
            entries = list(pending.values())
            term: Any = None
            try:
                for i in range(0, len(entries), 1000):
                    part = entries[i : i + 1000]
                    term, trips = await run_script(
                        self._client,
                        _RENEW,
                        [self._term_key, *(e.flight.key for e in part)],
                        [self._lease_ms, *(e.queued for e in part)],
                    )
                    self._stats.redis_round_trips += trips
            except (RedisError, OSError) as exc:
                self._redis_failed(exc)
                continue
            term = term or None
            # Rows queued while no writer popped wait for the first that does; a row
            # whose term ended or changed may have been popped and lost: take it back
            # (unless a writer holds it), and with no writer popping, every row.
            back: list[Flight] = []
            for e in entries:
                if term is not None and e.term is None:
                    e.term = term
                elif not e.returning and (term is None or e.term != term):
                    back.append(e.flight)
            if back:
                await self._take_back_soon(back)

    def _write_pending_here(self) -> None:
        """Redis is skipped (degraded mode): no writer's word can reach this gateway, and
        the callers of its queued rows would wait until their deadline nears. Their values
        are claimed again, which in degraded mode writes them through the database alone
        (its unique key decides ``created``, as for every save meanwhile); a writer that
        still writes such a row meets the same key. A take-back under way keeps its own."""
        flights = [e.flight for e in self._pending.values() if not e.returning]
        for f in flights:
            del self._pending[f.key]
        self._stats.shared_rows_returned += len(flights)
        self._requeue(flights)

    async def _beat(self) -> None:
        """Count the live gateways of this sink, once a second, and at once when one
        joins."""
        while not self._stopping:
            if not self._usable():
                await asyncio.sleep(_IDLE_S)
                continue
            try:
                fleet, trips = await run_script(
                    self._client,
                    _HEARTBEAT,
                    [self._fleet_key],
                    [self.gateway_id, self._heartbeat_ttl_ms, self._fleet_channel],
                )
                self._stats.redis_round_trips += trips
                self._fleet = int(fleet)
            except (RedisError, OSError) as exc:
                self._redis_failed(exc)
            await self._pause(self._beat_now, _HEARTBEAT_S)

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

    # ------------------------------------------------------------- writer side

    def _may_stand(self) -> bool:
        # A writer that gave up rests, and never stands while a statement it abandoned
        # (a sink ignoring cancellation) still runs.
        return self.active and self._loop.time() >= self._rest_until and not self._abandoned

    async def _stand(self) -> None:
        """Stand for writer: take the writer lease when free, write while it is held."""
        lease = Lock(
            self._client,
            self._writer_key,
            timeout=self._writer_lease_s,
            blocking=False,
            watchdog=True,
            release_signal=False,
        )
        while not self._stopping:
            if not self._may_stand():
                await asyncio.sleep(_IDLE_S)
                continue
            try:
                if not await lease.acquire(blocking=False):
                    await self._pause(self._stand_now, self._lease_s / 3)
                    continue
            except (RedisError, OSError) as exc:
                self._redis_failed(exc)
                await asyncio.sleep(self._lease_s / 3)
                continue
            self.writer = self._in_term = True
            # A term of its own each time: claimants whose rows an earlier term may have
            # popped (and lost) take them back when the term changes.
            self._term = f"{self.gateway_id}:{lease.fence}".encode()
            self._last_pop_key = self._last_pop_prefix + self._term
            self._resign = False
            self._failures = 0
            log.info("shared writes: this gateway writes for the fleet (fence %s)", lease.fence)
            try:
                await self._drain(lease)
            except (RedisError, OSError) as exc:
                self._redis_failed(exc)
                await asyncio.sleep(0.2)
            finally:
                self.writer = False
                if self._resign:
                    self._rest_until = self._loop.time() + _REST_LEASES * self._lease_s
                    log.warning(
                        "shared writes: this gateway's statements fail, so it gives up "
                        "writing for the fleet; the others write their own rows or elect "
                        "another writer"
                    )
                if not lease.lost.is_set():
                    try:
                        await asyncio.wait_for(lease.release(), 1)
                    except Exception:  # the lease expires on its own
                        log.debug("could not release the writer lease", exc_info=True)
                if self._usable():
                    try:
                        # The term ends now, not a writer lease later, and the gateways
                        # hear it: claimants waiting for it take their rows back and
                        # candidates stand at once (before, with no other writer, they
                        # waited out the term's key). Its last pop's copy, which holds
                        # values in clear, goes with it.
                        await asyncio.wait_for(
                            run_script(
                                self._client,
                                _END_TERM,
                                [self._term_key, self._last_pop_key],
                                [self._term, self._fleet_channel],
                            ),
                            1,
                        )
                    except Exception:  # they expire on their own
                        log.debug("could not end the writer's term", exc_info=True)
                self._in_term = False

    async def _drain(self, lease: Lock) -> None:
        """Pop and write while the lease is held; a fleet of one drains what is left."""
        self._draining = True
        try:
            await self._drain_loop(lease)
        finally:
            self._draining = False
            self._flush_own()

    async def _drain_loop(self, lease: Lock) -> None:
        while (
            not lease.lost.is_set()
            and not self._stopping
            and not self._resign
            and self._usable()
            and not self._abandoned
        ):
            await self._statements.acquire()  # a slot, before popping rows for it
            self._popping = True
            try:
                rows, held = await self._pop()
            except BaseException:
                self._statements.release()
                raise
            finally:
                self._popping = False
            # The writer's own winners fill the statement up to a batch (the rest, the next).
            room = max(0, self._batch_rows - len(rows))
            own, self._own = self._own[:room], self._own[room:]
            if rows or own:
                self._writing += 1  # now, so that stop() waits for it
                self._spawn(self._write_in_slot(rows, held, own))
            else:
                self._statements.release()
                if not self.active:
                    return  # nothing left, and no fleet to write for

    async def _write_in_slot(self, rows: list[bytes], held: str, own: list[Flight]) -> None:
        try:
            await self._write(rows, held, own)
        except (RedisError, OSError) as exc:
            self._redis_failed(exc)
        finally:
            self._writing -= 1
            self._statements.release()
            self._ended.set()

    async def _pop(self) -> tuple[list[bytes], str]:
        """One statement's worth of queued rows, and whether the pop holds each one's
        lease (``"1"``/``"0"`` per row): wait for some; while another statement is in
        flight, let them gather in the queue until it ends (looking every four
        ``linger_s`` for half a statement's worth). Rows once popped are kept whatever
        fails later: the statement writes them, or answers."""
        # A held row's statement must end inside the hold (a lease): stop lingering
        # while a statement's bound (the write budget) is still left of it.
        started = self._loop.time()
        last_linger = started + self._lease_s - self._write_budget_s
        # Popping while another statement is in flight means the fleet is busy: then a
        # small statement keeps topping up a little after that one ends, so that
        # statements stay few (PostgreSQL's transactions) once the other ends sooner.
        busy = self._writing > 0
        if busy:
            await self._behind(last_linger)
        rows, held = await self._take(self._batch_rows)
        try:
            while not rows and not self._own and self._own_claims and not self._stopping:
                # Own winners on their way: wait for them, not on the queue.
                await asyncio.sleep(self._linger_s)
                rows, held = await self._take(self._batch_rows)
            if not rows and not self._own:
                self._blocking = True
                try:
                    got: Any = await self._blocking_pop()
                finally:
                    self._blocking = False
                self._stats.redis_round_trips += 1
                if not got:
                    return [], ""
                rows, held = [got[1]], "0"  # not held, unless the next pop holds it
                more, held = await self._take(self._batch_rows - 1, got[1])
                rows += more
            while (
                len(rows) + len(self._own) < self._fill
                and not self._stopping
                and self._loop.time() < last_linger
                and (
                    self._writing
                    or (
                        busy
                        and len(rows) + len(self._own) < self._small
                        and self._loop.time() - started < self._small_wait_s
                    )
                )
            ):
                # Let the statement fill: the fleet's winners keep arriving meanwhile.
                if self._writing:
                    await self._behind(last_linger)
                else:
                    await asyncio.sleep(self._linger_s)
                more, flags = await self._take(self._batch_rows - len(rows))
                rows += more
                held += flags
        except (RedisError, OSError) as exc:
            if not rows:
                raise
            self._redis_failed(exc)
        return rows, held

    async def _behind(self, last: float) -> None:
        """Wait while another statement is in flight: until it ends, for four
        ``linger_s`` at most (the pop then looks whether half a statement waits), or
        until ``last`` (loop time), whichever comes first."""
        self._ended.clear()
        wait = min(4 * self._linger_s, last - self._loop.time())
        if wait > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._ended.wait()

    async def _blocking_pop(self) -> Any:
        """``BLPOP`` of the queue (up to ``_POP_BLOCK_S``), never sent twice: a pool's
        retry after a lost answer would pop another row and leave the first, off the
        queue and not held, to its claimant's deadline. Failing instead, it ends this
        term, and the claimant takes the row back and writes it at once."""
        pool = self._client.connection_pool
        conn = await pool.get_connection()  # type: ignore[no-untyped-call]  # unannotated
        try:
            await conn.send_command("BLPOP", self._queue_key, _POP_BLOCK_S)
            return await conn.read_response()
        except BaseException:
            await conn.disconnect(nowait=True)  # an unread answer must not reach another use
            raise
        finally:
            await pool.release(conn)

    async def _take(self, count: int, popped: bytes | None = None) -> tuple[list[bytes], str]:
        """Up to ``count`` rows off the queue, holding the lease of each (and of
        ``popped``, a row a blocking pop took): the rows, and a flag per row (``popped``
        first) that says whether its lease is now held. Sent again after a lost answer,
        the same pop returns the same rows (see :data:`POP`)."""
        keys = [self._queue_key, self._term_key, self._last_pop_key]
        args = [
            count,
            self._term,
            int(self._writer_lease_s * 1000),
            self._lease_ms,
            self._wire.key_prefix,
            b"%s#%d" % (self._term, next(self._pops)),
            *(() if popped is None else (popped,)),
        ]
        # The pop is safe to send again (the script answers a pop id it has seen from its
        # copy): the shared connection does so after a connection error, and this after
        # a timeout, so that rows whose answer was lost are not left held by this term.
        try:
            (taken, held), trips = await run_script(self._client, _POP, keys, args)
        except RedisTimeoutError:
            (taken, held), trips = await run_script(self._client, _POP, keys, args)
            trips += 1
        self._stats.redis_round_trips += trips
        return list(taken), held.decode() if isinstance(held, bytes) else str(held)

    async def _write(self, raw: list[bytes], held: str, own: list[Flight]) -> None:
        """Check the popped rows (``held``: whether the pop holds each one's lease), write
        them and this writer's ``own`` winners in one sorted statement, then each
        claimant's word and the markers (one round trip); its own callers are answered
        as soon as the statement is committed, as a per-process write answers them."""
        words: _Words = {}
        word = functools.partial(_word, words)
        chosen: dict[bytes, QueuedRow] = {}
        give_back: list[tuple[bytes, str]] = []  # holds taken for rows not written
        for item, flag in zip(raw, held, strict=True):
            try:
                q = self._wire.read_row(item)
            except BadMessage as exc:
                self._bad(str(exc))
                if flag == "1" and exc.lease is not None:
                    give_back.append(exc.lease)
                if exc.reply_to is not None:  # a genuine claim this writer cannot write
                    gateway, nonce, key = exc.reply_to
                    word(gateway, "r", nonce, key)
                continue
            if flag == "1" and q.key not in chosen:
                chosen[q.key] = q
            else:  # its lease is gone or another's, or a second row of one key
                word(q.gateway, "r", q.nonce, q.key)
        # Own winners whose claim's lease is still long enough for a statement (the
        # others, and a second flight of a key the queue brought, are written here: the
        # write stage claims them again first).
        now, limit = self._loop.time(), self._lease_s - self._write_budget_s
        mine: list[Flight] = []
        here: list[Flight] = []
        for f in own:
            if not f.done:
                fresh = now - f.claimed_at <= limit and f.key not in chosen
                (mine if fresh else here).append(f)
        if self._resign or self._stopping:  # given up meanwhile: hand them back
            give_back += ((q.key, q.token) for q in chosen.values())
            for q in chosen.values():
                word(q.gateway, "r", q.nonce, q.key)
            chosen, mine, here = {}, [], here + mine
        if here:
            self._write_here(here)
        try:
            await self._write_statement(words, give_back, list(chosen.values()), mine)
        except BaseException:
            # Own winners this statement did not answer (a failure before it, or the
            # end of the engine) are written here, like rows whose writer says "r".
            self._write_here([f for f in mine if not f.done])
            raise

    async def _write_statement(
        self,
        words: _Words,
        give_back: list[tuple[bytes, str]],
        entries: list[QueuedRow],
        mine: list[Flight],
    ) -> None:
        """:meth:`_write` once the rows are checked: ``entries`` (popped, held) and
        ``mine`` (own winners) in one statement, then the words and the markers; the rows
        ``give_back`` names are queued again first. Own winners are answered here, or
        (statement failed) handed to the write stage."""
        word = functools.partial(_word, words)
        if give_back:  # queued again first, so that their claimants may take them back
            await self._give_back(give_back)
        if not entries and not mine:
            await self._publish(words)
            return
        rows = [q.row for q in entries]
        rows += (f.row() for f in mine)
        rows.sort(key=row_order)  # unsorted concurrent multi-row upserts deadlock
        stats = self._stats
        stats.db_statements += 1
        stats.db_rows_sent += len(rows)
        stats.shared_statements += 1
        try:
            inserted = await write_rows(self._sink, rows, self._write_timeout_s, self._abandoned)
        except Exception as exc:
            stats.db_errors += 1
            self._failures += 1
            if isinstance(exc, TimeoutError) or self._failures >= _MAX_FAILURES:
                self._resign = True
            # The reason stays in this gateway's log: other services' callers get only
            # "write it yourself", never this database's error text.
            log.warning(
                "shared writes: a statement of %d rows failed (%s); their claimants write them",
                len(rows),
                type(exc).__name__,
            )
            # Queued again, so that their claimants can take them back and write them.
            await self._give_back([(q.key, q.token) for q in entries])
            for q in entries:
                word(q.gateway, "r", q.nonce, q.key)
            await self._publish(words)
            if mine:  # written here, as a claimant told "r" writes its rows
                self._write_here(mine)
            return
        self._failures = 0
        for q in entries:
            letter = "i" if (q.row.kind, q.row.digest) in inserted else "e"
            word(q.gateway, letter, q.nonce, q.key)
        resolve = self._flights.resolve
        stats.shared_rows_own += len(mine)
        for f in mine:
            if (f.kind, f.digest) in inserted:
                stats.write += 1
                resolve(f, "write")
            else:
                stats.db += 1
                resolve(f, "db")
        # Callers are answered once the rows are committed, every gateway's local tier
        # learns the values, and the markers are set: all in one round trip, since the
        # next statement waits for this one's slot.
        try:
            await self._claims.commit_after(
                self._publishes(words, rows), [q.key for q in entries] + [f.key for f in mine]
            )
        except (RedisError, OSError) as exc:
            stats.redis_errors += 1
            self._redis_failed(exc)
            log.warning("could not answer and mark %d saved values in Redis: %s", len(rows), exc)

    async def _give_back(self, leases: list[tuple[bytes, str]]) -> None:
        """Queue again the rows whose leases (key, queued token) this term holds, for
        their claimants to take back."""
        _, trips = await run_script(
            self._client,
            _UNHOLD,
            [key for key, _ in leases],
            [self._lease_ms, self._term, *(token for _, token in leases)],
        )
        self._stats.redis_round_trips += trips

    async def _publish(self, words: _Words) -> None:
        """Each claimant's word on its channel, in one round trip (no rows committed)."""
        commands = self._publishes(words)
        if not commands:
            return
        _, trips = await run_together(self._client, [], commands)
        self._stats.redis_round_trips += trips

    def announce(self, written: list[Flight]) -> list[tuple[str, str, bytes]]:
        """The ``PUBLISH`` of ``written``'s values on the sink's saved-values channel, for
        the other gateways' local tiers (and their saves of them that find them busy),
        as the writer publishes its statements': rows this gateway's own write stage
        committed while it shares writes (its claimant writes, told ``r`` or too near
        its deadline to queue). None outside a fleet: no one would hear it."""
        if not written or not self.active:
            return []
        return [("PUBLISH", self._saved_channel, self._wire.saved([f.row() for f in written]))]

    def _publishes(
        self, words: _Words, saved: list[Row] | None = None
    ) -> list[tuple[str, str, bytes]]:
        """The ``PUBLISH`` commands of each claimant's word on its channel and, when rows
        were committed, of their values on the sink's one saved-values channel (sent
        whether or not this gateway learns: the others may)."""
        prefix, answer = self._channels, self._wire.answer
        commands = [("PUBLISH", prefix + gw, answer(gw, word)) for gw, word in words.items()]
        if saved:
            commands.append(("PUBLISH", self._saved_channel, self._wire.saved(saved)))
        return commands


def _word(words: _Words, gateway: str, letter: str, nonce: int, key: bytes) -> None:
    words.setdefault(gateway, {}).setdefault(letter, []).extend((key.hex(), nonce))
