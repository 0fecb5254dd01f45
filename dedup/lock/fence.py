"""Fencing: let the resource a lock protects reject a writer whose lock expired.

A :class:`dedup.lock.Lock` hands out ``lock.fence``, a number strictly greater
than every fence granted before for that name. A write carries it, and the
resource keeps the highest fence it accepted: :func:`check_fence` in a
PostgreSQL transaction, :func:`fenced_set` on a Redis hash. :func:`fence_key`
names the counter a lock keeps its last fence in.
"""

from __future__ import annotations

from typing import Any, Protocol

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from dedup._redis.script import Script
from dedup.errors import InvalidInput
from dedup.lock.errors import StaleFence

__all__ = [
    "FENCED_SET",
    "FENCE_CHECK_SQL",
    "check_fence",
    "fence_key",
    "fenced_set",
    "sibling_key",
]

FENCED_SET = """
-- KEYS[1]: the protected key, a hash: value, fence
-- ARGV[1]: the value to write; ARGV[2]: the writer's fence
-- Returns: 1 = written; 0 = rejected, the key carries a higher fence (a newer
--   holder wrote since: this writer's lock had expired)
local seen = redis.call('HGET', KEYS[1], 'fence')
if seen and tonumber(seen) > tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'value', ARGV[1], 'fence', ARGV[2])
return 1
"""

_FENCED_SET = Script(FENCED_SET)

FENCE_CHECK_SQL = """
INSERT INTO lock_fences (resource, fence) VALUES ($1, $2)
ON CONFLICT (resource) DO UPDATE SET fence = EXCLUDED.fence
    WHERE lock_fences.fence <= EXCLUDED.fence
RETURNING fence
"""
"""Records fence ``$2`` for resource ``$1`` unless a higher one is recorded; returns a
row only when accepted. The conflicting row stays locked until the transaction ends,
so writers of one resource pass one at a time. The application owns the table::

    CREATE TABLE lock_fences (resource text PRIMARY KEY, fence bigint NOT NULL);
"""


class _Connection(Protocol):
    """What :func:`check_fence` needs of an asyncpg connection (or pool proxy)."""

    async def fetchval(self, query: str, *args: Any) -> Any:
        """Run ``query``; the first column of its first row."""

    def is_in_transaction(self) -> bool:
        """True inside ``conn.transaction()``."""


async def check_fence(conn: _Connection, resource: str, fence: int) -> None:
    """Let the write that follows in this transaction through only if ``fence`` is
    not lower than any fence already accepted for ``resource``.

    Run it first inside the transaction of the write it guards; an equal fence is
    accepted (the same holder writing twice). Raises
    :class:`~dedup.errors.StaleFence` when a newer holder wrote since: roll back.
    """
    if not conn.is_in_transaction():
        raise InvalidInput(
            "check_fence must run inside the transaction of the write it guards", field="conn"
        )
    if await conn.fetchval(FENCE_CHECK_SQL, resource, fence) is None:
        raise StaleFence(
            f"fence {fence} for {resource!r} is stale: a newer lock holder wrote since",
            resource=resource,
            fence=fence,
        )


async def fenced_set(
    client: Redis | RedisCluster, key: str | bytes, value: str | bytes, fence: int
) -> None:
    """Set ``value`` in the hash ``key`` (fields ``value`` and ``fence``) unless it
    carries a higher fence; raises :class:`~dedup.errors.StaleFence` if it does."""
    raw_key = key.encode() if isinstance(key, str) else key
    written, _ = await _FENCED_SET(client, [raw_key], [value, fence])
    if written != 1:
        name = raw_key.decode(errors="replace")
        raise StaleFence(
            f"fence {fence} for {name!r} is stale: a newer lock holder wrote since",
            resource=name,
            fence=fence,
        )


def fence_key(key: bytes) -> bytes:
    """The fence counter's key, in the lock's hash slot so that one script may touch
    both on Redis Cluster: ``<key>:fence`` if the key has a hash tag, else ``{<key>}:fence``."""
    return sibling_key(key, b":fence")


def sibling_key(key: bytes, suffix: bytes) -> bytes:
    """A key named after ``key`` plus ``suffix``, in the same hash slot when possible:
    ``<key><suffix>`` if the key has a hash tag, else ``{<key>}<suffix>``."""
    slot = key_slot(key)
    for candidate in (key + suffix, b"{" + key + b"}" + suffix):
        if key_slot(candidate) == slot:
            return candidate
    return key + suffix  # a key with an empty tag ("{}"): one slot is not possible
