"""Locks on Redis: :class:`Lock` (a drop-in for redis-py's asyncio ``Lock`` with a watchdog,
reentrancy and fencing tokens) and :class:`Redlock` (one lock over N independent masters).

The library stands on its own: it needs nothing of the gateway but the error tree
(:mod:`dedup.errors`, where its errors are defined). :mod:`.lock` holds :class:`Lock`,
:mod:`.tokens` its tokens, :mod:`.watchdog` the renewal of its lease, :mod:`.gate` its
in-process queue of blocked acquires, :mod:`.handover` the release that hands the lock to
the first of them, :mod:`.release` the listener that wakes waiters, :mod:`.batch` the
shared writes that carry the lock calls of one turn of the loop, :mod:`.fence` the
fencing helpers, :mod:`.redlock` :class:`Redlock`, :mod:`.scripts` the Lua and
:mod:`.errors` the errors (re-exported from :mod:`dedup.errors`).
"""

from __future__ import annotations

from dedup.lock.errors import LockError, LockNotOwned, QuorumUnavailable, StaleFence
from dedup.lock.fence import FENCE_CHECK_SQL, FENCED_SET, check_fence, fenced_set
from dedup.lock.lock import DEFAULT_FENCE_MEMORY_S, Lock
from dedup.lock.redlock import Redlock
from dedup.lock.release import RELEASE_CHANNEL
from dedup.lock.scripts import (
    ACQUIRE,
    ACQUIRE_REENTRANT,
    EXTEND,
    HANDOVER,
    OWNER,
    REACQUIRE,
    RELEASE,
    RELEASE_PLAIN,
)

__all__ = [
    "ACQUIRE",
    "ACQUIRE_REENTRANT",
    "DEFAULT_FENCE_MEMORY_S",
    "EXTEND",
    "FENCED_SET",
    "FENCE_CHECK_SQL",
    "HANDOVER",
    "OWNER",
    "REACQUIRE",
    "RELEASE",
    "RELEASE_CHANNEL",
    "RELEASE_PLAIN",
    "Lock",
    "LockError",
    "LockNotOwned",
    "QuorumUnavailable",
    "Redlock",
    "StaleFence",
    "check_fence",
    "fenced_set",
]

for _name in ("Lock", "Redlock", "LockError", "LockNotOwned", "QuorumUnavailable", "StaleFence"):
    globals()[_name].__module__ = __name__
del _name
