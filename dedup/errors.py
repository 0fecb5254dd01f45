"""The one error tree of dedup.

Every error dedup raises on purpose is a :class:`DedupError`; callers can catch
that one class, or the precise subclass for the case they handle.
"""

from __future__ import annotations

from redis.exceptions import LockError as _RedisLockError
from redis.exceptions import LockNotOwnedError as _RedisLockNotOwnedError

__all__ = [
    "CannotForget",
    "ConfigError",
    "DedupError",
    "InvalidInput",
    "LockError",
    "LockNotOwned",
    "Overloaded",
    "QuorumUnavailable",
    "StaleFence",
    "Unavailable",
    "WaitTimeout",
]


class DedupError(Exception):
    """Raised for every failure dedup reports on purpose; the root of the tree."""


class InvalidInput(DedupError, ValueError):
    """Raised when a kind, value, payload or batch is malformed or too large.

    Nothing of the call was saved. ``index`` names the offending item of a batch
    (``None`` for a single save) and ``field`` the offending field.
    """

    def __init__(self, message: str, *, field: str | None = None, index: int | None = None) -> None:
        if index is not None:
            message = f"item {index}: {message}"
        super().__init__(message)
        self.field = field
        self.index = index


class Unavailable(DedupError):
    """Raised when Redis or the database cannot be reached or failed a call.

    Nothing was acknowledged: the value may or may not be in the database, and a
    retry answers either way. ``component`` is ``"redis"`` or ``"database"``.
    """

    def __init__(self, message: str, *, component: str) -> None:
        super().__init__(message)
        self.component = component


class WaitTimeout(DedupError):
    """Raised when another writer held a value's lease for longer than ``wait_timeout_s``.

    The value may be saved by that writer later; a retry answers.
    """


class Overloaded(DedupError):
    """Raised when the gateway sheds load instead of queueing without bound."""


class CannotForget(DedupError):
    """Raised when :meth:`dedup.Gateway.forget` (or ``forget_many``, ``prune``) is asked of
    a Gateway that cannot erase a value: approximate (Bloom) mode, whose filter cannot
    delete a member (the value would keep answering "probably saved" with no row), or a
    custom sink, whose rows dedup cannot delete.

    Nothing was deleted.
    """


class ConfigError(DedupError, ValueError):
    """Raised when options, URLs or the servers' settings make a Gateway (or a lock)
    unsafe to start.

    Also a ``ValueError``, so code that caught the ``ValueError`` of a bad option
    keeps working.
    """


# The lock library's errors, also redis-py's lock errors so that code written against
# ``redis.asyncio.lock.Lock`` catches them unchanged. Defined here, in the one tree, so
# that the lock library (which sits above this module) and the gateway import them
# without a cycle; dedup.lock and dedup.lock.errors re-export them.


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


# Reprs, tracebacks and the docs name the lock errors where users import them from, as
# for the rest of the lock library (dedup.lock sets the same), whichever module was
# imported first.
for _cls in (LockError, LockNotOwned, QuorumUnavailable, StaleFence):
    _cls.__module__ = "dedup.lock"
del _cls
