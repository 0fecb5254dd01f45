"""One app, three frameworks, each behind its dedup middleware on a real server:
Starlette on uvicorn (:mod:`dedup.asgi`), aiohttp (:mod:`dedup.aiohttp`) and Flask on
a threading wsgiref server (:mod:`dedup.wsgi` on a SyncGateway).

The handler of ``POST /orders`` (and ``PATCH``/``GET``) does what its query says:

- ``statuses=500,x,201``: its answer on its 1st, 2nd, 3rd... run for this body (the
  last one repeats); ``x`` raises instead of answering;
- ``sleep=S``: sleeps first; ``pad=N``: adds N bytes to the body.

Each run appends one JSON line (``{"body", "pid"}``) to the ``runs`` file, so runs
are counted across processes. The answer's body holds a random ``run`` id, so a
replay is told from a second run by its bytes; it sets ``Location``, ``X-Run`` and
``X-Other``.

``python -m tests.middleware_child`` serves one of them in a process of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import orjson
import uvicorn
from aiohttp import web
from flask import Flask
from flask import Response as FlaskResponse
from flask import request as flask_request
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import dedup.aiohttp
import dedup.asgi
import dedup.wsgi
from dedup import Gateway, SyncGateway

FRAMEWORKS = ("asgi", "aiohttp", "wsgi")
START_TIMEOUT_S = 60.0
METHODS = ["GET", "POST", "PATCH"]


@dataclass(frozen=True)
class Plan:
    """What one run of the handler does."""

    sleep_s: float
    status: int | None  # None: raise
    headers: list[tuple[str, str]]
    body: bytes


def count_runs(runs: Path, body: str | None = None) -> int:
    """Runs recorded in ``runs`` (of requests with ``body``, or all)."""
    if not runs.exists():
        return 0
    lines = [orjson.loads(line) for line in runs.read_bytes().splitlines() if line]
    return sum(1 for line in lines if body is None or line["body"] == body)


def plan(runs: Path, query: dict[str, str], body: bytes) -> Plan:
    """Record this run and say what it answers."""
    text = body.decode()
    before = count_runs(runs, text)
    fd = os.open(runs, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, orjson.dumps({"body": text, "pid": os.getpid()}) + b"\n")
    finally:
        os.close(fd)
    statuses = query.get("statuses", "201").split(",")
    chosen = statuses[min(before, len(statuses) - 1)]
    run = uuid.uuid4().hex
    answer = {"run": run, "got": text, "pad": "x" * int(query.get("pad", 0))}
    headers = [
        ("Content-Type", "application/json"),
        ("Location", f"/orders/{run}"),
        ("X-Run", run),
        ("X-Other", "not kept"),
    ]
    status = None if chosen == "x" else int(chosen)
    return Plan(float(query.get("sleep", 0)), status, headers, orjson.dumps(answer))


Close = Callable[[], Awaitable[None]]


async def serve(
    framework: str, redis_url: str, pg_url: str, runs: Path, options: dict[str, Any]
) -> tuple[str, Close]:
    """Serve the app of ``framework`` behind its middleware (``options``) on 127.0.0.1;
    return its base URL and a coroutine function that stops it."""
    builder = {"asgi": _serve_asgi, "aiohttp": _serve_aiohttp, "wsgi": _serve_wsgi}[framework]
    return await builder(redis_url, pg_url, runs, options)


async def _serve_aiohttp(
    redis_url: str, pg_url: str, runs: Path, options: dict[str, Any]
) -> tuple[str, Close]:
    gw = Gateway(redis_url, pg_url)

    async def gateway_ctx(app: web.Application) -> AsyncIterator[None]:
        async with gw:
            yield

    async def orders(request: web.Request) -> web.Response:
        todo = plan(runs, dict(request.query), await request.read())
        await asyncio.sleep(todo.sleep_s)
        if todo.status is None:
            raise RuntimeError("the handler failed")
        return web.Response(status=todo.status, body=todo.body, headers=todo.headers)

    app = web.Application(middlewares=[dedup.aiohttp.middleware(gw, **options)])
    app.cleanup_ctx.append(gateway_ctx)
    for method in METHODS:
        app.router.add_route(method, "/orders", orders)
        app.router.add_route(method, "/other", orders)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return f"http://127.0.0.1:{port}", runner.cleanup


async def _serve_asgi(
    redis_url: str, pg_url: str, runs: Path, options: dict[str, Any]
) -> tuple[str, Close]:
    gw = Gateway(redis_url, pg_url)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with gw:  # the FastAPI/Starlette way: open it in the lifespan
            yield

    async def orders(request: Request) -> Response:
        todo = plan(runs, dict(request.query_params), await request.body())
        await asyncio.sleep(todo.sleep_s)
        if todo.status is None:
            raise RuntimeError("the handler failed")
        response = Response(todo.body, status_code=todo.status)
        for name, value in todo.headers:
            response.headers[name] = value
        return response

    app = Starlette(
        routes=[
            Route("/orders", orders, methods=METHODS),
            Route("/other", orders, methods=METHODS),
        ],
        middleware=[Middleware(dedup.asgi.DedupMiddleware, gateway=gw, **options)],
        lifespan=lifespan,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms delayed-ACK stalls
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, lifespan="on", log_level="warning", ws="none", http="h11")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    async with asyncio.timeout(START_TIMEOUT_S):
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)

    async def close() -> None:
        server.should_exit = True
        await asyncio.wait_for(task, START_TIMEOUT_S)
        sock.close()

    return f"http://127.0.0.1:{sock.getsockname()[1]}", close


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def flask_app(runs: Path) -> Flask:
    """The Flask app (without the middleware)."""
    app = Flask("orders")

    def orders() -> FlaskResponse:
        todo = plan(runs, dict(flask_request.args), flask_request.get_data())
        time.sleep(todo.sleep_s)
        if todo.status is None:
            raise RuntimeError("the handler failed")
        return FlaskResponse(todo.body, status=todo.status, headers=todo.headers)

    app.add_url_rule("/orders", "orders", orders, methods=METHODS)
    app.add_url_rule("/other", "other", orders, methods=METHODS)
    return app


async def _serve_wsgi(
    redis_url: str, pg_url: str, runs: Path, options: dict[str, Any]
) -> tuple[str, Close]:
    gw = await asyncio.to_thread(SyncGateway, redis_url, pg_url)
    app = flask_app(runs)
    app.wsgi_app = dedup.wsgi.DedupMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, gateway=gw, **options
    )
    server = make_server(
        "127.0.0.1", 0, app, server_class=_ThreadingWSGIServer, handler_class=_QuietHandler
    )
    thread = threading.Thread(target=server.serve_forever, name="wsgi-server", daemon=True)
    thread.start()

    async def close() -> None:
        await asyncio.to_thread(server.shutdown)
        server.server_close()
        await asyncio.to_thread(thread.join, START_TIMEOUT_S)
        await asyncio.to_thread(gw.close)

    return f"http://127.0.0.1:{server.server_port}", close
