"""What a Gateway opens before its first save, and closes after its last.

In order, each closed in reverse through one :class:`~contextlib.AsyncExitStack`:
the data-dir lock (for the embedded default), the embedded redis-server, the
Redis client with its eviction check, the schema migration, and the sink.

A Redis that cannot be reached at open does not stop the Gateway (unless
``require_redis``): it starts in degraded mode, and the eviction check runs before
the circuit first closes, so an unsafe Redis is never used, even if it comes up later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError

from dedup._claims.bloom import BloomSpec
from dedup._claims.keys import KeySpace
from dedup._claims.protocol import Claims
from dedup._redis.connect import connect_redis, info_of_every_node
from dedup._redis.embedded import DataDirLock, EmbeddedRedis
from dedup._redis.script import REDIS_6, ScriptVariant
from dedup._redis.server import (
    MIN_REDIS_VERSION,
    older_than_floor,
    script_variant,
    too_old,
    unsafe_policies,
)
from dedup.errors import ConfigError, DedupError, Unavailable
from dedup.metrics import Stats
from dedup.options import GatewayOptions
from dedup.store import DefaultSink, open_sink
from dedup.types import BatchWriter
from dedup.urls import embedded_sqlite_url, redact

__all__ = ["Backends"]

log = logging.getLogger("dedup")


class _Reports(Protocol):
    """Where a Redis call's outcome is reported (:class:`dedup._engine.degraded.DegradedMode`)."""

    def redis_failed(self, exc: BaseException, *, may_time_out: bool = True) -> bool: ...

    def success(self) -> None: ...


class Backends:
    """The servers and connections of one Gateway; :meth:`open` once, :meth:`aclose` once.

    ``keys`` names the Redis keys of values. After :meth:`open`: ``redis`` and ``claims``
    are set; ``sink`` is the write step
    (``default_sink`` is the same object, or None with a custom sink);
    ``redis_down_at_open`` says why Redis could not be used at open (empty if it could);
    ``variant`` is the script variant chosen from the server's version (None until the
    version check has run).
    """

    def __init__(self, options: GatewayOptions, keys: KeySpace, stats: Stats) -> None:
        self._options = options
        self.keys = keys
        self._stats = stats
        self._stack = contextlib.AsyncExitStack()
        self.redis_url = ""
        self.embedded: EmbeddedRedis | None = None
        self.redis: Redis | RedisCluster | None = None
        self.claims: Claims | None = None
        self.sink: BatchWriter | None = None
        self.default_sink: DefaultSink | None = None
        self.redis_down_at_open = ""
        self.eviction_checked = False
        self.variant: ScriptVariant | None = None

    async def open(self) -> None:
        """Open every part in order; on failure, close what was opened and raise."""
        try:
            await self._open()
        except BaseException:
            await self.aclose()
            raise

    async def _open(self) -> None:
        options, stack = self._options, self._stack
        if options.embedded_redis or options.embedded_database:
            lock = DataDirLock(Path(options.data_dir))
            lock.acquire()
            stack.callback(lock.release)
        redis_url = options.redis_url
        if redis_url is None:
            self.embedded = embedded = EmbeddedRedis(Path(options.data_dir))
            stack.push_async_callback(embedded.aclose)
            redis_url = await embedded.start()
        self.redis_url = redis_url
        connections = options.redis_connections
        self.redis = connect_redis(
            redis_url, max_connections=connections, timeout_s=options.redis_timeout_s
        )
        stack.push_async_callback(self.redis.aclose)
        try:
            await self.check_redis()
        except Unavailable as exc:
            # Wrong credentials are a mistake to fix, not an outage to ride out.
            refused = isinstance(exc.__cause__, AuthenticationError)
            if options.require_redis or options.embedded_redis or refused:
                raise
            self.redis_down_at_open = str(exc)
            log.warning("%s: starting degraded (require_redis=False)", exc)
        self.claims = Claims(
            self.redis,
            lease_ms=options.lease_ms,
            retention_ms=options.retention_ms,
            stats=self._stats,
            max_parallel=options.max_claim_batches + options.max_write_batches,
            layout=options.marker_layout,
            marker_buckets=options.marker_buckets,
            cluster_shards=options.shards,
            marker_generations=options.marker_generations,
            approximate=(
                BloomSpec(options.approximate_values, options.approximate_fp_rate)
                if options.approximate_values
                else None
            ),
            variant=self.variant,
        )
        if options.sink is not None:
            self.sink = options.sink
            return
        database_url = options.database_url or embedded_sqlite_url(options.data_dir)
        if options.migrate_at_open:
            await _migrate(database_url)
        sink = open_sink(
            database_url,
            pool_size=options.max_write_batches,
            statement_timeout_ms=options.write_timeout_ms_effective,
        )
        await _open_sink(sink, database_url)
        stack.push_async_callback(sink.aclose)
        self.default_sink = sink
        self.sink = sink

    async def check_redis(self) -> None:
        """Reach Redis and refuse one that may evict keys (leases and markers would vanish)
        or that is older than :data:`dedup._redis.server.MIN_REDIS_VERSION`; choose the script
        variant from its version (for a cluster, its oldest node's), once.

        Raises :class:`Unavailable` when Redis cannot be reached and
        :class:`ConfigError` when it is unsafe; sets ``eviction_checked`` when it passed.
        """
        client, url, allow = self.redis, self.redis_url, self._options.allow_eviction
        assert client is not None
        try:
            # Every node of a cluster: the oldest one sets the script variant, and any one
            # that may evict would lose leases and markers.
            info: Any = await info_of_every_node(client, "memory")
            server: Any = await info_of_every_node(client, "server")
        except NoPermissionError as exc:
            # An ACL user without +info: the policy cannot be read. Say so, not "cannot connect".
            if allow:
                log.warning(
                    "Redis user may not run INFO: maxmemory-policy not checked (allowed), and "
                    "the server's version unknown: the Redis 6 scripts, which every version runs"
                )
                self.eviction_checked = True
                self._use_variant(REDIS_6)
                return
            raise ConfigError(
                f"the Redis user of {redact(url)} may not run INFO ({exc}), which dedup needs to "
                "check maxmemory-policy: grant it (ACL SETUSER <user> +info) or pass "
                "allow_eviction=True"
            ) from exc
        except (RedisError, OSError) as exc:
            if older_than_floor(exc):
                raise ConfigError(
                    f"Redis at {redact(url)} is older than "
                    f"{'.'.join(map(str, MIN_REDIS_VERSION))} (it does not know HELLO); dedup "
                    f"needs Redis {'.'.join(map(str, MIN_REDIS_VERSION))} or newer (or Valkey "
                    "7.2 or newer)"
                ) from exc
            raise Unavailable(
                f"cannot connect to Redis at {redact(url)}: {exc}", component="redis"
            ) from exc
        self._stats.redis_round_trips += 2
        old = too_old(server)
        if old:
            raise ConfigError(
                f"Redis at {redact(url)} is version {', '.join(old)}; dedup needs Redis "
                f"{'.'.join(map(str, MIN_REDIS_VERSION))} or newer (or Valkey 7.2 or newer)"
            )
        if self.variant is None:
            variant = script_variant(server)
            self._use_variant(variant)
            log.info("Redis at %s: %s scripts", redact(url), variant.name)
        bad = unsafe_policies(info)
        if bad and not allow:
            raise ConfigError(
                f"Redis at {redact(url)} has maxmemory-policy {', '.join(sorted(bad))}; dedup "
                "needs noeviction (leases and saved markers carry TTLs, so volatile-* policies "
                "evict them too). Set `maxmemory-policy noeviction` or pass allow_eviction=True."
            )
        self.eviction_checked = True

    def _use_variant(self, variant: ScriptVariant) -> None:
        """Use ``variant``'s scripts from now on (once: the first check that reads it)."""
        if self.variant is None:
            self.variant = variant
            if self.claims is not None:  # Redis was down at open: its first check is now
                self.claims.variant = variant

    async def ping(self, timeout_s: float, breaker: _Reports) -> dict[str, bool]:
        """A PING to Redis and an index probe of the default sink, at once, each bounded
        by ``timeout_s``; never raises. Redis's answer is reported to ``breaker``."""

        async def redis_ok() -> bool:
            if self.redis is None:
                return False
            try:
                await asyncio.wait_for(self.redis.ping(), timeout_s)
            except (RedisError, OSError, TimeoutError) as exc:
                # A failed readiness PING counts like a failed call (never as a timeout
                # of redis_timeout_s): an idle gateway still learns that Redis is gone.
                breaker.redis_failed(exc, may_time_out=False)
                return False
            breaker.success()
            return True

        async def database_ok() -> bool:
            if self.default_sink is None:
                return self.sink is not None
            try:
                await asyncio.wait_for(self.default_sink.count(()), timeout_s)
            except Exception:  # any failure of the probe means "cannot serve now"
                return False
            return True

        redis_up, database_up = await asyncio.gather(redis_ok(), database_ok())
        return {"redis": redis_up, "database": database_up}

    async def aclose(self) -> None:
        """Close every part opened, in reverse order, each even if an earlier one failed."""
        self.sink = self.default_sink = None
        self.redis = self.embedded = None
        self.claims = None
        await self._stack.aclose()


async def _migrate(database_url: str) -> None:
    from dedup.store.migrate import upgrade_async  # alembic is slow to import

    try:
        await upgrade_async(database_url)
    except Exception as exc:
        raise Unavailable(
            f"could not migrate {redact(database_url)}: {exc}", component="database"
        ) from exc


async def _open_sink(sink: DefaultSink, database_url: str) -> None:
    try:
        await sink.open()
    except (OSError, TimeoutError) as exc:
        raise Unavailable(
            f"cannot connect to the database at {redact(database_url)}: {exc}",
            component="database",
        ) from exc
    except Exception as exc:
        if isinstance(exc, DedupError):
            raise
        raise Unavailable(
            f"cannot use the database at {redact(database_url)}: {exc}", component="database"
        ) from exc
