"""The test servers and fixtures themselves, against the real binaries."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import asyncpg
import pytest
import redis.asyncio as aioredis
import redis.exceptions

from tests.servers import PostgresCluster, RedisServer, ServerError, free_port

ROOT = Path(__file__).resolve().parent.parent


def _client(url: str, timeout: float = 5.0) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout, retry_on_timeout=False
    )


# ------------------------------------------------------------------------------- redis


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 1024 <= port <= 65535


async def test_redis_ping_set_get(redis_url: str, redis_server: RedisServer) -> None:
    assert redis_url == f"redis://127.0.0.1:{redis_server.port}/0"
    client = _client(redis_url)
    try:
        assert await client.ping() is True
        assert await client.dbsize() == 0  # FLUSHALLed by the fixture
        await client.set("k", "v")
        assert await client.get("k") == b"v"
        # Persistence is off and nothing is evicted.
        assert await client.config_get("save") == {"save": ""}
        assert await client.config_get("appendonly") == {"appendonly": "no"}
        assert await client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    finally:
        await client.aclose()


async def test_redis_url_is_flushed_each_test(redis_url: str) -> None:
    # The previous test left "k" behind; the fixture emptied the server again.
    client = _client(redis_url)
    try:
        assert await client.exists("k") == 0
    finally:
        await client.aclose()


async def test_redis_kill_and_restart_comes_back_empty(fresh_redis: RedisServer) -> None:
    port, old_pid = fresh_redis.port, fresh_redis.pid
    client = _client(fresh_redis.url)
    try:
        await client.set("k", "v")
        fresh_redis.kill()
        assert not fresh_redis.is_alive()
        with pytest.raises(redis.exceptions.ConnectionError):
            await asyncio.wait_for(client.get("k"), 10)
        fresh_redis.restart()
        assert fresh_redis.port == port
        assert fresh_redis.pid != old_pid
        assert fresh_redis.is_alive()
        assert await asyncio.wait_for(client.get("k"), 10) is None
        assert await client.dbsize() == 0
    finally:
        await client.aclose()


async def test_redis_pause_and_resume(fresh_redis: RedisServer) -> None:
    client = _client(fresh_redis.url, timeout=0.3)
    try:
        assert await client.ping() is True
        fresh_redis.pause()
        try:
            with pytest.raises(redis.exceptions.TimeoutError):
                await asyncio.wait_for(client.ping(), 10)
        finally:
            fresh_redis.resume()
        assert await asyncio.wait_for(client.ping(), 10) is True
    finally:
        await client.aclose()


def test_redis_stop_while_paused_and_context_manager() -> None:
    with RedisServer(extra_args=["--databases", "4"]) as server:
        assert server.ping()
        pid = server.pid
        server.pause()
    # stop() sent SIGCONT before SIGTERM, and the process is gone.
    assert not server.is_alive()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not server.dir.exists()
    with pytest.raises(ServerError):
        server.start()


def test_redis_start_failure_shows_log() -> None:
    server = RedisServer(extra_args=["--no-such-option", "1"])
    try:
        with pytest.raises(ServerError, match="no-such-option"):
            server.start()
    finally:
        server.stop()


# -------------------------------------------------------------------------- postgresql


async def test_pg_empty_database_is_durable(pg_empty_url: str, pg_cluster: PostgresCluster) -> None:
    assert pg_empty_url.startswith(f"postgresql://postgres@127.0.0.1:{pg_cluster.port}/t_")
    conn = await asyncpg.connect(pg_empty_url, timeout=10)
    try:
        assert await conn.fetchval("SHOW fsync") == "on"
        assert await conn.fetchval("SHOW synchronous_commit") == "on"
        assert await conn.fetchval("SHOW full_page_writes") == "on"
        assert await conn.fetchval("SHOW listen_addresses") == "127.0.0.1"
        tables = await conn.fetchval(
            "SELECT count(*) FROM pg_tables WHERE schemaname NOT IN ('pg_catalog', "
            "'information_schema')"
        )
        assert tables == 0
    finally:
        await conn.close()


def test_pg_create_and_drop_database(pg_cluster: PostgresCluster) -> None:
    name = f'weird "name" {os.getpid()}'
    url = pg_cluster.create_database(name)
    assert url == pg_cluster.url(name)
    listed = pg_cluster.psql("SELECT datname FROM pg_database ORDER BY datname")
    assert name in listed.splitlines()
    pg_cluster.drop_database(name)
    pg_cluster.drop_database(name)  # IF EXISTS
    listed = pg_cluster.psql("SELECT datname FROM pg_database ORDER BY datname")
    assert name not in listed.splitlines()


async def test_fresh_pg_kill_and_restart_keeps_data(fresh_pg: PostgresCluster) -> None:
    url = fresh_pg.create_database("keep")
    port, old_pid = fresh_pg.port, fresh_pg.pid
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await conn.execute("CREATE TABLE t (v text PRIMARY KEY)")
        await conn.execute("INSERT INTO t VALUES ('committed')")
    finally:
        await conn.close()
    fresh_pg.kill()
    assert not fresh_pg.is_alive()
    fresh_pg.restart()
    assert fresh_pg.port == port
    assert fresh_pg.pid != old_pid
    conn = await asyncpg.connect(url, timeout=10)
    try:
        assert await conn.fetchval("SELECT v FROM t") == "committed"
    finally:
        await conn.close()


async def test_fresh_pg_pause_blocks_existing_sessions(fresh_pg: PostgresCluster) -> None:
    conn = await asyncpg.connect(fresh_pg.url(), timeout=10)
    try:
        fresh_pg.pause()
        try:
            with pytest.raises(TimeoutError):
                await conn.fetchval("SELECT 1", timeout=0.3)
        finally:
            fresh_pg.resume()
    finally:
        conn.terminate()
    conn = await asyncpg.connect(fresh_pg.url(), timeout=10)
    try:
        assert await conn.fetchval("SELECT 1") == 1
    finally:
        await conn.close()


def test_pg_stop_removes_everything() -> None:
    cluster = PostgresCluster()
    with cluster:
        pid = cluster.pid
        assert cluster.data_dir.is_dir()
        assert len(str(cluster.socket_dir / f".s.PGSQL.{cluster.port}")) <= 107
        cluster.pause()
    assert not cluster.is_alive()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not cluster.data_dir.exists()
    assert not cluster.socket_dir.exists()


# ---------------------------------------------------------------- nothing hidden in CI

_HIDDEN_TESTS = """
import pytest

def test_ok():
    pass

def test_other():
    pass

{extra}
"""


def _run_inner_pytest(
    tmp_path: Path, extra: str, *args: str, ci: bool
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
    )
    (tmp_path / "test_inner.py").write_text(_HIDDEN_TESTS.format(extra=textwrap.dedent(extra)))
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *("-p", "tests.conftest", "-p", "no:cacheprovider", "-q"),
            str(tmp_path / "test_inner.py"),
            *args,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("extra", "args", "what"),
    [
        ("@pytest.mark.skip(reason='x')\ndef test_skipped():\n    pass\n", (), "1 skipped"),
        ("", ("-k", "not test_other"), "1 deselected"),
        ("@pytest.mark.xfail(reason='x')\ndef test_xf():\n    assert False\n", (), "1 xfailed"),
    ],
)
def test_ci_fails_when_tests_are_hidden(
    tmp_path: Path, extra: str, args: tuple[str, ...], what: str
) -> None:
    result = _run_inner_pytest(tmp_path, extra, *args, ci=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"CI=true and this run hid tests ({what})" in result.stdout


def test_ci_rule_passes_clean_runs_and_non_ci(tmp_path: Path) -> None:
    clean = _run_inner_pytest(tmp_path, "", ci=True)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    skip = "@pytest.mark.skip(reason='x')\ndef test_skipped():\n    pass\n"
    outside_ci = _run_inner_pytest(tmp_path, skip, ci=False)
    assert outside_ci.returncode == 0, outside_ci.stdout + outside_ci.stderr
    assert "hid tests" not in outside_ci.stdout


async def test_pg_url_has_the_schema(pg_url: str, pg_cluster: PostgresCluster) -> None:
    assert pg_url.startswith(f"postgresql://postgres@127.0.0.1:{pg_cluster.port}/t_")
    conn = await asyncpg.connect(pg_url, timeout=10)
    try:
        tables = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        names = {row["tablename"] for row in tables}
        assert "alembic_version" in names
        assert len(names) >= 2, names  # the migrations created dedup's own tables too
    finally:
        await conn.close()
