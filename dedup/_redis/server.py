"""What dedup asks of a Redis server before it trusts it: its version, its eviction policy,
and whether it can still write.

The version picks the script variant (:mod:`dedup._redis.script`); on a cluster the oldest
node decides. A server older than :data:`MIN_REDIS_VERSION` is refused by name, a
``maxmemory-policy`` that evicts dedup's keys is refused unless allowed, and a write
refused for memory, a replica or a failed snapshot names its reason
(:func:`unwritable_reason`) so that the gateway degrades instead of failing.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import (
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
)

from dedup._redis.connect import per_node
from dedup._redis.script import REDIS_6, VARIANTS, ScriptVariant

__all__ = [
    "MIN_REDIS_VERSION",
    "older_than_floor",
    "script_variant",
    "too_old",
    "unsafe_policies",
    "unwritable_reason",
]
_UNWRITABLE_TEXTS = (
    ("oom", ("OOM command not allowed", "command not allowed when used memory")),
    ("readonly", ("READONLY", "You can't write against a read only")),
    ("misconf", ("MISCONF", "configured to save RDB snapshots")),
)


MIN_REDIS_VERSION = (6, 0)
"""The oldest Redis dedup runs on (:data:`dedup._redis.script.REDIS_6`'s commands; Valkey
reports its Redis-compatible version, 7.2 for Valkey 7.2 and later)."""


def _versions(server_info: Any) -> list[tuple[str, tuple[int, int] | None]]:
    """Each node's ``redis_version`` in an ``INFO server`` answer (of one server or of
    every cluster node), with its (major, minor), or None when it cannot be read."""
    found: list[tuple[str, tuple[int, int] | None]] = []
    for node in per_node(server_info):
        version = str(node.get("redis_version", ""))
        try:
            major, minor = (int(x) for x in version.split(".")[:2])
        except ValueError:
            found.append((version, None))
        else:
            found.append((version, (major, minor)))
    return found


def older_than_floor(exc: BaseException) -> bool:
    """True when connecting failed because the server does not know ``HELLO`` (Redis 6.0),
    which redis-py sends first when it speaks RESP3 (its default from 8.0): the server is
    older than :data:`MIN_REDIS_VERSION`, and its version cannot even be read."""
    seen: BaseException | None = exc
    for _ in range(8):  # the cause chain, bounded: redis-py wraps it in a ConnectionError
        if seen is None:
            return False
        text = str(seen)
        if isinstance(seen, ResponseError) and "unknown command" in text and "HELLO" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def too_old(server_info: Any) -> list[str]:
    """The ``redis_version`` values below :data:`MIN_REDIS_VERSION` in an ``INFO server``
    answer (of one server or of every cluster node); an unreadable version is let by."""
    old = {text for text, parts in _versions(server_info) if parts and parts < MIN_REDIS_VERSION}
    return sorted(old)


def script_variant(server_info: Any) -> ScriptVariant:
    """The script variant for the servers of an ``INFO server`` answer: the newest one
    that the OLDEST node can run (a cluster whose nodes are being upgraded keeps the old
    scripts until every node is new). An unreadable version gets :data:`REDIS_6`, whose
    commands every supported server has."""
    versions = [parts for _, parts in _versions(server_info)]
    if not versions or None in versions:
        return REDIS_6
    oldest = min(v for v in versions if v is not None)
    for variant in VARIANTS:  # newest first
        if oldest >= variant.since:
            return variant
    return REDIS_6  # older than the floor: refused by too_old before any script runs


def unsafe_policies(memory_info: Any) -> set[str]:
    """The ``maxmemory-policy`` values other than ``noeviction`` in an ``INFO memory``
    answer (of one server or of every cluster node). dedup needs noeviction: leases and
    markers carry TTLs, so ``volatile-*`` policies evict them too."""
    policies = {str(i.get("maxmemory_policy", "noeviction")) for i in per_node(memory_info)}
    return policies - {"noeviction"}


def unwritable_reason(exc: BaseException) -> str | None:
    """Why Redis refused a write, if ``exc`` (or an exception it was raised from) says
    so: ``"oom"`` (``maxmemory`` reached under noeviction), ``"readonly"`` (a replica,
    as after a failover) or ``"misconf"`` (snapshots failing with
    ``stop-writes-on-bgsave-error yes``); None for anything else (a connection error,
    a timeout, a bug). These answers mean "up but cannot take writes": treat them like
    a Redis that is down, with the reason shown."""
    seen: BaseException | None = exc
    for _ in range(8):  # the cause chain, bounded
        if seen is None:
            return None
        if isinstance(seen, OutOfMemoryError):
            return "oom"
        if isinstance(seen, ReadOnlyError):
            return "readonly"
        if isinstance(seen, ResponseError):
            # redis-py strips a known code (OOM, READONLY) and keeps an unknown one
            # (MISCONF); a server that wraps script errors in ERR keeps the message.
            text = str(seen)
            for reason, marks in _UNWRITABLE_TEXTS:
                if any(mark in text for mark in marks):
                    return reason
        seen = seen.__cause__ or seen.__context__
    return None
