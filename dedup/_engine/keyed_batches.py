"""Keyed batches: one kind of call of the run-once machinery, batched across callers.

Each caller asks for one key and awaits its answer; the keys asked for while a call is in
flight go in the next call, so a batch grows with the load (as the engine's claim and
write queues do). :class:`Batched` serves :class:`dedup._engine.once.RunOnceState`: its
claims, commits, row reads, and the two combined steps of a new value's run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

from redis.exceptions import MaxConnectionsError

from dedup.errors import DedupError

__all__ = ["Batched", "gated_call"]

_K = TypeVar("_K", bound=Hashable)
_A = TypeVar("_A")

# Redis calls that found the Gateway's pool full are retried this often, this far apart.
_POOL_RETRIES = 50
_POOL_RETRY_S = 0.005
_R = TypeVar("_R")


async def gated_call(
    call: Callable[[list[_K]], Awaitable[_R]], keys: list[_K], gate: asyncio.Semaphore | None
) -> _R:
    """``call(keys)``, holding ``gate`` if given. Under a full load of saves the Gateway's
    own stages may hold every pooled Redis connection for a moment: a call that finds the
    pool full waits for one rather than fail the run."""
    if gate is None:
        return await _retried(call, keys)
    async with gate:
        return await _retried(call, keys)


async def _retried(call: Callable[[list[_K]], Awaitable[_R]], keys: list[_K]) -> _R:
    for _ in range(_POOL_RETRIES):
        try:
            return await call(keys)
        except MaxConnectionsError:
            await asyncio.sleep(_POOL_RETRY_S)
    return await call(keys)


class Batched(Generic[_K, _A]):
    """One kind of call for one Gateway, batched: every key asked for while a call is in
    flight goes in a next call (so a batch grows with the load, as the engine's claim and
    write queues do). Up to ``lanes`` calls are in flight at once: while one waits for its
    server, the next batch's callers go on, so that the process's CPU and the round trips
    overlap rather than take turns. A lane that finishes its call takes the keys waiting.

    Batchers given the same ``gate`` take turns too: the Gateway's Redis pool is sized
    for its own stages and raises rather than waits past its size, so the Redis batchers
    take one connection at most, and retry for a moment when none is free. The database
    batchers need no gate: the sink's pool waits for a free connection."""

    __slots__ = ("_busy", "_gate", "_gathering", "_lanes", "_more", "_run", "_tasks", "_waiting")

    def __init__(
        self,
        run: Callable[[list[_K]], Awaitable[list[_A]]],
        gate: asyncio.Semaphore | None = None,
        lanes: int = 1,
    ) -> None:
        self._run = run
        self._gate = gate
        self._lanes = lanes
        # A future per key waiting, and the rare other callers of a key in ``_more``: a
        # list per key would be one more object for every call.
        self._waiting: dict[_K, asyncio.Future[_A]] = {}
        self._more: dict[_K, list[asyncio.Future[_A]]] = {}
        self._busy = 0  # lanes with a task
        self._tasks: set[asyncio.Task[None]] = set()  # the loop keeps only weak references
        self._gathering = False  # a lane's task waits for this tick's callers

    def __call__(self, key: _K) -> asyncio.Future[_A]:
        """The call's answer for ``key`` (a future to await); raises what the call raised.

        A plain function returning the future, not a coroutine: a caller waiting for its
        batch holds one object fewer."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[_A] = loop.create_future()
        if key in self._waiting:  # rare: a second caller of one key in one batch
            self._more.setdefault(key, []).append(fut)
        else:
            self._waiting[key] = fut
        if not self._gathering and self._busy < self._lanes:
            self._gathering = True
            self._busy += 1
            task = loop.create_task(self._drain())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return fut

    async def _drain(self) -> None:
        batch: dict[_K, asyncio.Future[_A]] = {}
        more: dict[_K, list[asyncio.Future[_A]]] = {}
        gathering = True
        try:
            await asyncio.sleep(0)  # the callers of this tick join this call
            self._gathering = gathering = False
            while self._waiting:
                batch, self._waiting = self._waiting, {}
                more, self._more = self._more, {}
                try:
                    answers = await gated_call(self._run, list(batch), self._gate)
                except Exception as exc:
                    _fail(batch, more, exc)
                else:
                    _answer(batch, more, answers)
                batch, more = {}, {}
        finally:
            self._busy -= 1
            if gathering:
                self._gathering = False
            # Cancelled (the loop is closing): nobody answers the rest, so say so.
            stopped = DedupError("the Gateway's loop stopped")
            _fail(batch, more, stopped)
            _fail(self._waiting, self._more, stopped)
            self._waiting, self._more = {}, {}


def _answer(
    batch: dict[_K, asyncio.Future[_A]], more: dict[_K, list[asyncio.Future[_A]]], answers: list[_A]
) -> None:
    """Answer a batch's callers: ``answers`` in the order of ``batch``."""
    for fut, answer in zip(batch.values(), answers, strict=True):
        if not fut.done():
            fut.set_result(answer)
    if more:
        position = {key: i for i, key in enumerate(batch)}
        for key, futs in more.items():
            for fut in futs:
                if not fut.done():
                    fut.set_result(answers[position[key]])


def _fail(
    batch: dict[_K, asyncio.Future[_A]],
    more: dict[_K, list[asyncio.Future[_A]]],
    exc: BaseException,
) -> None:
    """Raise ``exc`` to a batch's callers."""
    for fut in (*batch.values(), *(f for futs in more.values() for f in futs)):
        if not fut.done():
            fut.set_exception(exc)
