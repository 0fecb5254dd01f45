"""``dedup serve`` as a real process on a real socket, against real Redis and PostgreSQL.

Every endpoint, every error code, and a property-based fuzz of bodies and headers.
One service process serves this module (with an auth token and small limits);
tests/test_service_ops.py starts its own for shutdown, workers and outages.
The helpers here (``spawn_service``, ``wait_healthy``...) are shared with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gzip
import itertools
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDictProxy

from dedup.service.openapi import ERROR_CODES
from dedup.store.migrate import upgrade
from tests.servers import PostgresCluster, RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "tok-" + secrets.token_hex(12)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DB_PASSWORD = "pw-" + secrets.token_hex(8)  # trust auth ignores it; it must never show up
START_TIMEOUT = 60.0
STOP_TIMEOUT = 90.0
SOURCES = {"local", "inflight", "redis", "db", "write"}
MAX_BODY = 65536
MAX_ITEMS = 50

_db_counter = itertools.count(1)


# ------------------------------------------------------------------------------ helpers


@dataclass
class ServiceProcess:
    """A ``python -m dedup serve`` child in a process group of its own."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        """SIGTERM to the service (the supervisor forwards it to its workers)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = STOP_TIMEOUT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"service did not exit in {timeout} s:\n{self.log_text()}"
            ) from None

    def kill(self) -> None:
        """SIGKILL the whole group this test started (the service and any workers)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> int:
        self.terminate()
        return self.wait()


def service_env(redis_url: str, database_url: str, **extra: str) -> dict[str, str]:
    """The environment of a service child: no DEDUP_* of ours, then the given settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEDUP_")}
    env["DEDUP_REDIS_URL"] = redis_url
    env["DEDUP_DATABASE_URL"] = database_url
    env.update(extra)
    return env


def spawn_service(
    log_dir: Path, env: Mapping[str, str], args: Sequence[str] = (), port: int | None = None
) -> ServiceProcess:
    """Start ``python -m dedup serve --port P *args`` (not waiting for it)."""
    port = free_port() if port is None else port
    log_path = log_dir / f"serve-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dedup", "serve", "--port", str(port), *args],
            cwd=ROOT,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: killpg reaches workers, Ctrl-C does not
        )
    return ServiceProcess(proc, port, log_path)


async def wait_healthy(svc: ServiceProcess, timeout: float = START_TIMEOUT) -> None:
    """Poll /healthz until it answers 200 (bounded); fail early if the process exits."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while True:
            if svc.proc.poll() is not None:
                raise AssertionError(
                    f"service exited with {svc.proc.returncode}:\n{svc.log_text()}"
                )
            try:
                async with http.get(f"{svc.url}/healthz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                svc.kill()
                raise AssertionError(f"no /healthz within {timeout} s:\n{svc.log_text()}")
            await asyncio.sleep(0.05)


async def wait_exit(svc: ServiceProcess, timeout: float = STOP_TIMEOUT) -> int:
    """The exit status, waited for in a thread so the test's loop keeps running."""
    return await asyncio.to_thread(svc.wait, timeout)


def assert_error(status: int, body: Any, code: str) -> dict[str, Any]:
    """``body`` is the documented error shape with ``code``; returns the error object."""
    assert isinstance(body, dict) and set(body) == {"error"}, (status, body)
    error = body["error"]
    assert isinstance(error, dict), body
    assert isinstance(error.get("code"), str) and isinstance(error.get("message"), str), body
    assert error["code"] in ERROR_CODES, body
    assert error["code"] == code, (status, body)
    assert error["message"], body
    return error


async def request(
    http: aiohttp.ClientSession,
    method: str,
    path: str,
    *,
    body: bytes | None = None,
    json: Any = None,
    headers: Mapping[str, str] | None = None,
) -> tuple[int, Any, CIMultiDictProxy[str]]:
    """(status, decoded JSON body, headers); asserts every answer is JSON."""
    all_headers = dict(headers or {})
    data = body
    if json is not None:
        data = orjson.dumps(json)
        all_headers.setdefault("Content-Type", "application/json")
    async with http.request(method, path, data=data, headers=all_headers) as r:
        raw = await r.read()
        if method == "HEAD":
            return r.status, None, r.headers
        assert r.content_type == "application/json", (r.status, r.content_type, raw[:200])
        return r.status, orjson.loads(raw), r.headers


async def rows_for(database_url: str, kind: str) -> dict[str, Any]:
    """value -> payload (decoded) of every row of ``kind``."""
    conn = await asyncpg.connect(database_url)
    try:
        records = await conn.fetch("SELECT value, payload FROM dedup_items WHERE kind = $1", kind)
    finally:
        await conn.close()
    return {
        r["value"]: None if r["payload"] is None else orjson.loads(r["payload"]) for r in records
    }


def migrate_in_thread(url: str) -> None:
    """upgrade() runs its own event loop: keep it off the test's."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(upgrade, url).result(timeout=60)


@contextlib.contextmanager
def service_on_own_servers(
    pg_cluster: PostgresCluster, log_dir: Path, db_name: str, database_url: str, **env: str
) -> Iterator[tuple[ServiceProcess, RedisServer]]:
    """A healthy service on a redis-server of its own and the database ``db_name`` of
    ``pg_cluster`` (created, reached through ``database_url``), migrated first.

    After the block the service must stop cleanly on SIGTERM (exit 0); it is killed
    if it did not stop, and the database is dropped whatever happened.
    """
    try:
        migrate_in_thread(database_url)
        with RedisServer() as redis_server:
            svc = spawn_service(log_dir, service_env(redis_server.url, database_url, **env))
            try:
                asyncio.run(wait_healthy(svc))
                yield svc, redis_server
                assert svc.stop() == 0, svc.log_text()
            finally:
                if svc.proc.poll() is None:
                    svc.kill()
    finally:
        if pg_cluster.is_alive():
            pg_cluster.drop_database(db_name)


# ----------------------------------------------------------------------------- fixtures


@dataclass
class Served:
    svc: ServiceProcess
    database_url: str
    redis: RedisServer


@pytest.fixture(scope="module")
def served(
    pg_cluster: PostgresCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    """One service for the module: its own redis-server and database, a token, small limits."""
    name = f"svc_{os.getpid()}_{next(_db_counter)}"
    pg_cluster.create_database(name)
    url = pg_cluster.url(name).replace("postgres@", f"postgres:{DB_PASSWORD}@")
    with service_on_own_servers(
        pg_cluster,
        tmp_path_factory.mktemp("served"),
        name,
        url,
        DEDUP_AUTH_TOKEN=TOKEN,
        DEDUP_MAX_BODY_BYTES=str(MAX_BODY),
        DEDUP_MAX_BATCH_ITEMS=str(MAX_ITEMS),
        DEDUP_LOG_LEVEL="debug",  # the most verbose log must still hold no secret
        DEDUP_ACCESS_LOG="true",
    ) as (svc, redis_server):
        yield Served(svc, url, redis_server)


@pytest.fixture
async def http(served: Served) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(
        base_url=served.svc.url, timeout=aiohttp.ClientTimeout(total=60)
    ) as session:
        yield session


# -------------------------------------------------------------------------------- save


async def test_save_created_then_duplicate(served: Served, http: aiohttp.ClientSession) -> None:
    item = {"kind": "email", "value": "a@example.com", "payload": {"src": "web", "n": [1, 2]}}
    status, body, _ = await request(http, "POST", "/v1/save", json=item, headers=AUTH)
    assert (status, body) == (201, {"created": True, "source": "write"})
    status, body, _ = await request(http, "POST", "/v1/save", json=item, headers=AUTH)
    assert (status, body) == (200, {"created": False, "source": "local"})
    # charset=utf-8 is JSON's own encoding: accepted; a null payload means none.
    status, body, _ = await request(
        http,
        "POST",
        "/v1/save",
        body=orjson.dumps({"kind": "email", "value": "b@example.com", "payload": None}),
        headers={**AUTH, "Content-Type": "application/json; charset=utf-8"},
    )
    assert status == 201, body
    rows = await rows_for(served.database_url, "email")
    assert rows == {"a@example.com": {"src": "web", "n": [1, 2]}, "b@example.com": None}


async def test_batch_answers_in_order(served: Served, http: aiohttp.ClientSession) -> None:
    await request(http, "POST", "/v1/save", json={"kind": "b", "value": "old"}, headers=AUTH)
    items = [
        {"kind": "b", "value": "new1", "payload": {"i": 1}},
        {"kind": "b", "value": "old"},
        {"kind": "b", "value": "new2"},
        {"kind": "b", "value": "new1"},  # the same value twice in one batch: one writer
    ]
    status, body, _ = await request(
        http, "POST", "/v1/save/batch", json={"items": items}, headers=AUTH
    )
    assert status == 200, body
    results = body["results"]
    assert [r["created"] for r in results] == [True, False, True, False]
    assert results[0]["source"] == "write" and results[2]["source"] == "write"
    assert results[1]["source"] == "local" and results[3]["source"] in {"inflight", "local"}
    assert all(set(r) == {"created", "source"} for r in results)
    assert set(await rows_for(served.database_url, "b")) == {"old", "new1", "new2"}
    status, body, _ = await request(
        http, "POST", "/v1/save/batch", json={"items": []}, headers=AUTH
    )
    assert (status, body) == (200, {"results": []})


async def test_batch_with_one_bad_item_saves_nothing(
    served: Served, http: aiohttp.ClientSession
) -> None:
    items: list[Any] = [{"kind": "bad", "value": f"v{i}"} for i in range(5)]
    for index, bad, field in [
        (3, {"kind": "bad", "value": 7}, "value"),
        (0, {"kind": "", "value": "x"}, "kind"),
        (4, {"kind": "bad", "value": "x", "colour": "red"}, "colour"),
        (2, {"value": "x"}, "kind"),
        (1, ["bad", "x"], None),
        (4, {"kind": "bad", "value": "x" * 8193}, "value"),
        (2, {"kind": "bad", "value": "nul\x00"}, "value"),
    ]:
        batch = [*items[:index], bad, *items[index + 1 :]]
        status, body, _ = await request(
            http, "POST", "/v1/save/batch", json={"items": batch}, headers=AUTH
        )
        error = assert_error(status, body, "invalid_input")
        assert status == 422
        assert (error["index"], error["field"]) == (index, field), error
    assert await rows_for(served.database_url, "bad") == {}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"value": "x"}, "kind"),
        ({"kind": "k"}, "value"),
        ({"kind": "k", "value": "x", "extra": 1}, "extra"),
        ({"kind": 5, "value": "x"}, "kind"),
        ({"kind": "k" * 129, "value": "x"}, "kind"),
        ({"kind": "k\n", "value": "x"}, "kind"),
        ({"kind": "k", "value": None}, "value"),
        ({"kind": "k", "value": ["x"]}, "value"),
        ({"kind": "k", "value": "é" * 4097}, "value"),
        ({"kind": "k", "value": "x", "payload": {"a": "\x00"}}, "payload"),
        (["k", "x"], None),
        ("just a string", None),
    ],
)
async def test_save_invalid_fields_are_422(
    http: aiohttp.ClientSession, body: Any, field: str | None
) -> None:
    status, answer, _ = await request(http, "POST", "/v1/save", json=body, headers=AUTH)
    error = assert_error(status, answer, "invalid_input")
    assert status == 422 and error["field"] == field and "index" not in error, answer


async def test_payload_integers_beyond_64_bits_are_422(
    served: Served, http: aiohttp.ClientSession
) -> None:
    """Refused as by save(), not rounded: orjson alone would read them as floats."""
    json_headers = {**AUTH, "Content-Type": "application/json"}
    too_big = b"123456789012345678901234567890"
    for path, body, index in [
        ("/v1/save", b'{"kind": "bigint", "value": "a", "payload": ' + too_big + b"}", None),
        ("/v1/save", b'{"kind": "bigint", "value": "b", "payload": [18446744073709551616]}', None),
        (
            "/v1/save",
            b'{"kind": "bigint", "value": "c", "payload": {"n": -9223372036854775809}}',
            None,
        ),
        (
            "/v1/save/batch",
            b'{"items": [{"kind": "bigint", "value": "d"}, '
            b'{"kind": "bigint", "value": "e", "payload": ' + too_big + b"}]}",
            1,
        ),
    ]:
        status, answer, _ = await request(http, "POST", path, body=body, headers=json_headers)
        error = assert_error(status, answer, "invalid_input")
        assert status == 422 and error["field"] == "payload", (body, answer)
        assert error.get("index") == index, answer
    assert await rows_for(served.database_url, "bigint") == {}
    # The ends of the 64-bit range are kept exactly; long digit runs in strings are just text.
    edges = {"max": 2**64 - 1, "min": -(2**63), "text": "1" * 40}
    long_value = "9" * 30
    status, answer, _ = await request(
        http,
        "POST",
        "/v1/save",
        json={"kind": "bigint", "value": long_value, "payload": edges},
        headers=AUTH,
    )
    assert (status, answer) == (201, {"created": True, "source": "write"})
    assert await rows_for(served.database_url, "bigint") == {long_value: edges}


async def test_batch_shape_errors(http: aiohttp.ClientSession) -> None:
    item = {"kind": "k", "value": "x"}
    for body, field in [
        ({}, "items"),
        ({"items": item}, "items"),
        ({"items": [item], "more": 1}, "more"),
        ([item], None),
        ({"items": [item] * (MAX_ITEMS + 1)}, "items"),
    ]:
        status, answer, _ = await request(http, "POST", "/v1/save/batch", json=body, headers=AUTH)
        error = assert_error(status, answer, "invalid_input")
        assert status == 422 and error["field"] == field, answer


# ------------------------------------------------------------------------ error codes


@pytest.mark.parametrize("path", ["/v1/save", "/v1/save/batch"])
async def test_protocol_errors(http: aiohttp.ClientSession, path: str) -> None:
    json_headers = {**AUTH, "Content-Type": "application/json"}
    cases: list[tuple[bytes, Mapping[str, str], int, str]] = [
        (b'{"kind": "k", "value": ', json_headers, 400, "malformed_json"),
        (b"", json_headers, 400, "malformed_json"),
        (b'{"kind": "k", "value": "\\ud800"}', json_headers, 400, "malformed_json"),
        (b"\xff\xfe", json_headers, 400, "malformed_json"),
        (
            b'{"kind":"k","value":"x"}',
            {**AUTH, "Content-Type": "text/plain"},
            415,
            "unsupported_media_type",
        ),
        (b'{"kind":"k","value":"x"}', AUTH, 415, "unsupported_media_type"),
        (
            b'{"kind":"k","value":"x"}',
            {**AUTH, "Content-Type": "application/json; charset=latin-1"},
            415,
            "unsupported_media_type",
        ),
        (b" " * (MAX_BODY + 1), json_headers, 413, "body_too_large"),
        (b'{"kind":"k","value":"x"}', {"Content-Type": "application/json"}, 401, "unauthorized"),
        (
            b'{"kind":"k","value":"x"}',
            {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}x"},
            401,
            "unauthorized",
        ),
        (
            b'{"kind":"k","value":"x"}',
            {"Content-Type": "application/json", "Authorization": f"Basic {TOKEN}"},
            401,
            "unauthorized",
        ),
        (
            b'{"kind":"k","value":"x"}',
            {"Content-Type": "application/json", "Authorization": "Bearer"},
            401,
            "unauthorized",
        ),
    ]
    for body, headers, expected, code in cases:
        status, answer, response_headers = await request(
            http, "POST", path, body=body, headers=headers
        )
        assert status == expected, (body[:40], headers, answer)
        assert_error(status, answer, code)
        if status == 401:
            assert response_headers["WWW-Authenticate"].startswith("Bearer")
        assert TOKEN not in orjson.dumps(answer).decode()


async def test_too_large_chunked_body_is_413(http: aiohttp.ClientSession) -> None:
    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the server must count
        for _ in range(MAX_BODY // 1024 + 2):
            yield b" " * 1024

    async with http.post(
        "/v1/save", data=chunks(), headers={**AUTH, "Content-Type": "application/json"}
    ) as r:
        assert r.status == 413
        assert_error(r.status, orjson.loads(await r.read()), "body_too_large")


async def raw_exchange(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` as is on a new connection; the status, headers and body read
    until the server closes it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines)
    return int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body


async def test_requests_the_http_parser_refuses_get_json_errors(
    served: Served, http: aiohttp.ClientSession
) -> None:
    """Requests the HTTP parser refuses before any handler (a bad request line, a
    header line too long, a bad chunk size): the status with the service's JSON error
    body, which quotes none of the request (aiohttp's own answer did, and logged it with
    a traceback: an over-long Authorization header put the token in the log; the last
    test of this module checks the log), counted in the metrics as route "other"."""
    log_start = len(served.svc.log_text())

    async def refused_so_far() -> float:
        async with http.get("/metrics", headers=AUTH) as r:
            found = parse_metrics(await r.text())
        return sum(
            found.get(f'dedup_http_responses_total{{code="{code}",route="other"}}', 0.0)
            for code in (400, 431)
        )

    counted = await refused_so_far()
    too_long = f"Authorization: Bearer {TOKEN}{'a' * 9000}"
    for request, quoted, code in [
        (b"GARBAGE-LINE\r\n\r\n", b"GARBAGE", "malformed_http"),
        (
            f"POST /v1/save HTTP/1.1\r\nHost: x\r\n{too_long}\r\n\r\n".encode(),
            TOKEN.encode(),
            "headers_too_large",
        ),
        (
            b"POST /v1/save HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\n".encode()
            + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
            b"zz",
            "malformed_http",
        ),
    ]:
        status, headers, body = await raw_exchange(served.svc.url, request)
        assert status == {"malformed_http": 400, "headers_too_large": 431}[code], status
        assert headers["content-type"].startswith("application/json"), headers
        assert_error(status, orjson.loads(body), code)
        assert quoted not in body
    assert "Traceback" not in served.svc.log_text()[log_start:]
    assert await refused_so_far() == counted + 3  # counted, as every other response
    async with http.get("/healthz") as r:  # the service is fine
        assert r.status == 200


async def test_compressed_bodies_are_415_without_a_traceback(
    served: Served, http: aiohttp.ClientSession
) -> None:
    """A Content-Encoding is refused before the body is read, and no body is ever
    decompressed: a broken gzip body used to escape as a 500, and aiohttp's drain of an
    unread one (after a 401 too) logged an "Unhandled exception" traceback."""
    log_start = len(served.svc.log_text())
    item = b'{"kind": "gz", "value": "x"}'
    broken = b"not gzip at all"
    json_headers = {"Content-Type": "application/json"}
    for path in ("/v1/save", "/v1/save/batch"):
        for body, encoding in [
            (broken, "gzip"),
            (broken, "deflate"),
            (broken, "br"),
            (gzip.compress(item), "gzip"),  # valid, still refused: nothing decompresses
            (gzip.compress(b" " * 10_000_000), "gzip"),  # a bomb, never inflated
            (zlib.compress(item), "identity, deflate"),
        ]:
            headers = {**AUTH, **json_headers, "Content-Encoding": encoding}
            status, answer, response_headers = await request(
                http, "POST", path, body=body, headers=headers
            )
            assert status == 415, (path, encoding, answer)
            assert_error(status, answer, "unsupported_media_type")
            assert response_headers["Accept-Encoding"] == "identity"
        status, answer, _ = await request(
            http, "POST", path, body=broken, headers={**json_headers, "Content-Encoding": "gzip"}
        )
        assert status == 401, answer
        assert_error(status, answer, "unauthorized")
    # identity is no encoding at all: accepted.
    status, answer, _ = await request(
        http,
        "POST",
        "/v1/save",
        body=item,
        headers={**AUTH, **json_headers, "Content-Encoding": "Identity"},
    )
    assert (status, answer) == (201, {"created": True, "source": "write"})
    # aiohttp drains an unread body after the answer was sent: give it a moment to have
    # logged anything, then look at what this test added to the service's log.
    await asyncio.sleep(0.5)
    await request(http, "GET", "/healthz")
    added = served.svc.log_text()[log_start:]
    for sign in ("Traceback", "Unhandled exception", "internal error", "Error handling"):
        assert sign not in added, added
    assert set(await rows_for(served.database_url, "gz")) == {"x"}


async def test_not_found_and_method_not_allowed(http: aiohttp.ClientSession) -> None:
    for path in ("/", "/v1", "/v1/save/", "/v2/save", "/metrics/x"):
        status, body, _ = await request(http, "GET", path, headers=AUTH)
        assert status == 404, path
        assert_error(status, body, "not_found")
    for method, path in [
        ("GET", "/v1/save"),
        ("PUT", "/v1/save/batch"),
        ("POST", "/healthz"),
        ("DELETE", "/metrics"),
    ]:
        status, body, headers = await request(http, method, path, headers=AUTH)
        assert status == 405, (method, path)
        assert_error(status, body, "method_not_allowed")
        assert headers["Allow"]


# -------------------------------------------------------------------------- endpoints


async def test_healthz_readyz_are_open(served: Served, http: aiohttp.ClientSession) -> None:
    status, body, _ = await request(http, "GET", "/healthz")  # no token needed
    assert status == 200 and body["status"] == "ok" and body["pid"] == served.svc.proc.pid
    status, body, _ = await request(http, "GET", "/readyz")
    assert (status, body) == (
        200,
        {"ready": True, "degraded": False, "checks": {"redis": True, "database": True}},
    )
    status, _, _ = await request(http, "HEAD", "/healthz")
    assert status == 200


_SAMPLE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?P<labels>[a-zA-Z_]+="[^"\\]*"(,[a-zA-Z_]+="[^"\\]*")*)\})?'
    r" (?P<value>[-+]?(\d+(\.\d*)?([eE][-+]?\d+)?|\+Inf|NaN))$"
)


def _canonical_labels(labels: str) -> str:
    """Labels sorted by name, ``le`` bounds written as short numbers (``5``, ``0.5``)."""
    pairs = sorted(tuple(pair.split("=", 1)) for pair in _LABEL.findall(labels))
    out = []
    for name, quoted in pairs:
        if name == "le" and quoted != '"+Inf"':
            bound = float(quoted.strip('"'))
            quoted = f'"{int(bound)}"' if bound.is_integer() else f'"{bound!r}"'
        out.append(f"{name}={quoted}")
    return ",".join(out)


_LABEL = re.compile(r'([a-zA-Z_]+="[^"\\]*")')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format, strictly: every line a comment or a sample; ``name{labels}``
    keys with the labels in name order (see :func:`_canonical_labels`)."""
    samples: dict[str, float] = {}
    typed: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind in {"counter", "gauge", "histogram"} and name not in typed, line
            typed[name] = kind
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        labels = _canonical_labels(match["labels"]) if match["labels"] else ""
        key = match["name"] + (f"{{{labels}}}" if labels else "")
        assert key not in samples, f"duplicate sample {key}"
        base = re.sub(r"_(bucket|sum|count)$", "", match["name"])
        assert match["name"] in typed or base in typed, f"sample without TYPE: {line}"
        samples[key] = float(match["value"])
    return samples


async def test_metrics(served: Served, http: aiohttp.ClientSession) -> None:
    status, _, _ = await request(http, "GET", "/metrics")
    assert status == 401  # the token guards metrics too
    for i in range(3):
        await request(http, "POST", "/v1/save", json={"kind": "m", "value": f"{i}"}, headers=AUTH)
    await request(
        http,
        "POST",
        "/v1/save/batch",
        json={"items": [{"kind": "m", "value": f"{i}"} for i in range(7)]},
        headers=AUTH,
    )
    async with http.get("/metrics", headers=AUTH) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await r.text()
    m = parse_metrics(text)
    assert m['dedup_answers_total{source="write"}'] >= 7
    assert m['dedup_answers_total{source="local"}'] >= 3
    assert m["dedup_redis_round_trips_total"] > 0 and m["dedup_db_statements_total"] > 0
    assert 0 < m["dedup_redis_batches_total"] <= m["dedup_redis_round_trips_total"]
    assert m["dedup_degraded"] == 0 and m["dedup_pending"] == 0
    assert m['dedup_http_responses_total{code="201",route="/v1/save"}'] >= 3
    assert m['dedup_http_batch_items_bucket{le="5"}'] < m['dedup_http_batch_items_bucket{le="10"}']
    assert m['dedup_http_batch_items_bucket{le="+Inf"}'] == m["dedup_http_batch_items_count"]
    count = m['dedup_http_request_duration_seconds_count{route="/v1/save"}']
    assert m['dedup_http_request_duration_seconds_bucket{le="+Inf",route="/v1/save"}'] == count
    buckets = [
        v
        for k, v in m.items()
        if k.startswith("dedup_http_request_duration_seconds_bucket")
        and k.endswith('route="/v1/save"}')
    ]
    assert buckets == sorted(buckets), "histogram buckets must be cumulative"
    assert m["dedup_http_items_total"] >= 10


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


async def test_openapi_describes_every_route_and_error(http: aiohttp.ClientSession) -> None:
    status, doc, _ = await request(http, "GET", "/openapi.json")
    assert status == 200 and doc["openapi"] == "3.1.0"
    assert set(doc["paths"]) == {
        "/v1/save",
        "/v1/save/batch",
        "/v1/forget",
        "/v1/forget/batch",
        "/healthz",
        "/readyz",
        "/metrics",
        "/openapi.json",
    }
    for ref in set(_refs(doc)):  # every $ref resolves inside the document
        node: Any = doc
        for part in ref.removeprefix("#/").split("/"):
            node = node[part]
    save = doc["paths"]["/v1/save"]["post"]
    assert {"200", "201", "400", "401", "413", "415", "422", "429", "503"} <= set(save["responses"])
    batch_schema = doc["components"]["schemas"]["Batch"]["properties"]["items"]
    assert batch_schema["maxItems"] == MAX_ITEMS
    codes = doc["components"]["schemas"]["Error"]["properties"]["error"]["properties"]["code"]
    assert set(codes["enum"]) == set(ERROR_CODES)
    assert TOKEN not in orjson.dumps(doc).decode()


# --------------------------------------------------------------------------------- fuzz

_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
_json = st.recursive(
    _json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
# Each strategy leans towards what passes the earlier checks, so that most examples
# reach the later ones (fields, the Gateway, the database) instead of stopping at 401.
_good_item = st.fixed_dictionaries(
    {"kind": st.sampled_from(["fz", "fz.b"]), "value": st.text(max_size=20)},
    optional={"payload": _json},
)
_kind = st.one_of(st.sampled_from(["fz", "fz.b"]), st.text(max_size=6), _json)
_value = st.one_of(
    st.text(max_size=20),
    st.integers(8185, 8200).map(lambda n: "v" * n),
    _json,
)
_item = st.one_of(
    _good_item,
    _good_item,
    st.fixed_dictionaries({"kind": _kind, "value": _value}, optional={"payload": _json}),
    st.dictionaries(st.sampled_from(["kind", "value", "payload", "x"]), _json, max_size=4),
    _json,
)
_body = st.one_of(
    _item.map(orjson.dumps),
    _item.map(orjson.dumps),
    st.fixed_dictionaries({"items": st.lists(_good_item, max_size=8)}).map(orjson.dumps),
    st.fixed_dictionaries({"items": st.lists(_item, max_size=6)}).map(orjson.dumps),
    st.dictionaries(st.sampled_from(["items", "x"]), _json, max_size=2).map(orjson.dumps),
    st.binary(max_size=64),
    st.just(b" " * (MAX_BODY + 1)),
)
_header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=24)
_content_type = st.one_of(
    st.just("application/json"),
    st.just("application/json"),
    st.just("application/json"),
    st.sampled_from(
        [
            "application/json; charset=utf-8",
            'application/json; charset="UTF-8"',
            "APPLICATION/JSON",
            "application/json; charset=latin-1",
            "text/plain",
            "application/x-www-form-urlencoded",
        ]
    ),
    _header_text,
    st.none(),
)
_authorization = st.one_of(
    st.just(f"Bearer {TOKEN}"),
    st.just(f"Bearer {TOKEN}"),
    st.just(f"Bearer {TOKEN}"),
    st.sampled_from([f"bearer {TOKEN}", f"Bearer  {TOKEN} ", f"Bearer {TOKEN}0", "Bearer ", TOKEN]),
    _header_text,
    st.none(),
)
_path = st.sampled_from(["/v1/save"] * 4 + ["/v1/save/batch"] * 4 + ["/v1/x"])
_method = st.sampled_from(["POST"] * 8 + ["GET", "PUT"])


def _authorized(header: str | None) -> bool:
    if header is None:
        return False
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and given.strip() == TOKEN


def _is_json_type(header: str | None) -> bool:
    if header is None:
        return False
    mime, _, params = header.partition(";")
    if mime.strip().lower() != "application/json":
        return False
    charset = re.search(r"charset=([^;\s]+)", params.lower())
    return charset is None or charset[1].strip('"') in {"utf-8", "utf8"}


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    method=_method,
    path=_path,
    body=_body,
    content_type=_content_type,
    authorization=_authorization,
    extra=_header_text,
)
async def test_fuzz_bodies_and_headers(
    served: Served,
    method: str,
    path: str,
    body: bytes,
    content_type: str | None,
    authorization: str | None,
    extra: str,
) -> None:
    headers = {"X-Fuzz": extra}
    if content_type is not None:
        headers["Content-Type"] = content_type
    if authorization is not None:
        headers["Authorization"] = authorization
    async with (
        aiohttp.ClientSession(
            base_url=served.svc.url, timeout=aiohttp.ClientTimeout(total=60)
        ) as http,
        http.request(method, path, data=body, headers=headers) as r,
    ):
        raw = await r.read()
        status, response_type = r.status, r.content_type
    assert response_type == "application/json", (status, raw[:200])
    answer = orjson.loads(raw)
    event(f"status {status}")  # --hypothesis-show-statistics shows the spread
    assert TOKEN.encode() not in raw and DB_PASSWORD.encode() not in raw

    # The checks come in a fixed order: route, method, token, type, size, JSON, fields.
    if path == "/v1/x":
        expected: int | None = 404
    elif method != "POST":
        expected = 405
    elif not _authorized(authorization):
        expected = 401
    elif not _is_json_type(content_type):
        expected = 415
    elif len(body) > MAX_BODY:
        expected = 413
    else:
        try:
            orjson.loads(body)
            expected = None  # 200, 201 or 422, depending on the fields
        except orjson.JSONDecodeError:
            expected = 400
    if expected is not None:
        assert status == expected, (status, answer)
    else:
        assert status in {200, 201, 422}, (status, answer)

    if status >= 400:
        assert_error(status, answer, {v: k for k, v in _EXPECTED_CODES.items()}[status])
        return
    sent = orjson.loads(body)
    acknowledged: list[tuple[str, str]]
    if path == "/v1/save":
        assert set(answer) == {"created", "source"} and answer["source"] in SOURCES
        assert answer["created"] == (status == 201) == (answer["source"] == "write")
        acknowledged = [(sent["kind"], sent["value"])]
    else:
        assert status == 200 and set(answer) == {"results"}
        assert len(answer["results"]) == len(sent["items"])
        for result in answer["results"]:
            assert set(result) == {"created", "source"} and result["source"] in SOURCES
            assert result["created"] == (result["source"] == "write")
        acknowledged = [(i["kind"], i["value"]) for i in sent["items"]]
    # Nothing acknowledged without its row.
    conn = await asyncpg.connect(served.database_url)
    try:
        found = await conn.fetchval(
            "SELECT count(DISTINCT (d.kind, d.value)) FROM dedup_items d "
            "JOIN unnest($1::text[], $2::text[]) AS a(k, v) ON d.kind = a.k AND d.value = a.v",
            [k for k, _ in acknowledged],
            [v for _, v in acknowledged],
        )
    finally:
        await conn.close()
    assert found == len(set(acknowledged)), acknowledged


_EXPECTED_CODES = {
    "malformed_json": 400,
    "unauthorized": 401,
    "not_found": 404,
    "method_not_allowed": 405,
    "body_too_large": 413,
    "unsupported_media_type": 415,
    "invalid_input": 422,
}


def test_no_secret_in_the_log(served: Served) -> None:
    """Last in the module: by now the service logged requests, errors and debug lines."""
    text = served.svc.log_text()
    assert "serving on http://127.0.0.1" in text
    assert TOKEN not in text and DB_PASSWORD not in text
