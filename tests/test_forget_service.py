"""``POST /v1/forget`` and ``POST /v1/forget/batch``: a real ``python -m dedup serve``
process against a real redis-server and PostgreSQL (the helpers of
tests/test_service.py), and the same routes mounted by ``create_app`` in aiohttp.

Each test checks the rows themselves in the database, not only the answers.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from dedup import Gateway
from dedup.service import create_app
from dedup.service.settings import ServiceSettings
from tests.servers import PostgresCluster, RedisServer
from tests.test_service import (
    ServiceProcess,
    assert_error,
    parse_metrics,
    request,
    rows_for,
    service_on_own_servers,
)

TOKEN = "fg-" + secrets.token_hex(12)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {**AUTH, "Content-Type": "application/json"}
MAX_BODY = 16384
MAX_ITEMS = 8
DEADLINE_S = 30.0
FORGET = "/v1/forget"
BATCH = "/v1/forget/batch"


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
    name = f"forget_svc_{os.getpid()}"
    url = pg_cluster.create_database(name)
    with service_on_own_servers(
        pg_cluster,
        tmp_path_factory.mktemp("forget-svc"),
        name,
        url,
        DEDUP_AUTH_TOKEN=TOKEN,
        DEDUP_MAX_BODY_BYTES=str(MAX_BODY),
        DEDUP_MAX_BATCH_ITEMS=str(MAX_ITEMS),
        DEDUP_LOG_LEVEL="debug",  # the most verbose log must still hold no value
        DEDUP_ACCESS_LOG="true",
    ) as (svc, redis_server):
        yield Served(svc, url, redis_server)


@pytest.fixture
async def http(served: Served) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(
        base_url=served.svc.url, timeout=aiohttp.ClientTimeout(total=DEADLINE_S)
    ) as session:
        yield session


async def save(http: aiohttp.ClientSession, kind: str, value: str) -> dict[str, Any]:
    status, body, _ = await request(
        http, "POST", "/v1/save", json={"kind": kind, "value": value}, headers=AUTH
    )
    assert status in (200, 201), body
    assert isinstance(body, dict)
    return body


async def forget(
    http: aiohttp.ClientSession, kind: str, value: str, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    status, body, _ = await request(
        http, "POST", FORGET, json={"kind": kind, "value": value}, headers=headers or AUTH
    )
    return status, body


# ------------------------------------------------------------------------------ forget


async def test_save_forget_then_save_again(served: Served, http: aiohttp.ClientSession) -> None:
    assert await save(http, "fg", "a@example.com") == {"created": True, "source": "write"}
    assert await save(http, "fg", "keep@example.com") == {"created": True, "source": "write"}
    # Known to the service's local tier: answered without the database.
    assert await save(http, "fg", "a@example.com") == {"created": False, "source": "local"}

    assert await forget(http, "fg", "a@example.com") == (200, {"forgotten": True})
    assert set(await rows_for(served.database_url, "fg")) == {"keep@example.com"}
    # Forgotten already: nothing to delete.
    assert await forget(http, "fg", "a@example.com") == (200, {"forgotten": False})
    assert await forget(http, "fg", "never-saved") == (200, {"forgotten": False})
    # Neither the local tier nor Redis remembers it: the next save writes the row again.
    assert await save(http, "fg", "a@example.com") == {"created": True, "source": "write"}
    assert set(await rows_for(served.database_url, "fg")) == {"a@example.com", "keep@example.com"}
    # The kind is part of the key: another kind's row of the same value stays.
    assert await save(http, "fg.other", "keep@example.com") == {"created": True, "source": "write"}
    assert await forget(http, "fg", "keep@example.com") == (200, {"forgotten": True})
    assert set(await rows_for(served.database_url, "fg.other")) == {"keep@example.com"}


async def test_batch_answers_in_order(served: Served, http: aiohttp.ClientSession) -> None:
    for value in ("a", "c", "d"):
        await save(http, "fgb", value)
    items = [
        {"kind": "fgb", "value": "a"},
        {"kind": "fgb", "value": "b"},  # never saved
        {"kind": "fgb", "value": "c"},
        {"kind": "fgb", "value": "a"},  # twice in one batch: one row, deleted once
    ]
    status, body, _ = await request(http, "POST", BATCH, json={"items": items}, headers=AUTH)
    assert status == 200, body
    assert body == {
        "results": [
            {"forgotten": True},
            {"forgotten": False},
            {"forgotten": True},
            {"forgotten": False},
        ]
    }
    assert set(await rows_for(served.database_url, "fgb")) == {"d"}
    status, body, _ = await request(http, "POST", BATCH, json={"items": []}, headers=AUTH)
    assert (status, body) == (200, {"results": []})
    # At the limit exactly: accepted.
    full = [{"kind": "fgb", "value": f"n{i}"} for i in range(MAX_ITEMS)]
    status, body, _ = await request(http, "POST", BATCH, json={"items": full}, headers=AUTH)
    assert (status, body) == (200, {"results": [{"forgotten": False}] * MAX_ITEMS})
    for value in ("a", "c"):
        assert await save(http, "fgb", value) == {"created": True, "source": "write"}


# -------------------------------------------------------------------------------- auth


@pytest.mark.parametrize("path", [FORGET, BATCH])
async def test_token_required(served: Served, http: aiohttp.ClientSession, path: str) -> None:
    await save(http, "fga", "x")
    body = (
        {"kind": "fga", "value": "x"}
        if path == FORGET
        else {"items": [{"kind": "fga", "value": "x"}]}
    )
    for headers in (
        {},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": "Bearer"},
    ):
        status, answer, response_headers = await request(
            http, "POST", path, json=body, headers=headers
        )
        assert status == 401, (headers, answer)
        assert_error(status, answer, "unauthorized")
        assert response_headers["WWW-Authenticate"].startswith("Bearer")
        assert TOKEN not in orjson.dumps(answer).decode()
    assert set(await rows_for(served.database_url, "fga")) == {"x"}  # nothing deleted


# -------------------------------------------------------------------------- bad bodies


@pytest.mark.parametrize("path", [FORGET, BATCH])
async def test_protocol_errors(http: aiohttp.ClientSession, path: str) -> None:
    one = b'{"kind":"k","value":"x"}'
    cases: list[tuple[bytes, dict[str, str], int, str]] = [
        (b'{"kind": "k", "value": ', JSON, 400, "malformed_json"),
        (b"", JSON, 400, "malformed_json"),
        (b"\xff\xfe", JSON, 400, "malformed_json"),
        (one, {**AUTH, "Content-Type": "text/plain"}, 415, "unsupported_media_type"),
        (one, AUTH, 415, "unsupported_media_type"),
        (one, {**JSON, "Content-Encoding": "gzip"}, 415, "unsupported_media_type"),
        (b" " * (MAX_BODY + 1), JSON, 413, "body_too_large"),
    ]
    for body, headers, expected, code in cases:
        status, answer, _ = await request(http, "POST", path, body=body, headers=headers)
        assert status == expected, (body[:40], headers, answer)
        assert_error(status, answer, code)
    status, answer, response_headers = await request(http, "GET", path, headers=AUTH)
    assert_error(status, answer, "method_not_allowed")
    assert (status, response_headers["Allow"]) == (405, "POST")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"value": "x"}, "kind"),
        ({"kind": "fgi"}, "value"),
        ({"kind": "fgi", "value": "x", "payload": None}, "payload"),  # no payload to forget
        ({"kind": "fgi", "value": "x", "extra": 1}, "extra"),
        ({"kind": 5, "value": "x"}, "kind"),
        ({"kind": "", "value": "x"}, "kind"),
        ({"kind": "k" * 129, "value": "x"}, "kind"),
        ({"kind": "k\n", "value": "x"}, "kind"),
        ({"kind": "fgi", "value": None}, "value"),
        ({"kind": "fgi", "value": ["x"]}, "value"),
        ({"kind": "fgi", "value": "nul\x00"}, "value"),
        ({"kind": "fgi", "value": "é" * 4097}, "value"),  # over max_value_bytes (8192)
        (["fgi", "x"], None),
        ("just a string", None),
        (None, None),
    ],
)
async def test_invalid_forget_is_422(
    served: Served, http: aiohttp.ClientSession, body: Any, field: str | None
) -> None:
    await save(http, "fgi", "x")
    raw = orjson.dumps(body)  # request(json=None) would send no body at all
    status, answer, _ = await request(http, "POST", FORGET, body=raw, headers=JSON)
    error = assert_error(status, answer, "invalid_input")
    assert status == 422 and error["field"] == field and "index" not in error, answer
    assert set(await rows_for(served.database_url, "fgi")) == {"x"}


async def test_batch_with_one_bad_item_deletes_nothing(
    served: Served, http: aiohttp.ClientSession
) -> None:
    values = [f"v{i}" for i in range(5)]
    for value in values:
        await save(http, "fgbad", value)
    items: list[Any] = [{"kind": "fgbad", "value": v} for v in values]
    for index, bad, field in [
        (3, {"kind": "fgbad", "value": 7}, "value"),
        (0, {"kind": "", "value": "x"}, "kind"),
        (4, {"kind": "fgbad", "value": "x", "payload": {}}, "payload"),
        (2, {"value": "x"}, "kind"),
        (1, ["fgbad", "x"], None),
        (4, {"kind": "fgbad", "value": "x" * 8193}, "value"),
        (2, {"kind": "fgbad", "value": "nul\x00"}, "value"),
    ]:
        batch = [*items[:index], bad, *items[index + 1 :]]
        status, body, _ = await request(http, "POST", BATCH, json={"items": batch}, headers=AUTH)
        error = assert_error(status, body, "invalid_input")
        assert status == 422
        assert (error["index"], error["field"]) == (index, field), error
    assert set(await rows_for(served.database_url, "fgbad")) == set(values)


async def test_batch_shape_errors(served: Served, http: aiohttp.ClientSession) -> None:
    await save(http, "fgs", "k")
    item = {"kind": "fgs", "value": "k"}
    for body, field in [
        ({}, "items"),
        ({"items": item}, "items"),
        ({"items": [item], "more": 1}, "more"),
        ([item], None),
        ({"items": [item] * (MAX_ITEMS + 1)}, "items"),
    ]:
        status, answer, _ = await request(http, "POST", BATCH, json=body, headers=AUTH)
        error = assert_error(status, answer, "invalid_input")
        assert status == 422 and error["field"] == field, answer
        if isinstance(body, dict) and isinstance(body.get("items"), list) and field == "items":
            assert str(MAX_ITEMS) in error["message"]  # over the limit, which it names
    assert set(await rows_for(served.database_url, "fgs")) == {"k"}


# ------------------------------------------------------------ metrics, openapi, the log


async def test_metrics_count_the_forget_routes(http: aiohttp.ClientSession) -> None:
    await save(http, "fgm", "a")
    await forget(http, "fgm", "a")
    await forget(http, "fgm", "a")
    items = [{"kind": "fgm", "value": "b"}, {"kind": "fgm", "value": "c"}]
    await request(http, "POST", BATCH, json={"items": items}, headers=AUTH)
    await request(http, "POST", FORGET, json={"kind": "fgm"}, headers=AUTH)  # a 422
    async with http.get("/metrics", headers=AUTH) as r:
        assert r.status == 200
        m = parse_metrics(await r.text())
    assert m['dedup_http_responses_total{code="200",route="/v1/forget"}'] >= 2
    assert m['dedup_http_responses_total{code="422",route="/v1/forget"}'] >= 1
    assert m['dedup_http_responses_total{code="200",route="/v1/forget/batch"}'] >= 1
    for route in (FORGET, BATCH):
        count = m[f'dedup_http_request_duration_seconds_count{{route="{route}"}}']
        assert count >= 1
        assert (
            m[f'dedup_http_request_duration_seconds_bucket{{le="+Inf",route="{route}"}}'] == count
        )
    assert m['dedup_http_forget_items_total{result="forgotten"}'] >= 1
    assert m['dedup_http_forget_items_total{result="no_row"}'] >= 3


async def test_openapi_describes_the_forget_routes(http: aiohttp.ClientSession) -> None:
    status, doc, _ = await request(http, "GET", "/openapi.json")
    assert status == 200
    schemas = doc["components"]["schemas"]
    for path, operation, request_schema, result_schema in [
        (FORGET, "forget", "ForgetItem", "ForgetResult"),
        (BATCH, "forgetBatch", "ForgetBatch", "ForgetBatchResult"),
    ]:
        post = doc["paths"][path]["post"]
        assert post["operationId"] == operation
        assert post["security"] == [{"bearer": []}]
        body_ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert body_ref == f"#/components/schemas/{request_schema}"
        ok = post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
        assert ok == f"#/components/schemas/{result_schema}"
        assert {"400", "401", "409", "413", "415", "422", "503"} <= set(post["responses"])
        assert "201" not in post["responses"]
    assert schemas["ForgetItem"]["required"] == ["kind", "value"]
    assert schemas["ForgetItem"]["additionalProperties"] is False
    assert set(schemas["ForgetItem"]["properties"]) == {"kind", "value"}
    assert schemas["ForgetBatch"]["properties"]["items"]["maxItems"] == MAX_ITEMS
    assert schemas["ForgetResult"]["properties"]["forgotten"]["type"] == "boolean"
    codes = schemas["Error"]["properties"]["error"]["properties"]["code"]["enum"]
    assert "cannot_forget" in codes
    assert doc["x-error-codes"]["cannot_forget"].startswith("409")


def test_no_value_in_the_log(served: Served) -> None:
    """Forgotten values are personal data: the service's log (debug, access log) never
    shows one, nor the token."""
    secret_value = "forget-me-" + secrets.token_hex(8)

    async def go() -> None:
        async with aiohttp.ClientSession(
            base_url=served.svc.url, timeout=aiohttp.ClientTimeout(total=DEADLINE_S)
        ) as http:
            await save(http, "fgl", secret_value)
            assert await forget(http, "fgl", secret_value) == (200, {"forgotten": True})
            items = [{"kind": "fgl", "value": secret_value}, {"kind": "fgl", "value": 1}]
            status, _, _ = await request(http, "POST", BATCH, json={"items": items}, headers=AUTH)
            assert status == 422

    asyncio.run(go())
    log = served.svc.log_text()
    # The access log saw the forget (its line is written before the next request is read)...
    assert '"POST /v1/forget HTTP/1.1" 200' in log
    assert secret_value not in log  # ...and never the value
    assert TOKEN not in log


# ------------------------------------------------------------ create_app, cannot forget


async def test_create_app_serves_forget(redis_url: str, pg_url: str) -> None:
    """The aiohttp adapter routes through the same service: forget, batch, auth."""
    settings = ServiceSettings(auth_token=TOKEN, max_batch_items=MAX_ITEMS)
    async with _app(create_app(Gateway(redis_url, pg_url), settings)) as http:
        async with http.post("/v1/save", json={"kind": "fgc", "value": "a"}, headers=AUTH) as r:
            assert r.status == 201
        async with http.post(FORGET, json={"kind": "fgc", "value": "a"}) as r:
            assert (r.status, (await r.json())["error"]["code"]) == (401, "unauthorized")
        async with http.post(FORGET, json={"kind": "fgc", "value": "a"}, headers=AUTH) as r:
            assert (r.status, await r.json()) == (200, {"forgotten": True})
        items = {"items": [{"kind": "fgc", "value": "a"}, {"kind": "fgc", "value": "b"}]}
        async with http.post(BATCH, json=items, headers=AUTH) as r:
            assert (r.status, await r.json()) == (
                200,
                {"results": [{"forgotten": False}, {"forgotten": False}]},
            )
        async with http.post("/v1/save", json={"kind": "fgc", "value": "a"}, headers=AUTH) as r:
            assert (r.status, await r.json()) == (201, {"created": True, "source": "write"})
    assert set(await rows_for(pg_url, "fgc")) == {"a"}


async def test_approximate_mode_cannot_forget_409(redis_url: str, pg_url: str) -> None:
    """A Bloom filter cannot delete a member: 409 cannot_forget, and the row stays."""
    gateway = Gateway(redis_url, pg_url, approximate_values=10_000)
    async with _app(create_app(gateway, ServiceSettings(auth_token=TOKEN))) as http:
        async with http.post("/v1/save", json={"kind": "fgx", "value": "a"}, headers=AUTH) as r:
            assert r.status == 201, await r.text()
        for path, body in [
            (FORGET, {"kind": "fgx", "value": "a"}),
            (BATCH, {"items": [{"kind": "fgx", "value": "a"}]}),
        ]:
            async with http.post(path, json=body, headers=AUTH) as r:
                answer = await r.json()
                error = assert_error(r.status, answer, "cannot_forget")
                assert r.status == 409 and "nothing was deleted" in error["message"], answer
    assert set(await rows_for(pg_url, "fgx")) == {"a"}


class _app:
    """``async with _app(app) as http``: ``app`` served on a free port (its Gateway
    opened at startup, closed at cleanup), and a client session on it."""

    def __init__(self, app: web.Application) -> None:
        self.runner = web.AppRunner(app)
        self.http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> aiohttp.ClientSession:
        await asyncio.wait_for(self.runner.setup(), DEADLINE_S)
        try:
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            port = self.runner.addresses[0][1]
            self.http = aiohttp.ClientSession(
                f"http://127.0.0.1:{port}", timeout=aiohttp.ClientTimeout(total=DEADLINE_S)
            )
        except BaseException:
            await asyncio.wait_for(self.runner.cleanup(), DEADLINE_S)
            raise
        return self.http

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self.http is not None:
                await self.http.close()
        finally:
            await asyncio.wait_for(self.runner.cleanup(), DEADLINE_S)
