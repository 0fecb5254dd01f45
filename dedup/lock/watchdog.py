"""The watchdog of a :class:`dedup.lock.Lock`: it renews a held lease.

:class:`Watchdog` is a timer until the first renewal is due (most holds end before,
costing only that timer), then a task running :func:`renew_while_held`; it is stopped
on release and when the task that holds the lock ends. The loop ends by itself,
reporting the lock lost, when a renewal finds another token, when renewals keep
failing until the lease's end, or after the cap.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from dedup._redis.script import Script
from dedup.lock.batch import call_script
from dedup.lock.scripts import REACQUIRE

__all__ = ["Watchdog", "renew_while_held"]

_REACQUIRE = Script(REACQUIRE)


class Watchdog:
    """The watchdog of one Lock's holds: :meth:`arm` at a grant, :meth:`stop` when the
    hold ends."""

    __slots__ = ("_holder_callback", "_task", "_timer")

    def __init__(self) -> None:
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._holder_callback: tuple[asyncio.Task[Any], Callable[[asyncio.Task[Any]], None]] | None
        self._holder_callback = None

    def arm(
        self, due: float, held: Callable[[], bool], renew: Callable[[], Coroutine[Any, Any, None]]
    ) -> None:
        """Start ``renew()`` at ``due`` (loop time) in a task of its own, unless the hold
        is over by then (``held()`` is false, or the current task, which holds the lock,
        has ended); that task is cancelled when the holding task ends."""
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(due, self._start, held, renew, asyncio.current_task())

    def _start(
        self,
        held: Callable[[], bool],
        renew: Callable[[], Coroutine[Any, Any, None]],
        holder: asyncio.Task[Any] | None,
    ) -> None:
        """The first renewal is due: start renewing, unless the hold is over."""
        self._timer = None
        if not held() or (holder is not None and holder.done()):
            return  # released, or the holding task ended: the lease runs out
        watchdog = asyncio.ensure_future(renew())
        self._task = watchdog
        if holder is not None:

            def holder_done(_: asyncio.Task[Any]) -> None:
                watchdog.cancel()

            holder.add_done_callback(holder_done)
            self._holder_callback = (holder, holder_done)

    def stop(self) -> None:
        """Stop renewing (or never start): the hold is over, or will end with its lease."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._holder_callback is not None:
            # A long-lived holder task (a server's main loop, say) would otherwise
            # collect one callback per hold.
            holder, callback = self._holder_callback
            holder.remove_done_callback(callback)
            self._holder_callback = None


async def renew_while_held(
    redis: Redis | RedisCluster,
    key: bytes,
    token: bytes,
    *,
    lease_s: float,
    lease_ms: int,
    granted_at: float,
    cap_s: float | None,
    lost: Callable[[], None],
    name: Callable[[], str],
    log: logging.Logger,
) -> None:
    """Renew ``token``'s lease of ``key`` now and then every third of the lease
    (``lease_s``, sent as ``lease_ms``); on failure retry sooner until the lease is
    over; ``cap_s`` after ``granted_at`` (loop time), let the lease run out. Ends by
    calling ``lost`` unless cancelled (release, or the holding task ended). Failed
    renewals are logged on ``log`` (at debug level) with the lock's ``name()``."""
    loop = asyncio.get_running_loop()
    lease_end = granted_at + lease_s
    cap_end = None if cap_s is None else granted_at + cap_s
    delay = 0.0  # started when the first renewal is due
    while True:
        if delay:
            await asyncio.sleep(delay)
        sent = loop.time()
        if cap_end is not None and sent >= cap_end:
            break
        # Bounded by the lease: a renewal that hangs (a partition, and redis-py's
        # default of no socket timeout) must not hold ``lost`` back past the
        # lease's end. Not shielded: the call is dropped (its write's connection
        # closed if no other call shares it), and a renewal that reaches Redis
        # anyway only lengthens a hold that this token can still release.
        bound = asyncio.timeout_at(lease_end)
        try:
            async with bound:
                renewed = await call_script(redis, _REACQUIRE, [key], [token, lease_ms])
        except (RedisError, OSError) as exc:  # OSError: TimeoutError included
            log.debug("lock %r: renewal failed: %r", name(), exc)
            renewed = None
        if renewed == 1:
            lease_end = sent + lease_s
            delay = lease_s / 3
            continue
        if renewed == 0 or bound.expired() or loop.time() >= lease_end:
            lost()
            return
        delay = min(lease_s / 12, max(0.0, lease_end - loop.time()))
    await asyncio.sleep(max(0.0, lease_end - loop.time()))
    lost()
