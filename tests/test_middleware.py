"""The ingest middlewares with real apps on real servers (aiohttp, Starlette on uvicorn),
requests over real HTTP on 127.0.0.1, Redis and PostgreSQL real too."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import uvicorn
from aiohttp import web
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import dedup.aiohttp
from dedup import Gateway, InvalidInput
from dedup.asgi import DedupMiddleware

DEADLINE_S = 60.0

App = Callable[..., Awaitable[str]]  # build(**middleware options) -> base URL


class Handler:
    """What the apps' handlers do and count: ``/events`` answers ``?status=`` (201 by
    default) after ``?sleep=`` seconds, ``?raise=1`` raises instead."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def run(self, query: dict[str, str], body: bytes) -> int:
        self.calls.append(body.decode())
        await asyncio.sleep(float(query.get("sleep", 0)))
        if query.get("raise"):
            raise RuntimeError("handler failed")
        return int(query.get("status", 201))


@pytest.fixture
def handler() -> Handler:
    return Handler()


@pytest.fixture
async def aiohttp_app(redis_url: str, pg_url: str, handler: Handler) -> AsyncIterator[App]:
    runners: list[web.AppRunner] = []
    gateways: list[Gateway] = []

    async def build(**options: Any) -> str:
        gw = Gateway(redis_url, pg_url)

        async def gateway_ctx(app: web.Application) -> AsyncIterator[None]:
            async with gw:
                yield

        async def events(request: web.Request) -> web.Response:
            status = await handler.run(dict(request.query), await request.read())
            return web.json_response({"ok": True}, status=status)

        app = web.Application(middlewares=[dedup.aiohttp.middleware(gw, **options)])
        app.cleanup_ctx.append(gateway_ctx)
        app.router.add_post("/events", events)
        runner = web.AppRunner(app)
        await runner.setup()
        runners.append(runner)
        gateways.append(gw)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    try:
        yield build
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.fixture
async def asgi_app(redis_url: str, pg_url: str, handler: Handler) -> AsyncIterator[App]:
    servers: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []

    async def build(**options: Any) -> str:
        gw = Gateway(redis_url, pg_url)

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            async with gw:  # the FastAPI/Starlette way: open it in the lifespan
                yield

        async def events(request: Request) -> Response:
            status = await handler.run(dict(request.query_params), await request.body())
            return JSONResponse({"ok": True}, status_code=status)

        app = Starlette(
            routes=[Route("/events", events, methods=["POST"])],
            middleware=[Middleware(DedupMiddleware, gateway=gw, **options)],
            lifespan=lifespan,
        )
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(app, lifespan="on", log_level="warning", ws="none", http="h11")
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        servers.append((server, task))
        async with asyncio.timeout(DEADLINE_S):
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    try:
        yield build
    finally:
        for server, task in servers:
            server.should_exit = True
            await asyncio.wait_for(task, DEADLINE_S)


@pytest.fixture(params=["aiohttp", "asgi"])
def app(request: pytest.FixtureRequest) -> App:
    """Each test runs against both middlewares."""
    built: App = request.getfixturevalue(f"{request.param}_app")
    return built


async def post(
    base: str, key: str | None = None, body: str = "{}", **query: Any
) -> tuple[int, Any, dict[str, str]]:
    headers = {} if key is None else {"Idempotency-Key": key}
    timeout = aiohttp.ClientTimeout(total=DEADLINE_S)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(
            f"{base}/events",
            data=body,
            headers=headers,
            params={k: str(v) for k, v in query.items()},
        ) as r,
    ):
        is_json = r.content_type == "application/json"
        data = await r.json() if is_json else await r.text()
        return r.status, data, dict(r.headers)


async def test_a_key_runs_the_handler_once(app: App, handler: Handler) -> None:
    base = await app()
    status, body, _ = await post(base, "k-1", "first")
    assert (status, body) == (201, {"ok": True})
    status, body, _ = await post(base, "k-1", "second")
    assert (status, body) == (409, {"error": "duplicate", "key": "k-1", "status": 201})
    assert handler.calls == ["first"]
    # Another key, and requests without a key, go through untouched.
    assert (await post(base, "k-2", "third"))[0] == 201
    assert (await post(base, None, "no key"))[0] == 201
    assert (await post(base, None, "no key"))[0] == 201
    assert handler.calls == ["first", "third", "no key", "no key"]


async def test_only_a_2xx_marks_the_key_saved(app: App, handler: Handler) -> None:
    base = await app()
    assert (await post(base, "k", "a", status=500))[0] == 500
    assert (await post(base, "k", "b", status=400))[0] == 400
    assert (await post(base, "k", "c", **{"raise": 1}))[0] == 500  # the handler raised
    assert (await post(base, "k", "d", status=200))[0] == 200
    status, body, _ = await post(base, "k", "e")
    assert (status, body["status"]) == (409, 200)
    assert handler.calls == ["a", "b", "c", "d"]


async def test_concurrent_duplicates_wait_for_the_first(app: App, handler: Handler) -> None:
    base = await app()
    answers = await asyncio.gather(*(post(base, "same", f"r{i}", sleep=0.2) for i in range(8)))
    statuses = sorted(status for status, _, _ in answers)
    assert statuses == [201] + [409] * 7
    assert len(handler.calls) == 1


async def test_options_key_function_and_repeat_response(app: App, handler: Handler) -> None:
    def key(request: Any) -> str | None:
        # aiohttp passes its Request, ASGI the scope: both carry the query string.
        query = request["query_string"] if isinstance(request, dict) else request.query_string
        text = query.decode() if isinstance(query, bytes) else query
        return dict(p.split("=") for p in text.split("&") if p).get("id")

    base = await app(
        kind="orders",
        key=key,
        repeat_status=200,
        repeat_body=lambda k, stored: {"replayed": k, "first": stored},
    )
    assert (await post(base, None, "a", id="o-1"))[0] == 201
    status, body, _ = await post(base, "ignored-header", "b", id="o-1")
    assert (status, body) == (200, {"replayed": "o-1", "first": {"status": 201}})
    assert (await post(base, None, "c"))[0] == 201  # no id: no key, passes through
    assert handler.calls == ["a", "c"]


async def test_a_bad_key_is_a_400(app: App, handler: Handler) -> None:
    base = await app(key=lambda request: "bad\x00key")  # NUL: refused as a value
    status, body, _ = await post(base, None, "a")
    assert status == 400 and body["error"] == "invalid_key"
    assert handler.calls == []


def test_bad_options_are_typed() -> None:
    gw = Gateway("redis://127.0.0.1:1", "postgresql://u@127.0.0.1:1/db")  # never opened
    with pytest.raises(InvalidInput):
        dedup.aiohttp.middleware(gw, kind="")
    with pytest.raises(InvalidInput):
        dedup.aiohttp.middleware(gw, repeat_status=1000)
    with pytest.raises(InvalidInput):
        dedup.aiohttp.middleware("not a gateway")  # type: ignore[arg-type]

    async def inner(scope: Any, receive: Any, send: Any) -> None: ...

    with pytest.raises(InvalidInput):
        DedupMiddleware(inner, gateway=gw, header="")
    with pytest.raises(InvalidInput):
        DedupMiddleware(inner, gateway=gw, key="header")  # type: ignore[arg-type]
