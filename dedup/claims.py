"""The batched claim protocol on Redis: one script call decides a whole batch.

``claim`` answers, per key, saved / won / busy; ``commit`` marks keys saved once
their rows are committed; ``abort`` releases leases whose write failed. On a
single server each is one round trip however many keys; on Redis Cluster a batch
is split by hash slot, one call per slot, run concurrently.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from typing import Any

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.crc import key_slot
from redis.exceptions import ConnectionError, RedisError

from dedup.errors import ConfigError
from dedup.metrics import Stats
from dedup.scripts import ABORT, CLAIM, COMMIT, Script
from dedup.urls import CLUSTER_SCHEMES, REDIS_SCHEMES, scrub

__all__ = [
    "CLUSTER_SCHEMES",
    "REDIS_SCHEMES",
    "Claims",
    "connect_redis",
    "per_node",
    "unlink_matching",
    "unsafe_policies",
]


_CLAIM, _COMMIT, _ABORT = Script(CLAIM), Script(COMMIT), Script(ABORT)


def connect_redis(url: str, *, max_connections: int, timeout_s: float) -> Redis | RedisCluster:
    """A client for ``url`` (redis://, rediss://, unix:// or redis+cluster://).

    The pool is sized by the caller, which bounds its own concurrent calls below
    ``max_connections``: redis-py's default pool raises past its size instead of
    waiting, and auto-pipelining needs only a few connections.
    """
    common: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
    }
    if not url.startswith(REDIS_SCHEMES):
        raise ConfigError(f"redis_url must start with one of {', '.join(REDIS_SCHEMES)}")
    # redis-py reads the URL's query arguments as connection options (TLS files, for
    # example: rediss://host/0?ssl_ca_certs=/path/ca.crt) and only fails on a wrong one
    # when it first connects, with a TypeError: check them here, with no I/O, so that a
    # mistake is a ConfigError at once. The messages name options, never their values.
    try:
        for scheme in CLUSTER_SCHEMES:
            if url.startswith(scheme):
                plain = url.replace("+cluster", "", 1)
                cluster = RedisCluster.from_url(plain, max_connections=max_connections, **common)
                return cluster
        # A pooled connection that died with a restarted server fails on its next use:
        # retry such errors twice on a fresh connection (every script here is safe to
        # repeat), but not timeouts, which would multiply the wait on a slow server.
        retry = Retry(
            ExponentialBackoff(cap=0.05, base=0.005), 2, supported_errors=(ConnectionError,)
        )
        pool = ConnectionPool.from_url(url, max_connections=max_connections, retry=retry, **common)
        pool.connection_class(**pool.connection_kwargs)  # builds options, opens nothing
    except (TypeError, ValueError, RedisError) as exc:
        raise ConfigError(
            "redis_url has an option redis-py cannot use (ssl_* ones need rediss://; / @ : in "
            f"a password must be percent-encoded): {scrub(str(exc), url)}"
        ) from None
    return Redis.from_pool(pool)  # the client owns the pool and closes it in aclose()


def per_node(info: Any) -> list[dict[str, Any]]:
    """An ``INFO`` answer as one dict per node: a cluster answers per node, a single
    server with one dict."""
    if info and isinstance(next(iter(info.values())), dict):
        return list(info.values())
    return [info]


def unsafe_policies(memory_info: Any) -> set[str]:
    """The ``maxmemory-policy`` values other than ``noeviction`` in an ``INFO memory``
    answer (of one server or of every cluster node). dedup needs noeviction: leases and
    markers carry TTLs, so ``volatile-*`` policies evict them too."""
    policies = {str(i.get("maxmemory_policy", "noeviction")) for i in per_node(memory_info)}
    return policies - {"noeviction"}


async def unlink_matching(client: Redis | RedisCluster, pattern: bytes | str) -> int:
    """UNLINK every key matching ``pattern`` (SCAN, 1,000 at a time; every primary of a
    cluster); returns how many. For demos, tests and the bench, never the hot path."""
    nodes: list[Any] = list(client.get_primaries()) if isinstance(client, RedisCluster) else [None]
    removed = 0
    for node in nodes:
        kwargs: dict[str, Any] = {} if node is None else {"target_nodes": node}
        batch: list[bytes] = []
        async for key in client.scan_iter(match=pattern, count=1000, **kwargs):
            batch.append(key)
            if len(batch) >= 1000:
                removed += await client.unlink(*batch)
                batch.clear()
        if batch:
            removed += await client.unlink(*batch)
    return removed


class Claims:
    """Claims, commits and aborts leases for batches of keys under one token.

    The token is random per Claims object (one per Gateway): a lease this
    Gateway already holds is extended on a re-claim, never reported busy.
    """

    __slots__ = ("_client", "_cluster", "_lease", "_slot_calls", "_stats", "_token", "retention_ms")

    def __init__(
        self,
        client: Redis | RedisCluster,
        *,
        lease_ms: int,
        retention_ms: int,
        stats: Stats,
        max_parallel: int = 8,
    ) -> None:
        self._client = client
        self._cluster = isinstance(client, RedisCluster)
        self._lease = lease_ms
        self.retention_ms = retention_ms
        self._stats = stats
        # "L" keeps a token distinct from the saved marker "1" whatever the randomness.
        self._token = "L" + secrets.token_hex(12)
        # On a cluster one batch fans out into a call per slot; bounding them all
        # keeps each node's connections below its pool size (which raises, not waits).
        self._slot_calls = asyncio.Semaphore(max_parallel)

    @property
    def token(self) -> str:
        """This claimant's lease token."""
        return self._token

    async def claim(self, keys: Sequence[bytes]) -> str:
        """One letter per key: ``S`` saved, ``W`` won (lease held), ``B`` busy."""
        results = await self._run(_CLAIM, keys, (self._token, self._lease))
        return "".join(r.decode() if isinstance(r, bytes) else r for r in results)

    async def commit(self, keys: Sequence[bytes]) -> int:
        """Mark ``keys`` saved; returns how many still held this token's lease."""
        results = await self._run(_COMMIT, keys, (self._token, self.retention_ms))
        return sum(int(r) for r in results)

    async def abort(self, keys: Sequence[bytes]) -> int:
        """Release this token's leases on ``keys``; returns how many were released."""
        results = await self._run(_ABORT, keys, (self._token,))
        return sum(int(r) for r in results)

    async def _run(self, script: Script, keys: Sequence[bytes], args: Sequence[Any]) -> list[Any]:
        """Run ``script`` over ``keys``: one call, or one per slot on a cluster, in key order."""
        if not keys:
            return []
        client = self._client
        if not self._cluster:
            result, trips = await script(client, keys, args)
            self._stats.redis_round_trips += trips
            return [result]
        groups: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(key_slot(key), []).append(i)

        async def one_slot(idx: list[int]) -> Any:
            async with self._slot_calls:
                result, trips = await script(client, [keys[i] for i in idx], args)
                self._stats.redis_round_trips += trips
                return result

        parts = await asyncio.gather(*(one_slot(idx) for idx in groups.values()))
        if script is not _CLAIM:
            return list(parts)
        # Claim answers are strings: put each letter back at its key's position.
        letters = [""] * len(keys)
        for idx, part in zip(groups.values(), parts, strict=True):
            text = part.decode() if isinstance(part, bytes) else part
            for i, letter in zip(idx, text, strict=True):
                letters[i] = letter
        return ["".join(letters)]
