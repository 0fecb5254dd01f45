"""Waking lock waiters on release: one subscription per connection pool and event loop.

Every release of a :class:`dedup.lock.Lock` publishes the lock's name on
:data:`RELEASE_CHANNEL`; each client (connection pool) holds one subscription for
all its waiters, whatever the lock, and a message wakes one waiter of that lock.
Waiters fall back to polling when the subscription is not (yet) there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster

__all__ = ["READY_TIMEOUT_S", "RELEASE_CHANNEL", "ReleaseListener", "Waiter", "listener_for"]

logger = logging.getLogger("dedup.lock")

RELEASE_CHANNEL = b"dedup:lock:released"
"""The one channel on which every release publishes the name of the lock it freed."""

# How often the subscription's reader looks up from the socket, and how long it
# stays subscribed without waiters (so that a burst of short waits shares one).
_LISTEN_POLL_S = 0.25
_LINGER_S = 2.0
# How long a first waiter waits for the subscription to be confirmed before it
# falls back to polling.
READY_TIMEOUT_S = 1.0


class Waiter:
    """One waiting acquire: its flag is set by a release signal and consumed by wait()."""

    __slots__ = ("event", "key")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.event = asyncio.Event()

    async def wait(self, timeout_s: float) -> None:
        if timeout_s > 0 and not self.event.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self.event.wait()
        # Consumed before the next attempt: a signal arriving during that attempt
        # sets it again, so it is never lost.
        self.event.clear()


class ReleaseListener:
    """One subscription to :data:`RELEASE_CHANNEL` per connection pool and event loop,
    shared by every waiter of that client whatever the lock.

    A release message wakes one waiter of that lock in this process (the longest
    waiting one), not all of them: the others would only lose the race again.
    The reader task ends itself after ``_LINGER_S`` without waiters, when the
    connection fails (waiters fall back to polling; the next wait subscribes
    again), or when the loop shuts down; it always closes its PubSub.
    """

    def __init__(self, client: Redis, pool: ConnectionPool) -> None:
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self.subscribed = False
        self._pool = pool
        self._pubsub = client.pubsub()
        self._waiters: dict[bytes, list[Waiter]] = {}
        self._count = 0
        self._settled = asyncio.Event()  # subscribed, or dead
        self._task = self.loop.create_task(self._run(), name="dedup-lock-release-listener")

    async def register(self, key: bytes, ready_timeout_s: float) -> Waiter:
        """A new waiter for ``key``; waits (bounded) until the subscription is confirmed."""
        waiter = Waiter(key)
        self._waiters.setdefault(key, []).append(waiter)
        self._count += 1
        if not self._settled.is_set() and ready_timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ready_timeout_s):
                    await self._settled.wait()
        return waiter

    def others(self, waiter: Waiter) -> bool:
        """True if other waiters of ``waiter``'s lock wait here."""
        return len(self._waiters.get(waiter.key, ())) > 1

    def unregister(self, waiter: Waiter, *, handoff: bool) -> None:
        """Forget ``waiter``; with ``handoff``, pass an unconsumed signal to the next one."""
        waiters = self._waiters.get(waiter.key)
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            self._count -= 1
            if not waiters:
                del self._waiters[waiter.key]
        if handoff and waiter.event.is_set():
            self._wake(waiter.key)

    def _wake(self, key: bytes) -> None:
        for waiter in self._waiters.get(key, ()):
            if not waiter.event.is_set():
                waiter.event.set()
                return

    async def _run(self) -> None:
        idle_since: float | None = None
        try:
            await self._pubsub.subscribe(RELEASE_CHANNEL)
            while True:
                message = await self._pubsub.get_message(timeout=_LISTEN_POLL_S)
                if message is not None:
                    if message["type"] == "subscribe":
                        self.subscribed = True
                        self._settled.set()
                    elif message["type"] == "message":
                        data = message["data"]
                        self._wake(data.encode() if isinstance(data, str) else data)
                if self._count:
                    idle_since = None
                elif idle_since is None:
                    idle_since = self.loop.time()
                elif self.loop.time() - idle_since >= _LINGER_S:
                    return
        except Exception as exc:  # the connection failed: waiters poll meanwhile
            logger.debug("lock release listener stopped: %r", exc)
        finally:
            self.closed = True
            self.subscribed = False
            self._settled.set()
            if _LISTENERS.get(self._pool) is self:
                del _LISTENERS[self._pool]
            for waiters in self._waiters.values():
                for waiter in waiters:
                    waiter.event.set()  # try once more now, then poll
            try:
                # redis-py leaves PubSub.aclose unannotated.
                await self._pubsub.aclose()  # type: ignore[no-untyped-call]
            except Exception as exc:  # closing a failed connection: nothing to keep
                logger.debug("closing the lock release listener failed: %r", exc)


_LISTENERS: weakref.WeakKeyDictionary[ConnectionPool, ReleaseListener] = weakref.WeakKeyDictionary()


def listener_for(client: Redis | RedisCluster, *, create: bool) -> ReleaseListener | None:
    """The live release listener of ``client``'s pool on this loop (made if ``create``).

    None for Redis Cluster clients, which wait by polling.
    """
    if not isinstance(client, Redis):
        return None
    pool = client.connection_pool
    listener = _LISTENERS.get(pool)
    loop = asyncio.get_running_loop()
    if listener is not None and (listener.closed or listener.loop is not loop):
        listener = None
    if listener is None and create:
        listener = ReleaseListener(client, pool)
        _LISTENERS[pool] = listener
    return listener
