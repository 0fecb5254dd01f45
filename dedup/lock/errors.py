"""The lock library's errors: under :class:`dedup.errors.DedupError`, and also redis-py's.

The lock errors are also redis-py's lock errors, so that code written against
``redis.asyncio.lock.Lock`` catches them unchanged. They are defined in
:mod:`dedup.errors`, the one error tree (which the lock library sits above), and named
here too, so that ``from dedup.lock.errors import LockError`` keeps working.
"""

from __future__ import annotations

from dedup.errors import LockError, LockNotOwned, QuorumUnavailable, StaleFence

__all__ = ["LockError", "LockNotOwned", "QuorumUnavailable", "StaleFence"]
