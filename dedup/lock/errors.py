"""The lock library's errors: under :class:`dedup.errors.DedupError`, and also redis-py's.

The lock errors are also redis-py's lock errors, so that code written against
``redis.asyncio.lock.Lock`` catches them unchanged. :mod:`dedup.errors` re-exports them.
"""

from __future__ import annotations

from redis.exceptions import LockError as _RedisLockError
from redis.exceptions import LockNotOwnedError as _RedisLockNotOwnedError

from dedup.errors import DedupError

__all__ = ["LockError", "LockNotOwned", "QuorumUnavailable", "StaleFence"]


class LockError(DedupError, _RedisLockError):
    """Raised when a lock is not acquired within the time allowed, or is released,
    extended or reacquired while this object does not hold it.

    Also a ``redis.exceptions.LockError``; ``lock_name`` names the lock.
    """


class LockNotOwned(LockError, _RedisLockNotOwnedError):
    """Raised when a release, extend or reacquire finds that the lock is no longer
    held with this object's token (its lease ran out, or someone else took it).

    Also a ``redis.exceptions.LockNotOwnedError``.
    """


class QuorumUnavailable(LockError):
    """Raised when fewer Redlock nodes than the quorum answered, so that no lock can
    be granted until more of them are reachable.

    ``quorum`` is the number of votes needed, ``answered`` how many nodes answered
    and ``errors`` maps each failed node (``host:port``) to what went wrong.
    """

    def __init__(
        self, message: str, *, lock_name: str, quorum: int, answered: int, errors: dict[str, str]
    ) -> None:
        super().__init__(message, lock_name=lock_name)
        self.quorum = quorum
        self.answered = answered
        self.errors = errors


class StaleFence(DedupError):
    """Raised when a fenced write carries a fence lower than one the protected
    resource has already accepted: a newer holder of the lock wrote since.

    Nothing was written. ``resource`` names what was protected and ``fence`` is the
    rejected fence.
    """

    def __init__(self, message: str, *, resource: str, fence: int) -> None:
        super().__init__(message)
        self.resource = resource
        self.fence = fence
