"""Connecting to Redis, one server or a Cluster, and the calls that reach every node.

:func:`connect_redis` builds the client of every URL form dedup takes (with the fast
argument packing of :mod:`dedup._redis.packing`); the helpers read ``INFO`` from every node,
unlink a namespace's keys and probe that a server takes writes.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    ConnectionError,
    RedisError,
)

from dedup._redis.mux import BACKOFF_BASE_S, BACKOFF_CAP_S, Mux
from dedup._redis.packing import fast_packing
from dedup.errors import ConfigError
from dedup.urls import CLUSTER_SCHEMES, REDIS_SCHEMES, SENTINEL_SCHEMES, parse_sentinel_url, scrub

__all__ = [
    "CONNECTION_RETRIES",
    "MuxPool",
    "SentinelMuxPool",
    "connect_redis",
    "follow_primary",
    "info_of_every_node",
    "per_node",
    "probe_write",
    "unlink_matching",
]
_PROBE_PX = 10_000
CONNECTION_RETRIES = 2  # resends of a command safe to repeat whose connection failed


class MuxPool(BlockingConnectionPool):
    """The pool of a single-server client: redis-py's blocking pool, plus one shared
    connection (:class:`~dedup._redis.mux.Mux`, None where it cannot serve the URL) that
    :func:`dedup._redis.script.exchange` sends the save path's and the lock's scripts
    on. Disconnecting the pool (``aclose`` of its client) closes that one too."""

    mux: Mux | None = None
    retries = CONNECTION_RETRIES  # resends of a call on ``mux`` whose connection failed

    async def disconnect(self, inuse_connections: bool = True) -> None:
        if self.mux is not None:
            await self.mux.disconnect()
        await super().disconnect(inuse_connections)


class SentinelMuxPool(SentinelConnectionPool):
    """The pool of a client of a Sentinel-managed primary (``redis+sentinel://``):
    redis-py's Sentinel pool, whose connections ask the sentinels where the primary is
    (and reconnect after a READONLY answer from a demoted one), plus the shared
    connection, which asks them too before each connect (:class:`Mux` with a resolver).
    A failover (another primary named) disconnects both; closing the client closes the
    sentinels' connections too."""

    mux: Mux | None = None
    retries = CONNECTION_RETRIES

    async def disconnect(self, inuse_connections: bool = True) -> None:
        # redis-py calls this with inuse_connections=False when the sentinels name another
        # primary (the Mux may be connecting to it right then: only its old connection
        # goes), and with True when the client closes (everything goes).
        if self.mux is not None:
            if inuse_connections:
                await self.mux.disconnect()
            else:
                self.mux.drop()
        await super().disconnect(inuse_connections)
        if inuse_connections:
            for sentinel in self.sentinel_manager.sentinels:
                await sentinel.connection_pool.disconnect()


FOLLOW_S = 1.0
"""How often a gateway on a Sentinel URL asks the sentinels which server is the primary."""


async def follow_primary(client: Redis, interval_s: float = FOLLOW_S) -> None:
    """Ask the sentinels every ``interval_s`` where the primary is; when they name
    another server than the one the connections go to (a failover, a manual one
    included, where the old primary may still take writes for seconds), close them, so
    that every next call goes to the new primary. Runs until cancelled; errors (no
    sentinel answers) only wait for the next turn: the calls' own errors open the
    circuit."""
    pool = client.connection_pool
    assert isinstance(pool, SentinelMuxPool)
    while True:
        await asyncio.sleep(interval_s)
        try:
            address = await pool.get_master_address()  # type: ignore[no-untyped-call]
        except (RedisError, OSError):
            continue
        mux = pool.mux
        if mux is not None and mux.address is not None and mux.address != address:
            mux.drop()


def _connection_retry() -> Retry:
    """The pools' retry: a pooled connection that died with a restarted server (or a
    failover) fails on its next use, so such errors are retried twice on a fresh
    connection (every script here is safe to repeat), but not timeouts, which would
    multiply the wait on a slow server."""
    return Retry(
        ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S),
        CONNECTION_RETRIES,
        supported_errors=(ConnectionError,),
    )


def _connect_sentinel(url: str, common: dict[str, Any], max_connections: int) -> Redis:
    """A client of the primary a Sentinel URL names (see :class:`SentinelMuxPool`)."""
    parts = parse_sentinel_url(url)
    options = dict(parts.options)
    tls: dict[str, Any] = {k: v for k, v in options.items() if k.startswith("ssl_")}
    if "ssl_check_hostname" in tls:  # a word in the URL, a bool for redis-py
        tls["ssl_check_hostname"] = tls["ssl_check_hostname"].lower() in ("1", "true", "yes")
    if parts.tls:
        tls["ssl"] = True
    sentinel_kwargs: dict[str, Any] = {**common, **tls}
    if "sentinel_password" in options:
        sentinel_kwargs["password"] = options["sentinel_password"]
    if "sentinel_username" in options:
        sentinel_kwargs["username"] = options["sentinel_username"]
    node_kwargs: dict[str, Any] = {**common, "db": parts.db}
    if parts.password is not None:
        node_kwargs["password"] = parts.password
    if parts.username is not None:
        node_kwargs["username"] = parts.username
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        parts.sentinels, sentinel_kwargs=sentinel_kwargs, **node_kwargs
    )
    # The nodes' TLS files: SentinelConnectionPool takes ``ssl`` and passes the rest on.
    pool = SentinelMuxPool(  # type: ignore[no-untyped-call]
        parts.service,
        sentinel,
        max_connections=max_connections,
        retry=_connection_retry(),
        **node_kwargs,
        **tls,
    )
    pool.connection_class = fast_packing(pool.connection_class)
    pool.mux = Mux.for_pool(pool)
    return Redis.from_pool(pool)


def connect_redis(url: str, *, max_connections: int, timeout_s: float) -> Redis | RedisCluster:
    """A client for ``url`` (redis://, rediss://, unix://, redis+cluster:// or
    redis+sentinel://).

    The pool is sized by the caller for its batches in flight. On one server a call
    past ``max_connections`` waits up to ``timeout_s`` for a connection (a blocking
    pool): redis-py's default pool raises at once instead, and a stall of Redis shorter
    than the timeout, with readiness pings on top of the batches in flight, then read as
    Redis being down and opened the circuit. (A cluster client's node pools still raise
    past their size; its callers bound their calls per node.)
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
        if url.startswith(SENTINEL_SCHEMES):
            return _connect_sentinel(url, common, max_connections)
        for scheme in CLUSTER_SCHEMES:
            if url.startswith(scheme):
                plain = url.replace("+cluster", "", 1)
                cluster = RedisCluster.from_url(plain, max_connections=max_connections, **common)
                # RedisCluster takes no connection class: give its nodes, those known and
                # those found later (one kwargs dict feeds both), the faster packing too;
                # a redis-py laid out otherwise keeps its own (slower, same bytes).
                template = getattr(cluster, "connection_kwargs", None)
                if isinstance(template, dict) and "connection_class" in template:
                    fast = fast_packing(template["connection_class"])
                    template["connection_class"] = fast
                    for node in cluster.nodes_manager.startup_nodes.values():
                        node.connection_class = fast
                return cluster
        pool = MuxPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            retry=_connection_retry(),
            **common,
        )
        # Batches of thousands of script arguments: pack them faster than redis-py does.
        pool.connection_class = fast_packing(pool.connection_class)
        pool.connection_class(**pool.connection_kwargs)  # builds options, opens nothing
        pool.mux = Mux.for_pool(pool)
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


async def info_of_every_node(client: Redis | RedisCluster, section: str) -> Any:
    """``INFO section`` of a server, or of EVERY node of a cluster (a node address -> its
    answer; redis-py asks one node unless told), for :func:`per_node`."""
    if isinstance(client, RedisCluster):
        return await client.info(section, target_nodes=RedisCluster.ALL_NODES)
    return await client.info(section)


async def unlink_matching(client: Redis | RedisCluster, pattern: bytes | str) -> int:
    """UNLINK every key matching ``pattern`` (SCAN, 1,000 at a time; every primary of a
    cluster); returns how many. For demos, tests and the bench, never the hot path."""
    nodes: list[Any] = [None]
    if isinstance(client, RedisCluster):
        await client.initialize()  # a new client knows no nodes until its first command
        nodes = list(client.get_primaries())
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


async def probe_write(client: Redis | RedisCluster, namespace: str) -> None:
    """Write a tiny key in ``namespace`` (SET with a 10 s PX, then DEL), on every
    primary of a cluster; raise what Redis raises if it cannot take a write.

    A PING answers on a full, read-only or MISCONF server: only a write tells
    whether claims would succeed again (:func:`unwritable_reason` reads the error).
    """
    name = f"{namespace}:probe:{secrets.token_hex(6)}"
    if not isinstance(client, RedisCluster):
        await client.set(name, "1", px=_PROBE_PX)
        await client.delete(name)
        return
    # One key per primary: a hash tag that lands on each of them.
    wanted = {node.name for node in client.get_primaries()}
    probes: list[str] = []
    for i in range(100_000):
        if not wanted:
            break
        key = f"{name}:{{{i}}}"
        node = client.get_node_from_key(key)
        if node is not None and node.name in wanted:
            wanted.discard(node.name)
            probes.append(key)
    for key in probes:
        await client.set(key, "1", px=_PROBE_PX)
        await client.delete(key)
