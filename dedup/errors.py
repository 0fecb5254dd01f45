"""The one error tree of dedup.

Every error dedup raises on purpose is a :class:`DedupError`; callers can catch
that one class, or the precise subclass for the case they handle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
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


class ConfigError(DedupError, ValueError):
    """Raised when options, URLs or the servers' settings make a Gateway (or a lock)
    unsafe to start.

    Also a ``ValueError``, so code that caught the ``ValueError`` of a bad option
    keeps working.
    """


# The lock library's errors live with it (dedup.lock.errors); they are named here too, so
# that ``from dedup.errors import LockError`` keeps working. Loaded on first use: the lock
# package imports this module, so a plain import here would be a cycle.
_LOCK_ERRORS = frozenset({"LockError", "LockNotOwned", "QuorumUnavailable", "StaleFence"})

if TYPE_CHECKING:
    from dedup.lock.errors import LockError, LockNotOwned, QuorumUnavailable, StaleFence


def __getattr__(name: str) -> Any:
    if name in _LOCK_ERRORS:
        from dedup.lock import errors

        return getattr(errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
