"""The writer's side of shared writes (:mod:`dedup._engine.shared`): standing for the
writer lease, popping the fleet's queued rows, writing them (with the writer's own
winners) in one sorted statement, and answering each claimant.

A writer whose statement times out, or fails a few times in a row, hands its rows back
(``r``), gives up the role and rests a while, so a writer cut off from its database
never holds up the fleet. While it writes for the fleet, the values its own claims win
skip the queue and join its next statement.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dedup._engine.flights import Flight
from dedup._engine.shared_scripts import END_TERM, POP, UNHOLD
from dedup._engine.shared_state import IDLE_S, SharedState
from dedup._engine.shared_wire import BadMessage, QueuedRow
from dedup._engine.write_stage import row_order, write_rows
from dedup._redis.script import Script, run_script, run_together
from dedup.lock import Lock
from dedup.types import Row

__all__ = ["SharedWriter"]

log = logging.getLogger("dedup")

_POP, _UNHOLD, _END_TERM = Script(POP), Script(UNHOLD), Script(END_TERM)
_POP_BLOCK_S = 0.1
_MAX_FAILURES = 3
"""Statements in a row a writer may fail before it gives up the role (a timeout: one)."""
_REST_LEASES = 3
"""Leases a writer that gave up the role waits before standing again."""


_Words = dict[str, dict[str, list[Any]]]
"""The writer's words of one statement: per claimant gateway, per letter, the flat list
``[key_hex, nonce, ...]`` of :meth:`Wire.answer`."""


class SharedWriter(SharedState):
    """The writer's side of one Gateway's shared writes: its own winners
    (:meth:`takes_own`, :meth:`own_claim`, :meth:`add_own`), the writer lease and the
    statements, and :meth:`announce`."""

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
                await asyncio.sleep(IDLE_S)
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
