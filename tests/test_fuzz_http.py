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

from dedup._claims.keys import KeySpace
from dedup._values import digest
from tests.servers import PostgresCluster, RedisServer
from tests.test_service import (
    ROOT,
    ServiceProcess,
    assert_error,
    request,
    service_on_own_servers,
)

TOKEN = "fz-" + secrets.token_hex(12)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_BODY = 32768
MAX_ITEMS = 20
SCHEMATHESIS_TIMEOUT_S = 240.0
# A fixed seed keeps CI repeatable; FUZZ_HTTP_SEED / FUZZ_HTTP_EXAMPLES widen a hunt by hand.
MAX_EXAMPLES = int(os.environ.get("FUZZ_HTTP_EXAMPLES", "60"))
# A forget the service accepts takes a second by design (every gateway must have read the
# invalidation): the forget routes get fewer examples, fuzzed at the same time as the rest.
FORGET_EXAMPLES = int(os.environ.get("FUZZ_HTTP_FORGET_EXAMPLES", "15"))
FORGET_PATHS = "^/v1/forget"
SEED = os.environ.get("FUZZ_HTTP_SEED", "1")


@dataclass
class Fuzzed:
    svc: ServiceProcess
    database_url: str
    redis: RedisServer


@pytest.fixture(scope="module")
def fuzzed(
    pg_cluster: PostgresCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fuzzed]:
    """One service for the module: its own redis-server and database, a token, small limits."""
    name = f"fuzz_http_{os.getpid()}"
    url = pg_cluster.create_database(name)
    with service_on_own_servers(
        pg_cluster,
        tmp_path_factory.mktemp("fuzz-http"),
        name,
        url,
        DEDUP_AUTH_TOKEN=TOKEN,
        DEDUP_MAX_BODY_BYTES=str(MAX_BODY),
        DEDUP_MAX_BATCH_ITEMS=str(MAX_ITEMS),
    ) as (svc, redis_server):
        yield Fuzzed(svc, url, redis_server)


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
    """Every operation, every check, positive and negative data; exit 0 or the report.
    Two runs at once: the forget routes (fewer examples), and every other route."""

    def argv(examples: int, selection: str, report_dir: Path) -> list[str]:
        return [
            str(ROOT / ".venv" / "bin" / "schemathesis"),
            "run",
            f"{fuzzed.svc.url}/openapi.json",
            selection,
            FORGET_PATHS,
            "--checks",
            "all",
            "--max-examples",
            str(examples),
            "--header",
            f"Authorization: Bearer {TOKEN}",
            # One worker: schemathesis's workers are threads, and CPython 3.11 (3.11.7
            # here) can raise a spurious "AST constructor recursion depth mismatch"
            # SystemError when threads build ASTs at once, as hypothesis does while it
            # generates (the reports of it, python/cpython#106905, are from threaded
            # programs; a CI run failed on it). Two runs are two processes: no threads.
            "--workers",
            "1",
            "--seed",
            SEED,
            "--request-timeout",
            "30",
            "--generation-database",
            "none",
            "--no-color",
            "--report",
            "junit",
            "--report-dir",
            str(report_dir),
        ]

    runs = []
    for examples, selection in (
        (MAX_EXAMPLES, "--exclude-path-regex"),
        (FORGET_EXAMPLES, "--include-path-regex"),
    ):
        folder = tmp_path / selection.strip("-")
        folder.mkdir()
        runs.append(
            subprocess.Popen(
                argv(examples, selection, folder),
                cwd=folder,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "NO_COLOR": "1"},
            )
        )
    reports = []
    try:
        for run in runs:
            out, _ = run.communicate(timeout=SCHEMATHESIS_TIMEOUT_S)
            reports.append((run.returncode, out))
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"schemathesis ran over {SCHEMATHESIS_TIMEOUT_S} s") from exc
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.communicate(timeout=30)
    for code, report in reports:
        assert code == 0, report[-20000:]
        assert "No issues found" in report or " passed" in report, report[-5000:]
    # Each run fuzzed its own routes (their JUnit reports name the operations).
    junit = [
        "".join(f.read_text() for f in (tmp_path / selection).glob("*.xml"))
        for selection in ("exclude-path-regex", "include-path-regex")
    ]
    assert "/v1/save" in junit[0] and "/v1/forget" not in junit[0], junit[0][:2000]
    assert "/v1/forget/batch" in junit[1] and "/v1/save" not in junit[1], junit[1][:2000]
    assert fuzzed.svc.proc.poll() is None, "the service died under the fuzz"
    assert TOKEN not in fuzzed.svc.log_text()


# ----------------------------------------------------------------------------- explicit

JSON = {**AUTH, "Content-Type": "application/json"}


def _nest(depth: int) -> Any:
    node: Any = "leaf"
    for _ in range(depth):
        node = [node]
    return node


async def assert_nothing_saved(fuzzed: Fuzzed, kind: str, values: list[str]) -> None:
    """No row of ``kind``, and no Redis key (no lease, no marker) for any of ``values``."""
    assert await count_rows(fuzzed.database_url, kind) == 0
    space = KeySpace("dedup")
    client = aioredis.Redis.from_url(fuzzed.redis.url)
    try:
        assert await client.exists(*(space.key(kind, digest(v)) for v in values)) == 0
    finally:
        await client.aclose()


async def post(
    http: aiohttp.ClientSession, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    status, answer, _ = await request(http, "POST", path, body=body, headers=headers or JSON)
    return status, answer


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xfe",  # not UTF-8 at all
        b"\xc0\xaf",  # an overlong encoding of "/"
        b"\xed\xa0\x80",  # a UTF-16 surrogate encoded as if it were a character (CESU-8)
        b"\xe2\x82",  # a truncated sequence
        b"\x80",  # a lone continuation byte
    ],
)
async def test_invalid_utf8_in_a_string_is_400(
    fuzzed: Fuzzed, http: aiohttp.ClientSession, raw: bytes
) -> None:
    kind = "utf8-" + raw.hex()
    single = b'{"kind": "' + kind.encode() + b'", "value": "a' + raw + b'b"}'
    batch = b'{"items": [{"kind": "' + kind.encode() + b'", "value": "ok"}, ' + single + b"]}"
    for path, body in (("/v1/save", single), ("/v1/save/batch", batch)):
        status, answer = await post(http, path, body)
        assert status == 400, (path, answer)
        assert_error(status, answer, "malformed_json")
    await assert_nothing_saved(fuzzed, kind, ["ok"])


async def test_deep_payloads(fuzzed: Fuzzed, http: aiohttp.ClientSession) -> None:
    # Deeper than the JSON parser goes: not JSON it will read.
    too_deep = b'{"kind": "deep", "value": "a", "payload": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    status, answer = await post(http, "/v1/save", too_deep)
    assert_error(status, answer, "malformed_json")
    assert status == 400
    # Parsed, but deeper than a payload may be (the encoder's bound): 422 on the payload.
    deep = b"[" * 600 + b'"leaf"' + b"]" * 600  # orjson would not even write it
    item_c = b'{"kind": "deep", "value": "c", "payload": ' + deep + b"}"
    for path, body in (
        ("/v1/save", b'{"kind": "deep", "value": "b", "payload": ' + deep + b"}"),
        ("/v1/save/batch", b'{"items": [' + item_c + b"]}"),
    ):
        status, answer = await post(http, path, body)
        error = assert_error(status, answer, "invalid_input")
        assert status == 422 and error["field"] == "payload", answer
    await assert_nothing_saved(fuzzed, "deep", ["a", "b", "c"])
    # Deep but within bounds: saved, and stored as sent.
    status, answer = await post(
        http, "/v1/save", orjson.dumps({"kind": "deep", "value": "d", "payload": _nest(100)})
    )
    assert (status, answer) == (201, {"created": True, "source": "write"})
    conn = await asyncpg.connect(fuzzed.database_url)
    try:
        stored = await conn.fetchval("SELECT payload::text FROM dedup_items WHERE kind = 'deep'")
    finally:
        await conn.close()
    assert orjson.loads(stored) == _nest(100)


async def test_batches_over_the_limits(fuzzed: Fuzzed, http: aiohttp.ClientSession) -> None:
    values = [f"v{i}" for i in range(MAX_ITEMS + 1)]
    items = [{"kind": "huge", "value": v} for v in values]
    status, answer = await post(http, "/v1/save/batch", orjson.dumps({"items": items}))
    error = assert_error(status, answer, "invalid_input")
    assert status == 422 and error["field"] == "items" and str(MAX_ITEMS) in error["message"]
    # Few items, but a body over max_body_bytes: refused before it is parsed.
    fat = [{"kind": "huge", "value": v, "payload": "p" * (MAX_BODY // 4)} for v in values[:5]]
    status, answer = await post(http, "/v1/save/batch", orjson.dumps({"items": fat}))
    assert status == 413
    assert_error(status, answer, "body_too_large")
    # A value over max_value_bytes (the default, 8192 UTF-8 bytes) in the last item.
    last = [*items[:3], {"kind": "huge", "value": "\N{EURO SIGN}" * 2731}]
    status, answer = await post(http, "/v1/save/batch", orjson.dumps({"items": last}))
    error = assert_error(status, answer, "invalid_input")
    assert (status, error["index"], error["field"]) == (422, 3, "value")
    await assert_nothing_saved(fuzzed, "huge", values)


@pytest.mark.parametrize(
    ("path", "body", "field", "index"),
    [
        ("/v1/save", {"kind": "unk", "value": "a", "extra": 1}, "extra", None),
        ("/v1/save", {"kind": "unk", "value": "a", "payload": None, "Kind": "x"}, "Kind", None),
        ("/v1/save/batch", {"items": [{"kind": "unk", "value": "a"}], "extra": []}, "extra", None),
        ("/v1/save/batch", {"item": []}, "item", None),
        (
            "/v1/save/batch",
            {"items": [{"kind": "unk", "value": "a"}, {"kind": "unk", "value": "b", "v": 1}]},
            "v",
            1,
        ),
    ],
)
async def test_unknown_fields_are_422(
    fuzzed: Fuzzed,
    http: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
    field: str,
    index: int | None,
) -> None:
    status, answer = await post(http, path, orjson.dumps(body))
    error = assert_error(status, answer, "invalid_input")
    assert status == 422 and error["field"] == field and error.get("index") == index, answer
    await assert_nothing_saved(fuzzed, "unk", ["a", "b"])


@pytest.mark.parametrize("body", [b"[]", b'"text"', b"1", b"null", b"true", b'[{"kind": "k"}]'])
@pytest.mark.parametrize("path", ["/v1/save", "/v1/save/batch"])
async def test_json_that_is_not_an_object_is_422(
    http: aiohttp.ClientSession, path: str, body: bytes
) -> None:
    status, answer = await post(http, path, body)
    error = assert_error(status, answer, "invalid_input")
    assert status == 422 and error["field"] is None, answer
    # Nor is an item that is not an object.
    items = b'{"items": [{"kind": "k", "value": "v"}, ' + body + b"]}"
    status, answer = await post(http, "/v1/save/batch", items)
    error = assert_error(status, answer, "invalid_input")
    assert (status, error["index"]) == (422, 1), answer
