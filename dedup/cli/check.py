"""``dedup check``: validate the settings, reach Redis and the database as configured,
and report what was found, one :class:`Finding` a line."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dedup._redis.connect import connect_redis, info_of_every_node, per_node
from dedup._redis.embedded import find_redis_server, server_name, server_version
from dedup._redis.script import VARIANTS, ScriptVariant
from dedup._redis.server import (
    MIN_REDIS_VERSION,
    older_than_floor,
    script_variant,
    too_old,
    unsafe_policies,
)
from dedup.errors import ConfigError, DedupError
from dedup.service.settings import Config
from dedup.store.sinks import PG_TABLE_EXISTS
from dedup.urls import check_url_password, embedded_sqlite_url, redact, scrub

__all__ = ["Finding", "check"]


@dataclass(frozen=True)
class Finding:
    """One line of ``dedup check``: ``status`` is ok, warn or fail."""

    status: Literal["ok", "warn", "fail"]
    subject: str
    message: str


async def _check_redis(url: str, allow_eviction: bool, timeout_s: float) -> list[Finding]:
    shown = redact(url)
    client = connect_redis(url, max_connections=2, timeout_s=timeout_s)
    primary = ""
    try:
        memory: Any = await asyncio.wait_for(info_of_every_node(client, "memory"), timeout_s * 2)
        server: Any = await asyncio.wait_for(info_of_every_node(client, "server"), timeout_s * 2)
        pool = getattr(client, "connection_pool", None)
        ask = getattr(pool, "get_master_address", None)  # a Sentinel URL
        if ask is not None:
            host, port = await asyncio.wait_for(ask(), timeout_s * 2)
            primary = f", primary {host}:{port} as the sentinels name it"
    except Exception as exc:
        if older_than_floor(exc):
            needed = ".".join(map(str, MIN_REDIS_VERSION))
            why = f"older than Redis {needed} (no HELLO): dedup needs Redis {needed}+"
            return [Finding("fail", "redis", f"{shown}: {why} (or Valkey 7.2+)")]
        return [
            Finding("fail", "redis", f"{shown}: cannot connect: {scrub(redact(str(exc)), url)}")
        ]
    finally:
        await client.aclose()

    # Valkey reports a Redis-compatible redis_version (7.2.4) and its own valkey_version.
    version = sorted(
        {
            f"Valkey {i['valkey_version']} (Redis {i.get('redis_version', '?')})"
            if "valkey_version" in i
            else f"Redis {i.get('redis_version', '?')}"
            for i in per_node(server)
        }
    )
    unsafe = sorted(unsafe_policies(memory))
    limits = {int(i.get("maxmemory", 0)) for i in per_node(memory)}
    found = [Finding("ok", "redis", f"{shown}: reachable, {', '.join(version)}{primary}")]
    old = too_old(server)
    if old:
        needed = ".".join(map(str, MIN_REDIS_VERSION))
        found.append(
            Finding(
                "fail",
                "redis",
                f"Redis {', '.join(old)}: dedup needs Redis {needed}+ (or Valkey 7.2+)",
            )
        )
    else:
        found.append(Finding("ok", "redis", _variant_line(script_variant(server))))
    if not unsafe:
        found.append(Finding("ok", "redis", "maxmemory-policy noeviction"))
    else:
        status: Literal["warn", "fail"] = "warn" if allow_eviction else "fail"
        found.append(
            Finding(
                status,
                "redis",
                f"maxmemory-policy {', '.join(unsafe)}: dedup needs noeviction (leases and "
                "markers carry TTLs, so volatile-* evicts them too)"
                + (" - allowed by allow_eviction" if allow_eviction else ""),
            )
        )
    if 0 in limits:
        found.append(
            Finding(
                "warn",
                "redis",
                "maxmemory is 0 (no limit): Redis can grow until the machine runs out; set it "
                "(with noeviction, a full Redis refuses writes instead of dropping keys)",
            )
        )
    return found


def _variant_line(variant: ScriptVariant) -> str:
    """What ``dedup check`` says about the script variant a Gateway would choose."""
    since = ".".join(map(str, variant.since))
    line = f"scripts: {variant.name} (Redis {since}+: {variant.commands})"
    if variant is not VARIANTS[0]:
        newest = ".".join(map(str, VARIANTS[0].since))
        line += f"; Redis {newest}+ would save a command per new value"
    return line


async def _check_postgres(url: str, timeout_s: float) -> list[Finding]:
    import asyncpg

    shown = redact(url)
    try:
        conn = await asyncpg.connect(url, timeout=timeout_s)
    except Exception as exc:
        return [
            Finding("fail", "database", f"{shown}: cannot connect: {scrub(redact(str(exc)), url)}")
        ]
    try:
        version = await conn.fetchval("SHOW server_version")
        fsync = await conn.fetchval("SHOW fsync")
        sync_commit = await conn.fetchval("SHOW synchronous_commit")
        has_table = await conn.fetchval(PG_TABLE_EXISTS)
        has_version = await conn.fetchval("SELECT to_regclass('alembic_version') IS NOT NULL")
        revision = (
            await conn.fetchval("SELECT version_num FROM alembic_version") if has_version else None
        )
    except Exception as exc:
        return [
            Finding("fail", "database", f"{shown}: query failed: {scrub(redact(str(exc)), url)}")
        ]
    finally:
        await conn.close(timeout=timeout_s)
    found = [Finding("ok", "database", f"{shown}: reachable, PostgreSQL {version}")]
    if fsync != "on" or sync_commit not in ("on", "remote_apply", "remote_write"):
        found.append(
            Finding(
                "warn",
                "database",
                f"fsync={fsync}, synchronous_commit={sync_commit}: an acknowledged row may be "
                "lost in a crash; keep both on",
            )
        )
    found.append(_schema_finding(bool(has_table), revision))
    return found


async def _check_truth(
    redis_url: str, database_url: str, namespace: str, timeout_s: float
) -> list[Finding]:
    """Whether the markers can still be trusted: rows deleted outside dedup whose
    markers wait to be cleared, and the database behind (or other than) what the
    namespace saw of it: markers may then claim rows it lost."""
    import asyncpg

    from dedup._engine.guardian import state_key
    from dedup.store.sinks import PG_COUNT_TOMBSTONES, PG_POSITION_UNPRIVILEGED

    conn = await asyncpg.connect(database_url, timeout=timeout_s)
    try:
        if not await conn.fetchval("SELECT to_regclass('dedup_tombstones') IS NOT NULL"):
            return []  # not migrated yet: the schema finding says so
        waiting = int(await conn.fetchval(PG_COUNT_TOMBSTONES))
        timeline, lsn = await conn.fetchrow(PG_POSITION_UNPRIVILEGED)
    finally:
        await conn.close(timeout=timeout_s)
    client = connect_redis(redis_url, max_connections=2, timeout_s=timeout_s)
    try:
        seen: list[Any] = await client.hmget(state_key(namespace, "database"), ["id", "lsn"])
        seen_id, seen_lsn = seen
    finally:
        await client.aclose()
    found = []
    if waiting:
        found.append(
            Finding(
                "warn",
                "markers",
                f"{waiting} row(s) deleted outside dedup wait for their markers to be "
                "cleared: a running gateway does it within seconds; with none running, "
                "`dedup reconcile`",
            )
        )
    if seen_id is None or seen_lsn is None:
        found.append(Finding("ok", "markers", "no gateway has watched this database yet"))
    # The identity is "<system id>/<timeline>", or the timeline alone for a gateway whose
    # user may not read the control file: compare the timelines.
    elif str(seen_id, "ascii").rpartition("/")[2] != timeline or int(seen_lsn, 16) > int(lsn):
        found.append(
            Finding(
                "warn",
                "markers",
                "the database is behind (or other than) what the gateways saw of it: it "
                "lost commits (a restore, a failover); running gateways reset the markers "
                "within a second; with none running, `dedup reconcile`",
            )
        )
    else:
        found.append(
            Finding("ok", "markers", "the database is at or past every position the gateways saw")
        )
    return found


def _check_sqlite(url: str) -> list[Finding]:
    from sqlalchemy.engine import make_url

    path = Path(make_url(url).database or "")
    if not path.is_file():
        return [Finding("fail", "database", f"{url}: no such file; run `dedup migrate`")]
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
            revision = None
            if "alembic_version" in tables:
                row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
                revision = None if row is None else str(row[0])
    except sqlite3.Error as exc:
        return [Finding("fail", "database", f"{url}: cannot read: {exc}")]
    found = [Finding("ok", "database", f"{url}: readable, SQLite {sqlite3.sqlite_version}")]
    found.append(_schema_finding("dedup_items" in tables, revision))
    return found


def _schema_finding(has_table: bool, revision: str | None) -> Finding:
    from dedup.store.migrate import head_revision  # imports alembic, slow: only here

    head = head_revision()
    if not has_table:
        return Finding("fail", "database", "no table dedup_items: run `dedup migrate`")
    if revision != head:
        return Finding(
            "fail",
            "database",
            f"schema at revision {revision}, the code needs {head}: run `dedup migrate`",
        )
    return Finding("ok", "database", f"schema at revision {revision} (the newest)")


def _embedded_findings(binary: str, data_dir: str) -> list[Finding]:
    """The embedded redis-server: which binary, its version and the scripts it gets."""
    version = server_version(binary)
    shown = ".".join(map(str, version)) if version != (0, 0, 0) else "of unknown version"
    found = [
        Finding(
            "ok",
            "redis",
            f"embedded: {binary} ({server_name(binary)} {shown}), started on a unix socket in "
            f"{data_dir} (noeviction)",
        )
    ]
    if version != (0, 0, 0) and version[:2] < MIN_REDIS_VERSION:
        needed = ".".join(map(str, MIN_REDIS_VERSION))
        found.append(Finding("fail", "redis", f"embedded: dedup needs Redis {needed}+"))
    else:
        text = ".".join(map(str, version))
        found.append(Finding("ok", "redis", _variant_line(script_variant({"redis_version": text}))))
    return found


def _password_ok(url: str) -> bool:
    """False for a URL with an unescaped password: the config finding already fails it, and
    connecting would only quote pieces of the password in the errors."""
    try:
        check_url_password(url, "url")
    except ConfigError:
        return False
    return True


async def check(config: Config) -> list[Finding]:
    """What ``dedup check`` reports: the settings, then Redis and the database as configured.

    Never raises for a problem it finds: each is a ``fail`` finding.
    """
    gateway, service = config.gateway, config.service
    found = [
        Finding(
            "ok",
            "config",
            f"read {config.path}" if config.path else "no config file: built-in defaults",
        )
    ]
    try:
        gateway.options()  # checks every option, without any I/O
    except DedupError as exc:
        found.append(Finding("fail", "config", f"[gateway]: {exc}"))
    else:
        found.append(Finding("ok", "config", "[gateway] settings are valid"))
    found.append(
        Finding(
            "ok",
            "config",
            f"[service] will listen on {service.host}:{service.port} with {service.workers} "
            f"worker(s), auth {'on' if service.auth_token else 'off'}",
        )
    )
    if not service.loopback and not service.auth_token:
        found.append(
            Finding(
                "warn",
                "config",
                f"host {service.host} is reachable from other machines and auth_token is empty",
            )
        )
    if service.workers > 1 and not (gateway.redis_url and gateway.database_url):
        found.append(Finding("fail", "config", "workers > 1 needs redis_url and database_url"))

    timeout_s = min(gateway.redis_timeout_s, 5.0)
    if gateway.redis_url:
        if _password_ok(gateway.redis_url):
            found += await _check_redis(gateway.redis_url, gateway.allow_eviction, timeout_s)
    else:
        try:
            binary = find_redis_server()
        except DedupError as exc:
            found.append(Finding("fail", "redis", f"embedded: {exc}"))
        else:
            found += _embedded_findings(binary, str(gateway.data_dir))
    url = gateway.database_url
    if not url:
        sqlite_path = embedded_sqlite_url(gateway.data_dir).removeprefix("sqlite:///")
        found.append(
            Finding("ok", "database", f"embedded: SQLite {sqlite_path}, migrated at start")
        )
    elif url.startswith(("postgresql://", "postgres://")) and _password_ok(url):
        found += await _check_postgres(url, 5.0)
        if gateway.redis_url and not any(f.status == "fail" for f in found):
            with contextlib.suppress(Exception):  # the findings above said what failed
                found += await _check_truth(gateway.redis_url, url, gateway.namespace, 5.0)
    elif url.startswith("sqlite:///"):
        found += await asyncio.to_thread(_check_sqlite, url)
    return found
