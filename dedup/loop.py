"""The one event-loop runner of the command line, the service and the benchmarks."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["new_loop", "run"]

_T = TypeVar("_T")


def new_loop() -> asyncio.AbstractEventLoop:
    """A new event loop for a thread of its own: uvloop's when installed, else asyncio's."""
    try:
        import uvloop  # optional speed-up
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def run(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` on uvloop when installed (it makes the event loop itself cheaper),
    else on asyncio's own loop."""
    try:
        import uvloop  # optional speed-up
    except ImportError:
        return asyncio.run(coro)
    result: _T = uvloop.run(coro)
    return result
