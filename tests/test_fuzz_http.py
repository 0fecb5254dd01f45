"""The HTTP API fuzzed from its own contract: schemathesis against ``/openapi.json``.

The service runs as a real ``python -m dedup serve`` process (helpers from
tests/test_service.py) against a real redis-server and PostgreSQL, with a bearer
token. schemathesis runs as a subprocess with every check, a bounded number of
examples per operation and a bounded time; its exit status is the verdict. Below
it, explicit cases the generated ones may miss: invalid UTF-8, deep JSON, a batch
over the limit, unknown fields, JSON that is not an object, each a 4xx with the
error shape and nothing saved.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import orjson
import pytest
import redis.asyncio as aioredis

from tests.servers import PostgresCluster, RedisServer
from tests.test_service import (
    ROOT,
    ServiceProcess,
    assert_error,
    migrate_in_thread,
    request,
    service_env,
    spawn_service,
    wait_healthy,
)

TOKEN = "fz-" + secrets.token_hex(12)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_BODY = 32768
MAX_ITEMS = 20
SCHEMATHESIS_TIMEOUT_S = 240.0
MAX_EXAMPLES = 60


@dataclass
class Fuzzed:
    svc: ServiceProcess
    database_url: str
    redis: RedisServer


@pytest.fixture(scope="module")
def fuzzed(pg_cluster: PostgresCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    """One service for the module: its own redis-server and database, a token, small limits."""
    name = f"fuzz_http_{os.getpid()}"
    url = pg_cluster.create_database(name)
    migrate_in_thread(url)
    with RedisServer() as redis_server:
        env = service_env(
            redis_server.url,
            url,
            DEDUP_AUTH_TOKEN=TOKEN,
            DEDUP_MAX_BODY_BYTES=str(MAX_BODY),
            DEDUP_MAX_BATCH_ITEMS=str(MAX_ITEMS),
        )
        svc = spawn_service(tmp_path_factory.mktemp("fuzz-http"), env)
        try:
            asyncio.run(wait_healthy(svc))
            yield Fuzzed(svc, url, redis_server)
            assert svc.stop() == 0, svc.log_text()
        finally:
            if svc.proc.poll() is None:
                svc.kill()
            if pg_cluster.is_alive():
                pg_cluster.drop_database(name)


@pytest.fixture
async def http(fuzzed: Fuzzed) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(
        base_url=fuzzed.svc.url, timeout=aiohttp.ClientTimeout(total=60)
    ) as session:
        yield session


async def count_rows(database_url: str, kind: str | None = None) -> int:
    conn = await asyncpg.connect(database_url)
    try:
        if kind is None:
            n: int = await conn.fetchval("SELECT count(*) FROM dedup_items")
        else:
            n = await conn.fetchval("SELECT count(*) FROM dedup_items WHERE kind = $1", kind)
    finally:
        await conn.close()
    return n


# ------------------------------------------------------------------------- schemathesis


@pytest.mark.slow
def test_schemathesis_finds_nothing(fuzzed: Fuzzed, tmp_path: Path) -> None:
    """Every operation, every check, positive and negative data; exit 0 or the report."""
    argv = [
        str(ROOT / ".venv" / "bin" / "schemathesis"),
        "run",
        f"{fuzzed.svc.url}/openapi.json",
        "--checks",
        "all",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--header",
        f"Authorization: Bearer {TOKEN}",
        "--workers",
        "2",
        "--seed",
        "1",
        "--request-timeout",
        "30",
        "--generation-database",
        "none",
        "--no-color",
        "--report",
        "junit",
        "--report-dir",
        str(tmp_path),
    ]
    try:
        done = subprocess.run(
            argv,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=SCHEMATHESIS_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "NO_COLOR": "1"},
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"schemathesis ran over {SCHEMATHESIS_TIMEOUT_S} s") from exc
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-20000:]
    assert "No issues found" in report or " passed" in report, report[-5000:]
    assert fuzzed.svc.proc.poll() is None, "the service died under the fuzz"
    assert TOKEN not in fuzzed.svc.log_text()
