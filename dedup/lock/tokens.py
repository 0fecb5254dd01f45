"""The tokens a :class:`dedup.lock.Lock` holds its lock with: one per acquire (plain
locks) or one per asyncio task (reentrant locks), unique across processes and hosts."""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import weakref
from typing import Any

__all__ = ["new_token", "task_token"]

_TASK_TOKENS: weakref.WeakKeyDictionary[asyncio.Task[Any], bytes] = weakref.WeakKeyDictionary()


# A token is this process's random prefix and a count: unique across processes and
# hosts like a random token, without a call for 16 random bytes per acquire (~4 % of
# an acquire and release's CPU). A token is no secret (redis-py's are uuid1); a child
# forked from this process draws a prefix of its own.
_token_prefix = b""
_token_count = itertools.count()


def _draw_token_prefix() -> None:
    global _token_prefix, _token_count
    _token_prefix = secrets.token_hex(10).encode()
    _token_count = itertools.count()


_draw_token_prefix()
os.register_at_fork(after_in_child=_draw_token_prefix)


def new_token() -> bytes:
    """A fresh token: this process's random prefix and the next count."""
    return b"%s%012x" % (_token_prefix, next(_token_count))


def task_token() -> bytes:
    """The reentrant owner id of the current task: one per task, unique across processes."""
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("a reentrant Lock must be acquired from an asyncio task")
    token = _TASK_TOKENS.get(task)
    if token is None:
        token = _TASK_TOKENS[task] = new_token()
    return token
