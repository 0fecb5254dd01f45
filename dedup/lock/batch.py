"""Lock scripts sent together: the calls the tasks of one event loop make on one client in
the same turn of the loop share one round trip.

A lock's acquire and release are one ``EVALSHA`` each, and on the client most of their
cost is not the script but redis-py's path around it: the pool's checkout and return,
a send timeout that starts a task, a read timeout, the command's bookkeeping. Tasks of a
process that take and release locks at the same time each paid all of it. Here the
calls made in one turn of the loop are packed into one write on one pooled connection,
and their replies are read in order, each handed to its own caller (an error reply
included), so that a burst of lock calls costs one checkout, one write and one read.
Each script stays atomic on the server; calls of different tasks were concurrent
anyway, so their order among themselves promises nothing, and a task's own calls keep
their order since each waits for its reply.

Only plain ``redis.asyncio.Redis`` clients batch, with redis-py's default UTF-8 encoder:
Redis Cluster clients, single-connection clients and other encodings take redis-py's
own path, one call at a time.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence
from typing import Any

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from dedup._redis.packing import pack
from dedup._redis.script import Script, exchange

__all__ = ["call_script"]


class _Batch:
    """The calls of one pool for one write, on one event loop: collected until its send
    starts (on the loop's next turn), then sent."""

    __slots__ = ("calls", "closed", "loop", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        # (packed EVALSHA, script, the caller's future)
        self.calls: list[tuple[bytes, Script, asyncio.Future[Any]]] = []
        self.closed = False  # takes no more calls
        self.task: asyncio.Task[None] | None = None

    def gone(self, future: asyncio.Future[Any]) -> None:
        """A caller's future is done: when every caller of this batch went away
        (cancelled, as by a timeout), stop waiting for the replies, as a cancelled
        redis-py call would; the connection is closed then."""
        if not future.cancelled() or self.task is None or self.task.done():
            return
        if all(other.done() for _, _, other in self.calls):
            self.closed = True
            self.task.cancel()


_BATCHES: weakref.WeakKeyDictionary[ConnectionPool, _Batch] = weakref.WeakKeyDictionary()
# Sends in flight, kept referenced until they end (a bare task may be collected).
_SENDING: set[asyncio.Task[None]] = set()


def _batches(client: Redis | RedisCluster) -> ConnectionPool | None:
    """``client``'s pool when its calls can share round trips, else None."""
    if not isinstance(client, Redis) or client.connection is not None:
        return None
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    if kwargs.get("encoding", "utf-8") != "utf-8":
        return None
    if kwargs.get("encoding_errors", "strict") != "strict":
        return None
    return pool


def call_script(
    client: Redis | RedisCluster, script: Script, keys: Sequence[bytes], args: Sequence[Any]
) -> asyncio.Future[Any]:
    """Run ``script`` on ``client``: a future of its result (an error reply as the
    exception), sent with the other calls of this turn of the loop on the same pool.

    The future is the caller's alone: cancelling it does not stop the call, which is
    already queued or sent; its outcome is then dropped. Only when every caller of a
    write went away are its replies no longer waited for (its connection is closed)."""
    loop = asyncio.get_running_loop()
    pool = _batches(client)
    packed = None if pool is None else pack(("EVALSHA", script.sha, len(keys), *keys, *args))
    if pool is None or packed is None:
        return asyncio.ensure_future(_one(client, script, keys, args))
    batch = _BATCHES.get(pool)
    if batch is None or batch.loop is not loop or batch.closed:
        batch = _BATCHES[pool] = _Batch(loop)
        # Its first step runs on the loop's next turn: every call made before then
        # goes in the same write.
        batch.task = loop.create_task(_send(pool, batch))
        _SENDING.add(batch.task)
        batch.task.add_done_callback(_SENDING.discard)
    future: asyncio.Future[Any] = loop.create_future()
    batch.calls.append((packed, script, future))
    future.add_done_callback(batch.gone)
    return future


async def _one(
    client: Redis | RedisCluster, script: Script, keys: Sequence[bytes], args: Sequence[Any]
) -> Any:
    result, _ = await script(client, keys, args)
    return result


async def _send(pool: ConnectionPool, batch: _Batch) -> None:
    batch.closed = True
    if _BATCHES.get(pool) is batch:
        del _BATCHES[pool]
    calls = batch.calls
    try:
        await _settle(pool, calls)
    finally:
        batch.calls = []  # nothing of a sent batch is kept


async def _settle(
    pool: ConnectionPool, calls: list[tuple[bytes, Script, asyncio.Future[Any]]]
) -> None:
    try:
        replies = await _exchange(pool, [packed for packed, _, _ in calls])
        missing = [n for n, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            # A restarted or flushed server lost its scripts: load them, and run again
            # only the calls that did not run.
            scripts = {calls[n][1].sha: calls[n][1] for n in missing}
            loads = [pack(("SCRIPT", "LOAD", s.source)) for s in scripts.values()]
            for reply in await _exchange(pool, [load for load in loads if load is not None]):
                if isinstance(reply, BaseException):
                    raise reply
            again = await _exchange(pool, [calls[n][0] for n in missing])
            for n, reply in zip(missing, again, strict=True):
                replies[n] = reply
    except BaseException as exc:
        for _, _, future in calls:
            if not future.done():
                if isinstance(exc, asyncio.CancelledError):
                    future.cancel()
                else:
                    future.set_exception(exc)
        if not isinstance(exc, Exception):
            raise
        return
    for (_, _, future), reply in zip(calls, replies, strict=True):
        if future.done():  # its caller went away
            continue
        if isinstance(reply, BaseException):
            future.set_exception(reply)
        else:
            future.set_result(reply)


async def _exchange(pool: ConnectionPool, commands: list[bytes]) -> list[Any]:
    """Send ``commands`` (packed) in one write on one connection and read their replies
    in order, an error reply as its exception (:func:`dedup._redis.script.exchange`: no
    unread reply is left for a later call, whether the connection is pooled or shared).

    Never retried, whatever the client's ``Retry`` says (redis-py gives ``Redis(host=...)``
    ten): the lock scripts are not safe to run twice. A release run again after its reply
    was lost takes a reentrant count down twice (another task then takes a lock still
    held), an acquire run again finds its own grant and says "not granted" (the lock stays
    held by a token nobody knows). The error reaches the lock, which treats the outcome
    as unknown (an acquire's grant is given back; see :class:`dedup.lock.Lock`)."""
    return await exchange(pool, b"".join(commands), len(commands), retry=False)
