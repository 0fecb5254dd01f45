"""Locks on Redis: a drop-in for redis-py's asyncio ``Lock``, with what it lacks.

:class:`Lock` takes the constructor arguments and has the methods of
:class:`redis.asyncio.lock.Lock` (it is a subclass, so ``redis.lock(name,
lock_class=Lock)`` works and type-checks), keeps the key a plain string holding
the token, and raises redis-py's ``LockError`` / ``LockNotOwnedError`` (as
:class:`dedup.errors.LockError` / :class:`dedup.errors.LockNotOwned`). On top:

* the token belongs to the Lock object, never to thread-local storage, which every
  asyncio task of a thread shares anyway;
* a cancelled ``acquire()`` or ``release()`` never leaves the lock held forever and
  never forgets a token that still holds it (the server call is shielded and its
  outcome is settled when it arrives);
* ``watchdog=True``: the lease is renewed every third of ``timeout`` while the
  holding task lives (until the first renewal is due it is only a timer); it
  stops on release, when that task ends, after ``watchdog_cap_s``, or when a
  renewal fails (or is not answered by the lease's end), and ``lock.lost`` is then
  set;
* ``reentrant=True``: the same task may acquire again, through this object or any
  other Lock of the same name; the key is then a hash ``owner, count, fence`` and
  the lock is free when the count is back to zero;
* ``lock.fence``: a number strictly greater than every fence handed out before for
  this name, for the protected resource to reject a late writer with
  :func:`check_fence` (PostgreSQL) or :func:`fenced_set` (Redis);
* waiting without hammering Redis: blocked acquires of one name on one client queue
  in the process, one of them trying on the server, and a release through that
  client hands the lock to it in one script; a waiter's failed attempt flags the
  lock, and a release that finds the flag publishes the lock's name on one channel;
  each client (connection pool) holds one subscription for all its waiters, and a
  waiter also wakes when the holder's lease runs out; polling every ``sleep``
  (jittered) stays as the fallback;
* the lock calls that tasks make on one client in the same turn of the event loop
  share one write and one read (:mod:`dedup.lock.batch`).

Fences: an ``INCR`` of ``<name>:fence`` inside the acquire script; a missing
counter starts from the server time in microseconds and lives ``fence_memory_s``
(no key per name lives forever): the clock keeps fences growing after that key
expired or Redis restarted empty, the counter keeps them growing if the server's
clock steps back by less than that memory. Every script runs on Redis 6.0.

:class:`Redlock` (multi-master) lives in :mod:`dedup.lock.redlock`, the fence helpers in
:mod:`dedup.lock.fence`, the release listener in :mod:`dedup.lock.release`, the handover
to a waiter of the same client in :mod:`dedup.lock.handover`, the watchdog in
:mod:`dedup.lock.watchdog` and the tokens in :mod:`dedup.lock.tokens`; the package
:mod:`dedup.lock` re-exports the public names. Bad options raise
:class:`dedup.errors.ConfigError` (also a ``ValueError``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
from collections.abc import Coroutine, Sequence
from types import SimpleNamespace, TracebackType
from typing import Any, Literal, Self

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.lock import Lock as RedisLock
from redis.exceptions import ConnectionError
from redis.exceptions import LockError as RedisLockError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dedup._redis.script import Script
from dedup.errors import ConfigError
from dedup.lock.batch import call_script
from dedup.lock.errors import LockError, LockNotOwned
from dedup.lock.fence import (
    fence_key,
    sibling_key,
)
from dedup.lock.gate import Contender, forget_gate, gate_for
from dedup.lock.handover import hand_over
from dedup.lock.release import (
    READY_TIMEOUT_S,
    RELEASE_CHANNEL,
    ReleaseListener,
    Waiter,
    listener_for,
)
from dedup.lock.scripts import (
    ACQUIRE,
    ACQUIRE_REENTRANT,
    EXTEND,
    OWNER,
    REACQUIRE,
    RELEASE,
    RELEASE_PLAIN,
)
from dedup.lock.tokens import new_token, task_token
from dedup.lock.watchdog import Watchdog, renew_while_held

__all__ = ["DEFAULT_FENCE_MEMORY_S", "Lock"]

logger = logging.getLogger(__name__)

DEFAULT_FENCE_MEMORY_S = 60.0
"""How long a name's fence counter lives after the grant that started it; the next
grant after that starts it again from the server clock."""

_ACQUIRE, _ACQUIRE_REENTRANT = Script(ACQUIRE), Script(ACQUIRE_REENTRANT)
_RELEASE, _RELEASE_PLAIN = Script(RELEASE), Script(RELEASE_PLAIN)
_EXTEND, _REACQUIRE = Script(EXTEND), Script(REACQUIRE)
_OWNER = Script(OWNER)


# ------------------------------------------------------------------------------ gate

# Handovers in a row within one process before the holder yields to waiters of other
# clients (when one flagged itself): a bound on how long other processes wait. 16: on one
# hot name (bench/lock_bench.py --names 1 --streaks 1,4,64,256,1024, 4 processes x 4
# tasks) 1 and 4 gave 0.4-0.5x redis-py's acquisitions/s, 16 about 1.0-1.2x with the
# longest wait a tenth of redis-py's; longer streaks add some rate but lengthen the
# longest wait (64: 0.5 s; 256 and up: 2-3 s, tasks starving), and only those bring the
# p99 near redis-py's (docs/locks.md, "The hot name's p99"). The count travels with the
# hold (a handover's grant carries it to the Lock that takes it), not with the queue of
# waiters, which is forgotten whenever it is empty: two tasks taking turns empty it at
# every handover. Read here at each handover (bench/lock_bench.py sets it on this module).
_HANDOVER_STREAK = 16

# Errors after which a call's answer may be lost with the call run: never sent again
# (dedup.lock.batch), so a waiter gives back what it may have won, then waits on.
_LOST_ANSWER = (ConnectionError, RedisTimeoutError, OSError)

# How long a contender whose client's holder yielded waits before trying again: enough
# for other clients' waiters, woken by the yield's signal, to take the lock first (a
# switch between processes took 0.55-0.68 ms at the median, 1.8-3.7 ms at p99 in the
# instrumented bench runs of docs/locks.md); short, since the flag that made the holder
# yield may have been its own client's, and then nobody else comes.
_YIELD_GRACE_S = 0.01


# ------------------------------------------------------------------------------ Lock


class Lock(RedisLock):
    """A lock on one Redis, a drop-in for :class:`redis.asyncio.lock.Lock`.

    The positional and keyword arguments are redis-py's: ``redis``, ``name``,
    ``timeout`` (lease in seconds, None: none), ``sleep`` (the longest wait between
    attempts), ``blocking``, ``blocking_timeout``, ``thread_local`` (accepted and
    ignored: the token always belongs to this object) and
    ``raise_on_release_error``. The keyword-only arguments add:

    * ``watchdog``: renew the lease (``timeout``, required) every third of it
      while the task that acquired it lives;
    * ``watchdog_cap_s``: stop renewing this long after the grant (None: never);
    * ``reentrant``: the same task may acquire again (a hash of counts);
    * ``fence_memory_s``: how long the last fence of this name is remembered;
    * ``release_signal``: wake waiters on release (False: poll only).

    After a successful acquire, ``fence`` is the grant's fencing token and
    ``lost`` (an :class:`asyncio.Event`) is set if the lock is found lost while
    held: a renewal, extension or release found another token, a renewal kept
    failing (or went unanswered) until the lease ended, or the watchdog's cap let
    the lease run out.
    The lease's end is judged by the local clock from before the grant was sent,
    so ``lost`` may come a moment before Redis drops the key, never after.

    Unlike redis-py's, a blocked ``acquire()`` may wait up to the whole
    ``blocking_timeout`` even when ``sleep`` is longer, since a release wakes it.
    """

    # The token lives in a plain namespace, never in thread-local storage.
    local: SimpleNamespace

    def __init__(
        self,
        redis: Redis | RedisCluster,
        name: str | bytes | memoryview,
        timeout: float | None = None,
        sleep: float = 0.1,
        blocking: bool = True,
        blocking_timeout: float | None = None,
        thread_local: bool = True,
        raise_on_release_error: bool = True,
        *,
        watchdog: bool = False,
        watchdog_cap_s: float | None = None,
        reentrant: bool = False,
        fence_memory_s: float = DEFAULT_FENCE_MEMORY_S,
        release_signal: bool = True,
    ) -> None:
        # RedisLock.__init__ is not called: it would put the token in thread-local
        # storage and register its own scripts; every method is overridden here.
        if watchdog and not timeout:
            raise ConfigError("a watchdog needs a timeout: the lease it renews")
        if not fence_memory_s > 0 or not math.isfinite(fence_memory_s):
            raise ConfigError("fence_memory_s must be a positive finite number")
        self.redis = redis
        self.name = name
        self.timeout = timeout
        self.sleep = sleep
        self.blocking = blocking
        self.blocking_timeout = blocking_timeout
        self.thread_local = bool(thread_local)
        self.raise_on_release_error = raise_on_release_error
        self.local = SimpleNamespace(token=None)
        self.watchdog = watchdog
        self.watchdog_cap_s = watchdog_cap_s
        self.reentrant = reentrant
        self.fence_memory_s = fence_memory_s
        self.release_signal = release_signal
        self.fence: int | None = None
        self.lost = asyncio.Event()
        self._key = self._encode(name)
        self._fence_key = fence_key(self._key)
        self._flag_key = sibling_key(self._key, b":waiting")
        self._fence_memory_ms = math.ceil(fence_memory_s * 1000)
        self._release_script = _RELEASE if reentrant else _RELEASE_PLAIN
        # At least 1 ms: 0 means "no expiry" to the scripts.
        self._lease_ms = max(1, int(timeout * 1000)) if timeout else 0
        self._depth = 0  # holds through this object (reentrant: per acquire)
        # The handovers in a row within this client that ended in this object's hold
        # (0: won by its own attempt); the next handover counts on from it.
        self._streak = 0
        self._watchdog = Watchdog()
        self._background: set[asyncio.Future[Any]] = set()

    def register_scripts(self) -> None:
        """Nothing to register: the scripts are called by SHA and loaded on NOSCRIPT."""

    async def settled(self) -> None:
        """Wait until the server calls this object left running have finished: a
        release whose caller was cancelled, or the undoing of a grant that a
        cancelled or failed ``acquire()`` may have received."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    # ---------------------------------------------------------------- helpers
    def _encode(self, value: str | bytes | memoryview) -> bytes:
        if isinstance(value, memoryview):
            return bytes(value)
        if isinstance(value, bytes):
            return value
        # As the client's encoder would, without its untyped API.
        kwargs: dict[str, Any] = {}
        if isinstance(self.redis, Redis):
            kwargs = self.redis.connection_pool.connection_kwargs
        encoding = kwargs.get("encoding", "utf-8")
        return value.encode(encoding, kwargs.get("encoding_errors", "strict"))

    def _lock_name(self) -> str:
        return self._key.decode(errors="replace")

    async def _eval(self, script: Script, keys: Sequence[bytes], args: Sequence[Any]) -> Any:
        return await call_script(self.redis, script, keys, args)

    def _spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> None:
        """Run ``coro`` in the background, keeping a reference; its failure is logged."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                logger.warning("lock %r: %s failed: %r", self._lock_name(), what, t.exception())

        task.add_done_callback(done)

    def _clear(self) -> None:
        self._watchdog.stop()
        self.local.token = None
        self.fence = None
        self._depth = 0

    def _mark_lost(self, token: bytes) -> None:
        if self.local.token == token:
            self.lost.set()

    # ---------------------------------------------------------------- acquire
    async def _try(
        self, token: bytes, waiting: str = "0", *, own_lost: bool = False
    ) -> tuple[bool, int]:
        """One attempt: (True, fence) when granted, else (False, the holder's pttl).
        ``waiting``: "1" = the caller waits for a release if it fails (it flags
        itself), "2" = other waiters of this client wait too (a grant flags them).
        When the answer is lost, a grant it may have carried is given back in the
        background; ``own_lost``: not for a lost answer (:data:`_LOST_ANSWER`), which
        the caller gives back itself before its next attempt."""
        loop = asyncio.get_running_loop()
        sent = loop.time()
        script = _ACQUIRE_REENTRANT if self.reentrant else _ACQUIRE
        keys = [self._key, self._fence_key, self._flag_key]
        args = [token, self._lease_ms, self._fence_memory_ms, waiting]
        # A future, not a task: the call goes on if this caller is cancelled.
        call = call_script(self.redis, script, keys, args)
        try:
            reply = await asyncio.shield(call)
        except asyncio.CancelledError:
            # The attempt goes on without us: give back whatever it is granted.
            if not call.done():
                self._background.add(call)
                call.add_done_callback(self._background.discard)
            call.add_done_callback(lambda fut: self._undo_orphan(token, fut))
            raise
        except BaseException as exc:
            # The answer was lost; the lock may be ours without our knowing.
            if not (own_lost and isinstance(exc, _LOST_ANSWER)):
                self._drop_unknown(token)
            raise
        if reply[0] != 1:
            return False, int(reply[1])
        self._granted(token, int(reply[1]), sent)
        return True, int(reply[1])

    def _undo_orphan(self, token: bytes, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            return
        if fut.exception() is not None:
            self._drop_unknown(token)
        elif fut.result()[0] == 1:
            # Exactly this grant: a new lock is deleted, a re-entry is decremented.
            self._spawn(self._release_call(token), "undo")

    def _drop_unknown(self, token: bytes) -> None:
        """Delete the lock if an attempt whose outcome is unknown got it.

        Only for plain locks with a token of their own: a reentrant owner's count
        cannot be corrected without knowing whether it was incremented (its lease
        bounds the damage), and a token this object holds is not an orphan.
        """
        if not self.reentrant and token != self.local.token:
            self._spawn(self._release_call(token), "cleanup")

    def _hand_over(self, token: bytes) -> asyncio.Future[int] | None:
        """Release by handing the lock to this client's contender for it, if one
        waits (see :func:`dedup.lock.handover.hand_over`); None when nobody here waits
        (nothing sent)."""
        streak = self._streak  # of this hold, which ``token`` is
        return hand_over(
            self.redis,
            [self._key, self._fence_key, self._flag_key],
            token,
            streak=streak,
            yield_turn=streak >= _HANDOVER_STREAK,
            fence_memory_ms=self._fence_memory_ms,
            release=self._release_later,
        )

    def _release_later(self, token: bytes, what: str) -> None:
        """Release ``token`` in the background (``what`` names why, if it fails)."""
        self._spawn(self._release_call(token), what)

    async def _release_call(self, token: bytes) -> int:
        """One release of ``token`` on the server: the holds left, -1 if not held."""
        return int(await self._send_release(token))

    def _send_release(self, token: bytes) -> asyncio.Future[Any]:
        """Send the release script for ``token``: a future of its reply."""
        keys = [self._key, self._flag_key]
        return call_script(self.redis, self._release_script, keys, [token, RELEASE_CHANNEL])

    def _granted(self, token: bytes, fence: int, sent: float, streak: int = 0) -> None:
        """``token`` holds the lock: by this object's own attempt, or handed over
        (``streak``: the handovers in a row this one ends)."""
        if self.reentrant and self._depth > 0 and token == self.local.token:
            self._depth += 1
            return
        # A previous hold through this object that was never released is over.
        self._watchdog.stop()
        self.local.token = token
        self.fence = fence
        self._depth = 1
        self._streak = streak
        self.lost.clear()
        if self.watchdog:
            assert self.timeout  # checked in __init__
            # Nothing else until the first renewal is due: a short hold costs a
            # timer, cancelled by its release.
            self._watchdog.arm(
                sent + self.timeout / 3,
                lambda: self.local.token == token,
                functools.partial(self._watch, token, sent),
            )

    async def do_acquire(self, token: str | bytes) -> bool:
        """One attempt with ``token`` (redis-py's hook); True when granted."""
        got, _ = await self._try(self._encode(token))
        return got

    async def acquire(
        self,
        blocking: bool | None = None,
        blocking_timeout: float | None = None,
        token: str | bytes | None = None,
    ) -> bool:
        """Take the lock; True once held, False if not within ``blocking_timeout``
        (or at once when not ``blocking``).

        ``token``: the value to hold the lock with (default: a random one; a
        reentrant lock uses one per task). While blocked, the attempt is repeated
        when a release of this lock is signalled, when the holder's lease runs out,
        and at the latest every ``sleep`` seconds (jittered by ±50%). Blocked
        acquires of a plain lock on one client queue in the process, one of them
        trying on the server, and a release through the same client hands the lock
        to it directly.
        """
        if token is not None:
            raw = self._encode(token)
        else:
            raw = task_token() if self.reentrant else new_token()
        if blocking is None:
            blocking = self.blocking
        if blocking_timeout is None:
            blocking_timeout = self.blocking_timeout
        if not blocking:
            got, _ = await self._try(raw)
            return got
        loop = asyncio.get_running_loop()
        deadline = None if blocking_timeout is None else loop.time() + blocking_timeout
        if self.reentrant:
            return await self._wait_for_lock(raw, deadline, None, None)
        gate = gate_for(self.redis, self._key, create=True)
        assert gate is not None
        contender = Contender(raw, self._lease_ms, self._key)
        acquired = False
        try:
            held_here = False
            if gate.contender is None:
                gate.contender = contender
            else:
                # In line behind this client's contender: no server call until first.
                contender.promoted = loop.create_future()
                gate.queue.append(contender)
                try:
                    async with asyncio.timeout_at(deadline):
                        held_here = await contender.promoted
                except TimeoutError:
                    return False
            acquired = await self._wait_for_lock(raw, deadline, contender, held_here)
            return acquired
        finally:
            if not acquired and (contender.grant is not None or contender.unsure):
                # Handed the lock while giving up (or perhaps handed it, by a handover
                # whose outcome is unknown): give it back.
                contender.grant = None
                self._spawn(self._release_call(raw), "undo a handover")
            gate.leave(contender, acquired)
            forget_gate(self.redis, self._key, gate)

    def _take_grant(self, contender: Contender | None) -> bool:
        if contender is None or contender.grant is None:
            return False
        fence, sent, streak = contender.grant
        contender.grant = None
        self._granted(contender.token, fence, sent, streak)
        return True

    async def _drop_unsure(self, contender: Contender) -> None:
        """Release the token that a handover, or an attempt of its own, of unknown
        outcome may have given ``contender``, before it tries again: its attempts with
        that token cannot win while the token holds the lock. No attempt of its own is
        in flight (its attempts and this call follow each other), so no hold of its
        own is lost."""
        contender.trying = True  # nobody hands it the lock meanwhile
        try:
            await self._release_call(contender.token)
        finally:
            contender.trying = False
        contender.unsure = False  # only once done: a failure leaves it to acquire()

    async def _wait_for_lock(
        self,
        raw: bytes,
        deadline: float | None,
        contender: Contender | None,
        held_here: bool | None,
    ) -> bool:
        """Try until granted (by an attempt, or handed over to ``contender``) or past
        ``deadline``. ``held_here``: a holder of this client is expected to hand the
        lock over, so wait (up to ``sleep``) before the first attempt."""
        loop = asyncio.get_running_loop()
        listener: ReleaseListener | None = None
        waiter: Waiter | None = None
        acquired = False
        lost_answer = False  # the last attempt's answer was lost: it may have won
        try:
            if self.release_signal:
                # A live subscription costs nothing to join: join before the first
                # attempt so that no release after it goes unnoticed.
                listener = listener_for(self.redis, create=False)
                if listener is not None and listener.subscribed:
                    waiter = await listener.register(self._key, 0)
                else:
                    listener = None
            if contender is not None:
                if waiter is not None:
                    contender.waiter = waiter
                if held_here:
                    delay = self.sleep * random.uniform(0.5, 1.5)
                    if deadline is not None:
                        delay = min(delay, deadline - loop.time())
                    await contender.waiter.wait(delay)
            while True:
                if self._take_grant(contender):
                    acquired = True
                    return True
                if contender is not None and contender.unsure:
                    # Its token may hold the lock unknown to it (a handover's or its own
                    # attempt's answer was lost): given back here, before the next
                    # attempt (a release left running beside it could delete the lock
                    # that attempt wins).
                    try:
                        await self._drop_unsure(contender)
                    except _LOST_ANSWER:
                        if not lost_answer:
                            raise  # a handover's unknown outcome: acquire() gives it back
                        # still unknown after a lost answer: wait, and look again
                    lost_answer = contender.unsure
                acquired, pttl = False, 0
                if not lost_answer:
                    flag = "0"
                    if self.release_signal:
                        others = (
                            listener is not None and waiter is not None and listener.others(waiter)
                        )
                        flag = "2" if others else "1"
                    if contender is not None:
                        contender.trying = True
                    try:
                        acquired, pttl = await self._try(raw, flag, own_lost=True)
                    except _LOST_ANSWER:
                        if contender is None:  # reentrant: no contender, no handover
                            raise  # a count that may or may not have grown: see _drop_unknown
                        # The server went away mid-attempt (a restart, a failover): no
                        # call is sent twice, so a waiter waits on, as after a failed try,
                        # and gives back what the attempt may have won (above, or in
                        # acquire() if it gives up first).
                        contender.unsure = lost_answer = True
                    finally:
                        if contender is not None:
                            contender.trying = False
                if acquired:
                    if contender is not None and contender.grant is not None:
                        # Both: an attempt that found the lock handed over cannot
                        # win, so this cannot happen; keep the grant just in case.
                        contender.grant = None
                    return True
                if self._take_grant(contender):
                    acquired = True
                    return True
                left = math.inf if deadline is None else deadline - loop.time()
                if left <= 0:
                    return False
                if self.release_signal and (listener is None or listener.closed):
                    if listener is not None and waiter is not None:
                        listener.unregister(waiter, handoff=False)
                    listener = listener_for(self.redis, create=True)
                    waiter = None
                    if listener is not None:
                        waiter = await listener.register(self._key, min(READY_TIMEOUT_S, left))
                        if contender is not None:
                            if contender.waiter.event.is_set():
                                waiter.event.set()  # a handover came meanwhile
                            contender.waiter = waiter
                        if listener.subscribed:
                            # A release between the failed attempt and the
                            # subscription sent a signal nobody saw: look again.
                            continue
                delay = self.sleep * random.uniform(0.5, 1.5)
                if pttl > 0:
                    # An expiry publishes nothing: wake when the holder's lease ends.
                    delay = min(delay, pttl / 1000 + random.uniform(0, min(self.sleep, 0.05)))
                if deadline is not None:
                    delay = min(delay, deadline - loop.time())
                if contender is not None:
                    await contender.waiter.wait(delay)
                    if contender.polite and contender.grant is None:
                        contender.polite = False
                        # Other clients' waiters, woken by the same signal, take the
                        # lock within a round trip or two; if none did (the flag
                        # may be this client's own: a contender that found the lock
                        # held here flags it too), try again soon rather than leave
                        # the lock free for a whole ``sleep``.
                        delay = min(self.sleep * random.uniform(0.5, 1.5), _YIELD_GRACE_S)
                        if deadline is not None:
                            delay = min(delay, deadline - loop.time())
                        await contender.waiter.wait(delay)
                elif waiter is not None:
                    await waiter.wait(delay)
                else:
                    await asyncio.sleep(delay)
        finally:
            if listener is not None and waiter is not None:
                listener.unregister(waiter, handoff=not acquired)

    # ---------------------------------------------------------------- release
    async def release(self) -> None:
        """Release the lock (one level of it, for a reentrant lock).

        Raises :class:`~dedup.errors.LockError` when this object does not hold it and
        :class:`~dedup.errors.LockNotOwned` when its token no longer holds it in
        Redis (the token is cleared then). If the call is cancelled, the release
        goes on and settles this object when Redis answers; if it fails (Redis
        unreachable) the token is kept, so that ``release()`` can be called again,
        and the watchdog is stopped already, so that the lease runs out anyway.
        """
        token = self.local.token
        if token is None:
            raise LockError(
                "Cannot release a lock that's not owned or is already unlocked.",
                lock_name=self._lock_name(),
            )
        if self._depth <= 1:
            # First, so that even a release that never reaches Redis ends the hold.
            self._watchdog.stop()
        # A future, not a task: the release goes on and settles this object if the
        # caller is cancelled.
        call = self._release_and_settle(token)
        try:
            await asyncio.shield(call)
        except asyncio.CancelledError:
            if not call.done():
                self._background.add(call)
                call.add_done_callback(self._settled_in_background)
            raise

    def _settled_in_background(self, call: asyncio.Future[Any]) -> None:
        self._background.discard(call)
        if not call.cancelled() and call.exception() is not None:
            logger.warning(
                "lock %r: release after cancellation failed: %r",
                self._lock_name(),
                call.exception(),
            )

    def _release_and_settle(self, token: bytes) -> asyncio.Future[None]:
        """Send the release of ``token`` (a handover if a contender of this client
        waits): a future that settles this object when Redis answers, with
        :class:`~dedup.errors.LockNotOwned` if the token no longer held the lock."""
        settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        call = None if self.reentrant else self._hand_over(token)
        if call is None:
            call = self._send_release(token)

        def answered(call: asyncio.Future[Any]) -> None:
            if call.cancelled():
                settled.cancel()
                return
            try:
                left = int(call.result())
            except Exception as exc:  # an error, or an answer that is not the script's
                settled.set_exception(exc)
                return
            if self.local.token == token:  # unless this object was acquired again meanwhile
                if left < 0:
                    self.lost.set()
                    self._clear()
                else:
                    self._depth -= 1
                    if self._depth <= 0:
                        self._clear()
            if left < 0:
                settled.set_exception(
                    LockNotOwned(
                        "Cannot release a lock that's no longer owned",
                        lock_name=self._lock_name(),
                    )
                )
            else:
                settled.set_result(None)

        call.add_done_callback(answered)
        return settled

    async def do_release(self, expected_token: bytes) -> None:
        """Release with ``expected_token`` (redis-py's hook); raises
        :class:`~dedup.errors.LockNotOwned` if it does not hold the lock."""
        if await self._release_call(expected_token) < 0:
            raise LockNotOwned(
                "Cannot release a lock that's no longer owned", lock_name=self._lock_name()
            )

    # ------------------------------------------------------------ extend etc.
    async def extend(self, additional_time: float, replace_ttl: bool = False) -> Literal[True]:
        """Add ``additional_time`` seconds to the lease (or make it the lease, with
        ``replace_ttl``). Raises :class:`~dedup.errors.LockError` when not held or
        without a timeout, :class:`~dedup.errors.LockNotOwned` when lost."""
        if self.local.token is None:
            raise LockError("Cannot extend an unlocked lock", lock_name=self._lock_name())
        if self.timeout is None:
            raise LockError("Cannot extend a lock with no timeout", lock_name=self._lock_name())
        return await self.do_extend(additional_time, replace_ttl)

    async def do_extend(self, additional_time: float, replace_ttl: bool) -> Literal[True]:
        """The extension itself (redis-py's hook)."""
        token = self.local.token
        args = [token, int(additional_time * 1000), "1" if replace_ttl else "0"]
        if await self._eval(_EXTEND, [self._key], args) != 1:
            self._mark_lost(token)
            raise LockNotOwned(
                "Cannot extend a lock that's no longer owned", lock_name=self._lock_name()
            )
        return True

    async def reacquire(self) -> Literal[True]:
        """Reset the lease to ``timeout``. Raises :class:`~dedup.errors.LockError`
        when not held or without a timeout, :class:`~dedup.errors.LockNotOwned`
        when lost."""
        if self.local.token is None:
            raise LockError("Cannot reacquire an unlocked lock", lock_name=self._lock_name())
        if self.timeout is None:
            raise LockError("Cannot reacquire a lock with no timeout", lock_name=self._lock_name())
        return await self.do_reacquire()

    async def do_reacquire(self) -> Literal[True]:
        """The reset itself (redis-py's hook)."""
        token = self.local.token
        if await self._eval(_REACQUIRE, [self._key], [token, self._lease_ms]) != 1:
            self._mark_lost(token)
            raise LockNotOwned(
                "Cannot reacquire a lock that's no longer owned", lock_name=self._lock_name()
            )
        return True

    async def locked(self) -> bool:
        """True if the lock is held by anyone."""
        return bool(await self.redis.exists(self._key))

    async def owned(self) -> bool:
        """True if this object's token holds the lock now."""
        stored = await self._eval(_OWNER, [self._key], [])
        if isinstance(stored, str):
            stored = self._encode(stored)
        return self.local.token is not None and stored == self.local.token

    # --------------------------------------------------------------- watchdog
    async def _watch(self, token: bytes, granted_at: float) -> None:
        """Renew the lease while held (:func:`dedup.lock.watchdog.renew_while_held`);
        ends by setting ``lost`` unless cancelled (release, or the holding task ended)."""
        assert self.timeout  # checked in __init__
        await renew_while_held(
            self.redis,
            self._key,
            token,
            lease_s=float(self.timeout),
            lease_ms=self._lease_ms,
            granted_at=granted_at,
            cap_s=self.watchdog_cap_s,
            lost=functools.partial(self._mark_lost, token),
            name=self._lock_name,
            log=logger,
        )

    # -------------------------------------------------------- context manager
    async def __aenter__(self) -> Self:
        if await self.acquire():
            return self
        raise LockError(
            "Unable to acquire lock within the time specified", lock_name=self._lock_name()
        )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            await self.release()
        except RedisLockError:  # dedup's lock errors are subclasses
            if self.raise_on_release_error:
                raise
            logger.warning("Lock was unlocked or no longer owned when exiting context manager.")
