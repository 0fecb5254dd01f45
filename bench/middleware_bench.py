"""Requests per second of a trivial handler with and without each idempotency
middleware (dedup.asgi on Starlette/uvicorn, dedup.aiohttp, dedup.wsgi on Flask with
a threading wsgiref server), in one run.

    .venv/bin/python bench/middleware_bench.py [--seconds 3] [--concurrency 64] [--keys 200]

Starts its own redis-server and PostgreSQL (see dedup.testing.servers). Each server runs in a
process of its own (one worker); this process offers the load with aiohttp, a
closed loop of ``--concurrency`` requests in flight for ``--seconds``. Three
workloads per framework:

- ``bare``: no middleware (the baseline);
- ``new``: the middleware, every request a new Idempotency-Key (claim, read of the
  key's row, handler, INSERT of the response, commit; each shared with the requests
  in flight at the time, so ``--concurrency`` decides how much they share);
- ``replay``: the middleware, keys from a pool of ``--keys`` answered once
  beforehand, so every request is a replay (from the middleware's replay cache).

Printed: requests/s per workload and its ratio to ``bare`` of the same framework.
Not a test: figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dedup.store.migrate import upgrade
from dedup.testing.servers import PostgresCluster, RedisServer

FRAMEWORKS = ("asgi", "aiohttp", "wsgi")
_BODY = b'{"ok":true}'


def _serve(framework: str, redis_url: str, pg_url: str, guarded: bool, kind: str, out: Any) -> None:
    """The server process: a trivial POST /t behind the middleware (or not)."""
    asyncio.run(_serve_async(framework, redis_url, pg_url, guarded, kind, out))


async def _serve_async(
    framework: str, redis_url: str, pg_url: str, guarded: bool, kind: str, out: Any
) -> None:
    import socket

    from dedup import Gateway, SyncGateway

    stop = asyncio.Event()
    if framework == "aiohttp":
        from aiohttp import web

        import dedup.aiohttp

        gw = Gateway(redis_url, pg_url)

        async def handler(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(status=201, body=_BODY, content_type="application/json")

        mws = [dedup.aiohttp.middleware(gw, kind=kind)] if guarded else []
        app = web.Application(middlewares=mws)
        app.router.add_post("/t", handler)
        async with gw:
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            out.put(f"http://127.0.0.1:{runner.addresses[0][1]}")
            await stop.wait()
    elif framework == "asgi":
        import uvicorn
        from starlette.applications import Starlette
        from starlette.middleware import Middleware
        from starlette.requests import Request
        from starlette.responses import Response
        from starlette.routing import Route

        import dedup.asgi

        gw = Gateway(redis_url, pg_url)

        async def endpoint(request: Request) -> Response:
            await request.body()
            return Response(_BODY, status_code=201, media_type="application/json")

        mw = [Middleware(dedup.asgi.DedupMiddleware, gateway=gw, kind=kind)] if guarded else []
        asgi_app = Starlette(routes=[Route("/t", endpoint, methods=["POST"])], middleware=mw)
        sock = socket.socket()
        # Inherited by the accepted sockets: without it h11's separate writes of head
        # and body meet the client's delayed ACK (~40 ms a request).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(asgi_app, log_level="warning", access_log=False, http="h11")
        server = uvicorn.Server(config)
        async with gw:
            task = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started:  # noqa: ASYNC110  (uvicorn offers a flag, no event)
                await asyncio.sleep(0.01)
            out.put(f"http://127.0.0.1:{sock.getsockname()[1]}")
            await task
    else:
        from socketserver import ThreadingMixIn
        from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

        from flask import Flask
        from flask import Response as FlaskResponse
        from flask import request as flask_request

        import dedup.wsgi

        class Server(ThreadingMixIn, WSGIServer):
            daemon_threads = True
            # socketserver's listen backlog is 5: past it a connection waits for the
            # client's SYN retransmission (a second or more), so more than a few
            # requests in flight would measure the backlog. Servers' own is larger.
            request_queue_size = 1024

        class Quiet(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

        flask = Flask("bench")

        def view() -> FlaskResponse:
            flask_request.get_data()
            return FlaskResponse(_BODY, status=201, mimetype="application/json")

        flask.add_url_rule("/t", "t", view, methods=["POST"])
        if guarded:
            sync_gw = SyncGateway(redis_url, pg_url)
            flask.wsgi_app = dedup.wsgi.DedupMiddleware(  # type: ignore[method-assign]
                flask.wsgi_app, gateway=sync_gw, kind=kind
            )
        wsgi = make_server("127.0.0.1", 0, flask, server_class=Server, handler_class=Quiet)
        threading.Thread(target=wsgi.serve_forever, daemon=True).start()
        out.put(f"http://127.0.0.1:{wsgi.server_port}")
        await stop.wait()


async def _load(base: str, keys: list[str] | None, seconds: float, concurrency: int) -> float:
    """Requests per second of a closed loop; ``keys`` None: a new key per request."""
    done = 0
    cycle = itertools.cycle(keys) if keys else None
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            key = next(cycle) if cycle is not None else uuid.uuid4().hex
            headers = {"Idempotency-Key": key}
            async with session.post(f"{base}/t", data=b'{"e":1}', headers=headers) as r:
                await r.read()
                if r.status != 201:
                    raise RuntimeError(f"unexpected status {r.status}")

        if keys:  # answer each key once, so the measured requests are replays
            await asyncio.gather(*(one() for _ in keys))
        await asyncio.gather(*(one() for _ in range(concurrency)))  # warm up
        stop_at = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                await one()
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=64)  # as the HTTP benchmarks
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    with RedisServer() as redis_server, PostgresCluster() as pg:
        pg_url = pg.create_database("middleware_bench")
        upgrade(pg_url)
        print(f"{'framework':<10}{'workload':<10}{'req/s':>10}{'x bare':>9}")
        for n, framework in enumerate(args.frameworks.split(",")):
            bare = 0.0
            for workload in ("bare", "new", "replay"):
                out = ctx.Queue()
                kind = f"bench{n}{workload}"
                proc = ctx.Process(
                    target=_serve,
                    args=(framework, redis_server.url, pg_url, workload != "bare", kind, out),
                    daemon=True,
                )
                proc.start()
                try:
                    base = out.get(timeout=60)
                    keys = [f"k{i}" for i in range(args.keys)] if workload == "replay" else None
                    rate = asyncio.run(_load(base, keys, args.seconds, args.concurrency))
                finally:
                    proc.terminate()
                    proc.join(30)
                bare = rate if workload == "bare" else bare
                print(f"{framework:<10}{workload:<10}{rate:>10.0f}{rate / bare:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
