"""Requests/s and items/s of ``dedup serve`` next to bare servers that parse the same
requests and answer a constant, in the same run, with the ratios. A measurement, not a test.

    .venv/bin/python bench/http_bench.py --start                 # throwaway servers, wrk
    .venv/bin/python bench/http_bench.py --start --tool aiohttp  # no wrk: a Python client
    .venv/bin/python bench/http_bench.py --url http://127.0.0.1:8080 --token T

``--start`` launches a throwaway redis-server and PostgreSQL (dedup.testing.servers, as the tests
do), migrates, and runs ``python -m dedup serve --workers W`` on a free port; without it,
``--url`` names a running service (its database gets rows of kind ``http-bench``).

The phases (``--endpoints``): ``healthz``; ``save``, every value new; ``repeat``, saves of
values drawn from a pool of ``--pool`` (10,000) saved beforehand; ``batch`` and
``batch-repeat``, the same with ``--batch`` items a request. With ``--start`` (and
``--baseline``, on by default there) the same phases first run against two bare servers
in processes of their own, each on uvloop, whose handlers read the body, parse it with
orjson, check the fields and answer a constant:

- ``stack``: the service's own HTTP server (dedup.service.http), the same stack as
  ``dedup serve``: the ratio to it is what dedup's work per request costs;
- ``aiohttp``: an aiohttp application, the usual Python HTTP stack.

With wrk (``apt-get install wrk``) the client is C; the ``aiohttp`` client is Python and on
a small machine measures itself as much as the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
KIND = "http-bench"

_WRK_SCRIPT = """
-- one request per call; values unique per (run, thread, counter) unless pool > 0
local endpoint, batch, pool = "%(endpoint)s", %(batch)d, %(pool)d
local run, token = "%(run)s", "%(token)s"
local counter, tid, threads = 0, 0, 0
function setup(thread) thread:set("id", threads); threads = threads + 1 end
function init(args) tid = id or 0 end
local headers = {["Content-Type"] = "application/json"}
if token ~= "" then headers["Authorization"] = "Bearer " .. token end
local function value()
  counter = counter + 1
  if pool > 0 then return string.format("%%s-%%d", run, counter %% pool) end
  return string.format("%%s-%%d-%%d", run, tid, counter)
end
function request()
  if endpoint == "healthz" then return wrk.format("GET", "/healthz") end
  if endpoint == "save" then
    return wrk.format("POST", "/v1/save", headers,
      string.format('{"kind":"%(kind)s","value":"%%s"}', value()))
  end
  local items = {}
  for i = 1, batch do items[i] = string.format('{"kind":"%(kind)s","value":"%%s"}', value()) end
  local body = '{"items":[' .. table.concat(items, ",") .. ']}'
  return wrk.format("POST", "/v1/save/batch", headers, body)
end
"""


@dataclass
class Result:
    """One endpoint's figures."""

    endpoint: str
    requests: int
    seconds: float
    items_per_request: int
    errors: int
    p50_ms: float
    p99_ms: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def items_ps(self) -> float:
        return (self.requests - self.errors) * self.items_per_request / self.seconds


def _ms(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def run_wrk(
    url: str,
    endpoint: str,
    *,
    seconds: int,
    connections: int,
    threads: int,
    batch: int,
    pool: int,
    token: str,
    run: str,
) -> Result:
    """Run wrk once against ``endpoint`` and parse its report; values are
    ``<run>-...`` (the same ``run`` and ``pool`` repeat the same values)."""
    items = {"healthz": 0, "save": 1, "batch": batch}[endpoint]
    script = _WRK_SCRIPT % {
        "endpoint": endpoint,
        "batch": batch,
        "pool": pool,
        "run": run,
        "token": token,
        "kind": KIND,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as f:
        f.write(script)
        f.flush()
        out = subprocess.run(
            [
                "wrk",
                "-t",
                str(threads),
                "-c",
                str(connections),
                "-d",
                f"{seconds}s",
                "--latency",
                "--timeout",
                "30s",
                "-s",
                f.name,
                url,
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=seconds + 60,
        ).stdout
    total = re.search(r"(\d+) requests in ([\d.]+)(\w+)", out)
    assert total is not None, out
    duration = float(total[2]) * {"s": 1.0, "ms": 0.001, "m": 60.0}[total[3]]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    socket_errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out
    )
    errors = int(non2xx[1]) if non2xx else 0
    if socket_errors:
        errors += sum(int(x) for x in socket_errors.groups())
    p50 = re.search(r"^\s+50%\s+(\S+)\s*$", out, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)\s*$", out, re.M)
    assert p50 is not None and p99 is not None, out
    return Result(endpoint, int(total[1]), duration, items, errors, _ms(p50[1]), _ms(p99[1]))


async def run_aiohttp(
    url: str,
    endpoint: str,
    *,
    seconds: int,
    connections: int,
    batch: int,
    pool: int,
    token: str,
    run: str,
) -> Result:
    """A closed loop of ``connections`` clients for ``seconds``, in this process."""
    items = {"healthz": 0, "save": 1, "batch": batch}[endpoint]
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    latencies: list[float] = []
    errors = 0
    counter = 0

    def value() -> str:
        nonlocal counter
        counter += 1
        return f"{run}-{counter % pool}" if pool else f"{run}-{counter}"

    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(url, connector=connector) as http:
        deadline = time.perf_counter() + seconds

        async def client() -> None:
            nonlocal errors
            while time.perf_counter() < deadline:
                if endpoint == "healthz":
                    method, path, body = "GET", "/healthz", None
                elif endpoint == "save":
                    method, path = "POST", "/v1/save"
                    body = orjson.dumps({"kind": KIND, "value": value()})
                else:
                    method, path = "POST", "/v1/save/batch"
                    body = orjson.dumps(
                        {"items": [{"kind": KIND, "value": value()} for _ in range(batch)]}
                    )
                started = time.perf_counter()
                async with http.request(method, path, data=body, headers=headers) as r:
                    await r.read()
                    if r.status >= 300:
                        errors += 1
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(connections)))
        elapsed = time.perf_counter() - started
    cuts = statistics.quantiles(latencies, n=100)
    return Result(endpoint, len(latencies), elapsed, items, errors, cuts[49] * 1e3, cuts[98] * 1e3)


@contextlib.contextmanager
def started_service(workers: int, log_dir: Path) -> Iterator[str]:
    """Throwaway redis-server + PostgreSQL + ``dedup serve``; yields the service URL."""
    sys.path.insert(0, str(ROOT))
    from dedup.store.migrate import upgrade
    from dedup.testing.servers import PostgresCluster, RedisServer, free_port

    with RedisServer() as redis_server, PostgresCluster() as pg:
        pg.create_database("bench")
        database_url = pg.url("bench")
        upgrade(database_url)
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEDUP_")}
        env.update(DEDUP_REDIS_URL=redis_server.url, DEDUP_DATABASE_URL=database_url)
        log = open(log_dir / "serve.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dedup",
                "serve",
                "--port",
                str(port),
                "--workers",
                str(workers),
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            asyncio.run(_wait_ready(url, proc))
            yield url
        finally:
            _stop(proc, timeout_s=60)
            log.close()


def _stop(proc: subprocess.Popen[bytes], *, timeout_s: float) -> None:
    """SIGTERM ``proc`` (a session leader) and wait; SIGKILL its group past ``timeout_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


async def _wait_ready(url: str, proc: subprocess.Popen[bytes], path: str = "/readyz") -> None:
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"{url}: the server exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{url}{path}") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise SystemExit(f"{url} was not ready within 60 s")


# ------------------------------------------------------------------ bare servers

_BARE_HEALTHZ = b'{"status":"ok"}'
_BARE_SAVED = b'{"created":true,"source":"write"}'


def _bare_answer(path: str, body: bytes) -> tuple[int, bytes]:
    """What a bare server answers: the body parsed with orjson, its fields checked, and
    a constant (422 where dedup would refuse the shape)."""
    if path == "/healthz":
        return 200, _BARE_HEALTHZ
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return 400, b"{}"
    if path == "/v1/save":
        good = type(data) is dict and type(data.get("kind")) is str
        return (201, _BARE_SAVED) if good and type(data.get("value")) is str else (422, b"{}")
    items = data.get("items") if type(data) is dict else None
    if type(items) is not list or not all(
        type(i) is dict and type(i.get("kind")) is str and type(i.get("value")) is str
        for i in items
    ):
        return 422, b"{}"
    return 200, b'{"results":[' + b",".join(_BARE_SAVED for _ in items) + b"]}"


def serve_bare(kind: str, port: int) -> None:
    """Serve a bare server (``stack`` or ``aiohttp``) on 127.0.0.1:``port`` until SIGTERM."""
    sys.path.insert(0, str(ROOT))
    import uvloop
    from aiohttp import web

    from dedup.service.http import HttpServer, Request, Response

    paths = {"/healthz": "GET", "/v1/save": "POST", "/v1/save/batch": "POST"}

    class Bare:
        max_body_bytes = 1024 * 1024

        def head(self, request: Request) -> Response | None:
            if paths.get(request.path) != request.method:
                return Response(404, b"{}")
            return None

        def handle(self, request: Request) -> Response:
            return Response(*_bare_answer(request.path, request.body))

        def refuse(self, status: int, code: str, message: str) -> Response:
            return Response(status, b"{}")

        def connection_refused(self) -> None:
            pass

    async def aiohttp_handler(request: web.Request) -> web.Response:
        status, body = _bare_answer(request.path, await request.read())
        return web.Response(status=status, body=body, content_type="application/json")

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        if kind == "stack":
            server = HttpServer(Bare())
            await server.start("127.0.0.1", port)
            await stop.wait()
            await server.drain(1.0)
            return
        app = web.Application()
        for path, method in paths.items():
            app.router.add_route(method, path, aiohttp_handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await stop.wait()
        await runner.cleanup()

    uvloop.run(main())


@contextlib.contextmanager
def started_bare(kind: str) -> Iterator[str]:
    """A bare server in a process of its own; yields its URL."""
    sys.path.insert(0, str(ROOT))
    from dedup.testing.servers import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--bare-server", kind, "--port", str(port)],
        cwd=ROOT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(_wait_ready(url, proc, path="/healthz"))
        yield url
    finally:
        _stop(proc, timeout_s=30)


# -------------------------------------------------------------------------- main

# phase -> (endpoint, uses the pool)
PHASES = {
    "healthz": ("healthz", False),
    "save": ("save", False),
    "repeat": ("save", True),
    "batch": ("batch", False),
    "batch-repeat": ("batch", True),
}
# The ratios printed: (phase, the bare server and phase it is divided by).
RATIOS = [
    ("healthz", ("stack", "healthz")),
    ("healthz", ("aiohttp", "healthz")),
    ("repeat", ("stack", "save")),
    ("repeat", ("aiohttp", "save")),
    ("save", ("stack", "save")),
    ("save", ("aiohttp", "save")),
]


def main() -> int:
    """Parse the flags, run each phase against each server in turn, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running service (default: --start one)")
    parser.add_argument("--start", action="store_true", help="start throwaway servers + service")
    parser.add_argument("--workers", type=int, default=1, help="service workers with --start")
    parser.add_argument("--token", default=os.environ.get("DEDUP_AUTH_TOKEN", ""))
    parser.add_argument("--tool", choices=["wrk", "aiohttp"], default="wrk")
    parser.add_argument("--seconds", type=int, default=6, help="per phase (6)")
    parser.add_argument("--connections", type=int, default=64, help="concurrent connections (64)")
    parser.add_argument("--threads", type=int, default=1, help="wrk threads (1)")
    parser.add_argument("--batch", type=int, default=100, help="items per batch request (100)")
    parser.add_argument("--pool", type=int, default=10_000, help="values of the repeat phases")
    parser.add_argument("--endpoints", default=",".join(PHASES), help="phases to run")
    parser.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also measure the bare servers (default: with --start)",
    )
    parser.add_argument("--bare-server", choices=["stack", "aiohttp"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_server:
        serve_bare(args.bare_server, args.port)
        return 0
    if args.tool == "wrk" and shutil.which("wrk") is None:
        parser.error("wrk not found: apt-get install wrk, or --tool aiohttp")
    if not args.start and not args.url:
        parser.error("give --url of a running service, or --start")
    phases = [p.strip() for p in args.endpoints.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        parser.error(f"unknown phase {unknown[0]!r} (of {', '.join(PHASES)})")
    baseline = args.start if args.baseline is None else args.baseline

    def once(url: str, endpoint: str, seconds: int, pool: int, run: str, token: str) -> Result:
        if args.tool == "wrk":
            return run_wrk(
                url,
                endpoint,
                seconds=seconds,
                connections=args.connections,
                threads=args.threads,
                batch=args.batch,
                pool=pool,
                token=token,
                run=run,
            )
        return asyncio.run(
            run_aiohttp(
                url,
                endpoint,
                seconds=seconds,
                connections=args.connections,
                batch=args.batch,
                pool=pool,
                token=token,
                run=run,
            )
        )

    results: dict[tuple[str, str], Result] = {}

    def measure(server: str, url: str, token: str) -> None:
        for phase in phases:
            endpoint, pooled = PHASES[phase]
            if server != "dedup" and phase not in ("healthz", "save", "batch"):
                continue  # a bare server answers a repeat as it answers a new value
            run = secrets.token_hex(4)
            pool = args.pool if pooled else 0
            if pooled:  # every value of the pool saved once, then the phase is measured
                once(url, endpoint, max(2, args.seconds // 3), pool, run, token)
            result = once(url, endpoint, args.seconds, pool, run, token)
            results[(server, phase)] = result
            print(
                f"{server:<8} {phase:<13} {result.rps:>10,.0f} req/s {result.items_ps:>10,.0f} "
                f"items/s  p50 {result.p50_ms:7.2f} ms  p99 {result.p99_ms:7.2f} ms  "
                f"errors {result.errors}",
                flush=True,
            )

    print(
        f"tool={args.tool} connections={args.connections} threads={args.threads} "
        f"seconds={args.seconds} batch={args.batch} pool={args.pool} workers={args.workers} "
        f"cpus={os.cpu_count()}"
    )
    if baseline:
        for kind in ("stack", "aiohttp"):
            with started_bare(kind) as url:
                measure(kind, url, "")
    if args.start:
        with tempfile.TemporaryDirectory() as tmp, started_service(args.workers, Path(tmp)) as url:
            measure("dedup", url, args.token)
    else:
        measure("dedup", args.url, args.token)
    if baseline:
        print("\nratios (requests/s of dedup's phase / the bare server's phase):")
        for phase, (bare, bare_phase) in RATIOS:
            ours, theirs = results.get(("dedup", phase)), results.get((bare, bare_phase))
            if ours is not None and theirs is not None and theirs.rps:
                print(f"  {phase:<13} / {bare} {bare_phase:<8} {ours.rps / theirs.rps:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
