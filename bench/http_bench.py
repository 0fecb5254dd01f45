"""Requests/s and items/s of ``dedup serve``: /v1/save and /v1/save/batch next to /healthz,
against the same server in the same run. A measurement, not a test.

    .venv/bin/python bench/http_bench.py --start                 # throwaway servers, wrk
    .venv/bin/python bench/http_bench.py --start --tool aiohttp  # no wrk: a Python client
    .venv/bin/python bench/http_bench.py --url http://127.0.0.1:8080 --token T

``--start`` launches a throwaway redis-server and PostgreSQL (dedup.testing.servers, as the tests
do), migrates, and runs ``python -m dedup serve --workers W`` on a free port; without it,
``--url`` names a running service (its database gets rows of kind ``http-bench``).

Every value is new unless ``--pool N`` draws values from N per endpoint (then most answers
come from the local tier). With wrk (``apt-get install wrk``) the client is C; the
``aiohttp`` client is Python and on a small machine measures itself as much as the server.
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
) -> Result:
    """Run wrk once against ``endpoint`` and parse its report."""
    items = {"healthz": 0, "save": 1, "batch": batch}[endpoint]
    script = _WRK_SCRIPT % {
        "endpoint": endpoint,
        "batch": batch,
        "pool": pool,
        "run": secrets.token_hex(4),
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
    url: str, endpoint: str, *, seconds: int, connections: int, batch: int, pool: int, token: str
) -> Result:
    """A closed loop of ``connections`` clients for ``seconds``, in this process."""
    items = {"healthz": 0, "save": 1, "batch": batch}[endpoint]
    run = secrets.token_hex(4)
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
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
            log.close()


async def _wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"dedup serve exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{url}/readyz") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise SystemExit("dedup serve was not ready within 60 s")


def main() -> int:
    """Parse the flags, run each endpoint in turn, print one table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running service (default: --start one)")
    parser.add_argument("--start", action="store_true", help="start throwaway servers + service")
    parser.add_argument("--workers", type=int, default=1, help="service workers with --start")
    parser.add_argument("--token", default=os.environ.get("DEDUP_AUTH_TOKEN", ""))
    parser.add_argument("--tool", choices=["wrk", "aiohttp"], default="wrk")
    parser.add_argument("--seconds", type=int, default=10, help="per endpoint (10)")
    parser.add_argument("--connections", type=int, default=64, help="concurrent connections (64)")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads (2)")
    parser.add_argument("--batch", type=int, default=100, help="items per batch request (100)")
    parser.add_argument("--pool", type=int, default=0, help="values drawn from N (0: all new)")
    parser.add_argument("--endpoints", default="healthz,save,batch")
    args = parser.parse_args()
    if args.tool == "wrk" and shutil.which("wrk") is None:
        parser.error("wrk not found: apt-get install wrk, or --tool aiohttp")
    if not args.start and not args.url:
        parser.error("give --url of a running service, or --start")

    def measure(url: str) -> list[Result]:
        results = []
        for endpoint in args.endpoints.split(","):
            if args.tool == "wrk":
                result = run_wrk(
                    url,
                    endpoint,
                    seconds=args.seconds,
                    connections=args.connections,
                    threads=args.threads,
                    batch=args.batch,
                    pool=args.pool,
                    token=args.token,
                )
            else:
                result = asyncio.run(
                    run_aiohttp(
                        url,
                        endpoint,
                        seconds=args.seconds,
                        connections=args.connections,
                        batch=args.batch,
                        pool=args.pool,
                        token=args.token,
                    )
                )
            print(
                f"{endpoint:<8} {result.rps:>10,.0f} req/s {result.items_ps:>10,.0f} items/s "
                f"p50 {result.p50_ms:7.2f} ms  p99 {result.p99_ms:7.2f} ms  errors {result.errors}",
                flush=True,
            )
            results.append(result)
        return results

    print(
        f"tool={args.tool} connections={args.connections} seconds={args.seconds} "
        f"batch={args.batch} pool={args.pool} workers={args.workers} cpus={os.cpu_count()}"
    )
    if args.start:
        with tempfile.TemporaryDirectory() as tmp, started_service(args.workers, Path(tmp)) as url:
            measure(url)
    else:
        measure(args.url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
