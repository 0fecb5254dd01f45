"""The one event-loop runner of the command line, the service and the benchmarks."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["new_loop", "run"]

_T = TypeVar("_T")

# How often a Ctrl-C'd command that goes on making progress is cancelled again.
_RECANCEL_S = 0.25


def new_loop() -> asyncio.AbstractEventLoop:
    """A new event loop for a thread of its own: uvloop's when installed, else asyncio's."""
    try:
        import uvloop  # optional speed-up
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def run(coro: Coroutine[Any, Any, _T], *, progress: Callable[[], object] | None = None) -> _T:
    """Run ``coro`` on uvloop when installed (it makes the event loop itself cheaper),
    else on asyncio's own loop.

    With ``progress`` (a probe of the command's progress, such as its count of rows
    done), Ctrl-C cancels ``coro`` and cancels it again while the probe still moves:
    on Python 3.11 ``asyncio.wait_for`` (in drivers too) can swallow a cancel that
    lands as the awaited call ends, and a long command would then run on to its end.
    A second Ctrl-C raises :class:`KeyboardInterrupt` at once, as ``asyncio.run`` does.
    """
    if progress is not None:
        coro = _interruptible(coro, progress)
    try:
        import uvloop  # optional speed-up
    except ImportError:
        return asyncio.run(coro)
    result: _T = uvloop.run(coro)
    return result


async def _interruptible(coro: Coroutine[Any, Any, _T], progress: Callable[[], object]) -> _T:
    """``coro``, stopped by Ctrl-C (see :func:`run`): KeyboardInterrupt once it ended."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    interrupted = False

    def again(seen: object) -> None:
        if task.done():
            return
        now = progress()
        if now != seen:  # still going: the cancel was lost
            task.cancel()
        loop.call_later(_RECANCEL_S, again, now)

    def on_sigint() -> None:
        nonlocal interrupted
        if interrupted:
            raise KeyboardInterrupt
        interrupted = True
        task.cancel()
        loop.call_later(_RECANCEL_S, again, progress())

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
        return await coro
    try:
        return await coro
    except asyncio.CancelledError:
        if interrupted:
            raise KeyboardInterrupt from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGINT)
