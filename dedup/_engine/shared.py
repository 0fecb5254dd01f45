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

This module holds the claimant's side (queueing rows, waiting for the writer's word,
taking rows back) and the fleet's heartbeat and channels; :mod:`.shared_writer` the
writer's side, :mod:`.shared_state` what both keep, :mod:`.shared_wire` the messages and
:mod:`.shared_scripts` the Lua.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Container
from typing import Any

from redis.exceptions import RedisError

from dedup._engine.flights import Flight
from dedup._engine.shared_scripts import ENQUEUE, HEARTBEAT, LEAVE, RENEW, TAKE_BACK
from dedup._engine.shared_state import IDLE_S, Queued
from dedup._engine.shared_wire import BadMessage
from dedup._engine.shared_writer import _POP as _POP
from dedup._engine.shared_writer import SharedWriter
from dedup._redis.mux import Mux
from dedup._redis.script import Script, ScriptCall, run_script

__all__ = ["Enqueue", "SharedWrites"]

# Also named here, where they were defined before the writer's side and the state had
# modules of their own (the tests import them from here).
_Queued = Queued

_HEARTBEAT, _LEAVE, _ENQUEUE = Script(HEARTBEAT), Script(LEAVE), Script(ENQUEUE)
_RENEW, _TAKE_BACK = Script(RENEW), Script(TAKE_BACK)
_HEARTBEAT_S = 1.0
_ANSWER_GRACE_S = 0.25
"""How long a claimant that finds its queued row's lease gone waits for the writer's word
before claiming the value afresh (the word is published before the lease goes)."""
_ENDED = b""
"""The term of a row held by a writer whose term ended: never the current one."""


class Enqueue:
    """The rows of one claim batch prepared for the writer's queue: their waits and the
    script call that queues them (see :meth:`SharedWrites.prepare`)."""

    __slots__ = ("call", "entries")

    def __init__(self, entries: list[Queued], call: ScriptCall) -> None:
        self.entries = entries
        self.call = call


class SharedWrites(SharedWriter):
    """The shared write queue of one Gateway: its writer candidate (the writer's side, in
    :class:`dedup._engine.shared_writer.SharedWriter`), heartbeat and listener.

    ``mode`` is ``"auto"``, ``"on"`` or ``"off"``; ``sink`` names the sink's
    identity digest (:func:`dedup._engine.shared_wire.sink_id`). :meth:`prepare`
    and :meth:`settle` queue the rows of the values a claim wins, in the claim's round
    trip; :attr:`active` says whether claims should use it now.
    """

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
        soon = self._loop.time() + self._write_budget_s + IDLE_S
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
        entries = [Queued(f, n, t, None) for f, n, t in zip(queued, nonces, tokens, strict=True)]
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

    def _forget(self, e: Queued) -> None:
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
        # The local tier's invalidations ride on this subscription: what it learns from
        # the saved values and what it must forget then come in one ordered stream.
        invalidations = self._invalidations
        if invalidations is not None:
            channels += invalidations.channels

        def heard(channel: bytes, data: bytes) -> None:
            if invalidations is not None and invalidations.heard(channel, data):
                return
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
                await asyncio.sleep(IDLE_S)
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
                if self._invalidations is not None:
                    self._invalidations.lost()

    async def _listen_on(
        self, mux: Mux, channels: list[str], heard: Callable[[bytes, bytes], None]
    ) -> None:
        """Listen on a subscription of the client's own (each message read and handled in
        the connection's callback: a tenth of the CPU of redis-py's ``PubSub``) until the
        circuit opens or the connection is lost."""
        subscription = await mux.subscribe(channels, heard)
        try:
            self._listening = True
            if self._invalidations is not None:
                self._invalidations.subscribed()
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
            confirmed = 0
            while self._usable():
                message = await pubsub.get_message(timeout=1)
                if message is None:
                    continue
                if message["type"] == "message":
                    heard(message["channel"], message["data"])
                elif message["type"] == "subscribe":
                    confirmed += 1
                    if confirmed == len(channels) and self._invalidations is not None:
                        self._invalidations.subscribed()
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
                await asyncio.sleep(IDLE_S)
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
