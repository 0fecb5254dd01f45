"""The apps that bench/middleware_bench.py serves, each as its users serve it: a handler
that reads the body and answers a constant 201, with or without the framework's
idempotency middleware.

- ASGI: a Starlette app, the Gateway opened in its lifespan, run by uvicorn's command
  line (its defaults: uvloop and httptools when installed)::

      DEDUP_BENCH_GUARDED=1 uvicorn --factory bench.middleware_apps:asgi_app --port 8000

- aiohttp: ``python bench/middleware_apps.py aiohttp PORT`` (``web.run_app``, the Gateway
  in a ``cleanup_ctx``);
- WSGI: a Flask app on gunicorn's ``gthread`` worker, the SyncGateway opened at import
  (in the worker, after the fork)::

      DEDUP_BENCH_GUARDED=1 gunicorn -k gthread --threads 32 bench.middleware_apps:wsgi_app

Configured by environment: ``DEDUP_BENCH_REDIS``, ``DEDUP_BENCH_DATABASE`` (URLs),
``DEDUP_BENCH_GUARDED`` (``1``: with the middleware; ``pass``: behind a pass-through
middleware of the framework's own kind, which only calls the next layer: what any
middleware costs before it does anything), ``DEDUP_BENCH_KIND``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

BODY = b'{"ok":true}'


def _settings() -> tuple[str, str, str, str]:
    """The URLs, ``DEDUP_BENCH_GUARDED`` (``"1"``, ``"pass"``, else bare) and the kind."""
    env = os.environ
    return (
        env["DEDUP_BENCH_REDIS"],
        env["DEDUP_BENCH_DATABASE"],
        env.get("DEDUP_BENCH_GUARDED", "0"),
        env.get("DEDUP_BENCH_KIND", "bench"),
    )


class PassThrough:
    """A pure ASGI middleware that only calls the app (as Starlette's docs write one)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


def asgi_app() -> Any:
    """The Starlette app (a uvicorn ``--factory``)."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    import dedup.asgi
    from dedup import Gateway

    redis_url, db_url, guarded, kind = _settings()
    gw = Gateway(redis_url, db_url)

    async def endpoint(request: Request) -> Response:
        await request.body()
        return Response(BODY, status_code=201, media_type="application/json")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with gw:
            yield

    middleware = []
    if guarded == "1":
        middleware = [Middleware(dedup.asgi.DedupMiddleware, gateway=gw, kind=kind)]
    elif guarded == "pass":
        middleware = [Middleware(PassThrough)]
    return Starlette(
        routes=[Route("/t", endpoint, methods=["POST"])], middleware=middleware, lifespan=lifespan
    )


def _wsgi_app() -> Callable[..., Any]:
    from flask import Flask, Response, request

    import dedup.wsgi
    from dedup import SyncGateway

    redis_url, db_url, guarded, kind = _settings()
    flask = Flask(__name__, root_path=os.path.dirname(os.path.abspath(__file__)))

    def view() -> Response:
        request.get_data()
        return Response(BODY, status=201, mimetype="application/json")

    flask.add_url_rule("/t", "t", view, methods=["POST"])
    if guarded == "pass":
        return lambda environ, start_response: flask(environ, start_response)
    if guarded != "1":
        return flask
    gw = SyncGateway(redis_url, db_url)  # opened in the worker: gunicorn imports after forking
    return dedup.wsgi.DedupMiddleware(flask, gateway=gw, kind=kind)


def __getattr__(name: str) -> Any:
    # gunicorn looks ``wsgi_app`` up in the worker, so the Gateway opens after the fork.
    if name == "wsgi_app":
        app = _wsgi_app()
        globals()["wsgi_app"] = app
        return app
    raise AttributeError(name)


def serve_aiohttp(port: int) -> None:
    """The aiohttp app on aiohttp's own server, as ``web.run_app`` runs it."""
    from aiohttp import web

    import dedup.aiohttp
    from dedup import Gateway

    redis_url, db_url, guarded, kind = _settings()
    gw = Gateway(redis_url, db_url)

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=201, body=BODY, content_type="application/json")

    async def gateway_ctx(app: web.Application) -> AsyncIterator[None]:
        async with gw:
            yield

    @web.middleware
    async def pass_through(request: web.Request, handler: Any) -> web.StreamResponse:
        return await handler(request)  # type: ignore[no-any-return]

    middlewares: list[Any] = []
    if guarded == "1":
        middlewares = [dedup.aiohttp.middleware(gw, kind=kind)]
    elif guarded == "pass":
        middlewares = [pass_through]
    app = web.Application(middlewares=middlewares)
    app.cleanup_ctx.append(gateway_ctx)
    app.router.add_post("/t", handler)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


if __name__ == "__main__":
    if sys.argv[1:2] != ["aiohttp"] or len(sys.argv) != 3:
        sys.exit("usage: middleware_apps.py aiohttp PORT")
    serve_aiohttp(int(sys.argv[2]))
