"""Requests per second of each idempotency middleware on the server its users run, with
the bare handler in the same run:

- ``asgi``: Starlette on uvicorn (its defaults: uvloop, httptools), ``dedup.asgi``;
- ``aiohttp``: aiohttp's own server (``web.run_app``), ``dedup.aiohttp``;
- ``wsgi``: Flask on gunicorn's ``gthread`` worker, ``dedup.wsgi``.

    .venv/bin/python bench/middleware_bench.py [--seconds 10] [--frameworks asgi,aiohttp,wsgi]

The apps are bench/middleware_apps.py: a handler that reads the body and answers a constant
201. One app process (one worker), wrk with one thread and ``--connections`` (64)
connections. Four workloads per framework, each against a fresh server:

- ``bare``: no middleware (the baseline), the same requests;
- ``pass``: the bare handler behind a pass-through middleware of the framework's own
  kind (it only calls the next layer): the floor of any middleware on that server;
- ``new``: the middleware, a fresh Idempotency-Key on every request;
- ``replay``: the middleware, keys from a pool of ``--keys`` (1,000) answered once
  beforehand, so every request is a replay.

Printed: requests/s, the ratio to ``bare`` of the same framework, and the app process's
CPU time per request (its user + system time over the measured run). Starts its own
redis-server and PostgreSQL (durable defaults); needs wrk and gunicorn
(``apt install wrk``, ``pip install gunicorn``). Not a test: figures depend on the machine
and on what else runs on it: ``--repeat N`` runs each workload N times and prints the
median (and each run's rate). ``--root`` serves another checkout's dedup; given twice or
more, each workload runs on each checkout in turn (before/after on one box).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from http.client import HTTPConnection
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dedup.store.migrate import upgrade  # noqa: E402
from dedup.testing.servers import PostgresCluster, RedisServer  # noqa: E402

FRAMEWORKS = ("asgi", "aiohttp", "wsgi")
WORKLOADS = ("bare", "pass", "new", "replay")

_GUARDED = {"bare": "0", "pass": "pass"}  # DEDUP_BENCH_GUARDED of each workload (else "1")

# wrk's script: POST /t with a body; an Idempotency-Key from the pool given as arguments
# (``replay``: cycled), else a new one per request (``<run id>-<counter>``).
_WRK_SCRIPT = """
local pool, n, prefix, counter = nil, 0, "", 0
function init(args)
  prefix = args[1]
  if args[2] ~= nil then
    pool = {}
    for i = 0, tonumber(args[2]) - 1 do pool[i + 1] = "k" .. i end
    n = #pool
  end
end
function request()
  counter = counter + 1
  local key
  if pool then key = pool[(counter % n) + 1] else key = prefix .. "-" .. counter end
  return wrk.format("POST", "/t",
    {["Idempotency-Key"] = key, ["Content-Type"] = "application/json"}, '{"e":1}')
end
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _command(framework: str, port: int, threads: int) -> list[str]:
    python = sys.executable
    if framework == "asgi":
        return [python, "-m", "uvicorn", "--factory", "bench.middleware_apps:asgi_app",
                "--host", "127.0.0.1", "--port", str(port), "--no-access-log",
                "--log-level", "warning"]  # fmt: skip
    if framework == "aiohttp":
        return [python, "-m", "bench.middleware_apps", "aiohttp", str(port)]
    return [python, "-m", "gunicorn", "-k", "gthread", "--threads", str(threads), "-w", "1",
            "-b", f"127.0.0.1:{port}", "--log-level", "warning",
            "bench.middleware_apps:wsgi_app"]  # fmt: skip


def _cpu_s(pid: int) -> float:
    """User + system seconds of ``pid`` and its children alive now (gunicorn's worker)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _post(conn: HTTPConnection, key: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    conn.request("POST", "/t", body=b'{"e":1}', headers=headers)
    response = conn.getresponse()
    response.read()
    return response.status


def _wait_ready(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the app exited with {proc.returncode}")
        conn = HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            if _post(conn, None) == 201:
                return
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.1)
    raise RuntimeError("the app did not answer within 60 s")


def _wrk(base: str, script: str, seconds: int, connections: int, args: list[str]) -> float:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", script, f"{base}/t", "--", *args],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
        check=True,
    ).stdout
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    if bad or errors:
        raise RuntimeError(f"wrk saw failed requests:\n{out}")
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]


def _run_one(
    framework: str,
    workload: str,
    env: dict[str, str],
    args: argparse.Namespace,
    script: str,
    root: str,
    tag: str,
) -> tuple[float, float]:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(_command(framework, port, args.wsgi_threads), env=env, cwd=root)
    try:
        _wait_ready(port, proc)
        wrk_args = [uuid.uuid4().hex]
        if workload == "replay":
            wrk_args.append(str(args.keys))
            conn = HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                for i in range(args.keys):  # each key answered once: the run only replays
                    if _post(conn, f"k{i}") != 201:
                        raise RuntimeError("a key's first request was not answered 201")
            finally:
                conn.close()
        _wrk(base, script, 2, args.connections, [f"w{wrk_args[0]}", *wrk_args[1:]])  # warm-up
        profiler = None
        if args.profile:  # py-spy on the app (gunicorn's worker) during the measured run
            target = proc.pid
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            target = int(children[0]) if framework == "wsgi" and children else target
            out = Path(args.profile) / f"{framework}-{workload}{tag}.txt"
            spy = str(Path(sys.executable).parent / "py-spy")
            command = [spy, "record", "--format", "raw", "-r", "200", "-p", str(target)]
            profiler = subprocess.Popen(
                [*command, "-d", str(args.seconds), "-o", str(out)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        before = _cpu_s(proc.pid)
        rate = _wrk(base, script, args.seconds, args.connections, wrk_args)
        if profiler is not None:
            profiler.wait(60)
        cpu_us = (_cpu_s(proc.pid) - before) / (rate * args.seconds) * 1e6
        return rate, cpu_us
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--wsgi-threads", type=int, default=32, help="gunicorn --threads")
    parser.add_argument(
        "--root",
        action="append",
        help="a checkout whose dedup is served (default this one); given twice or more, "
        "each workload runs on each checkout in turn (before/after on one box)",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs of each workload; the median is printed"
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="py-spy the app during each run (collapsed stacks)"
    )
    args = parser.parse_args()
    roots: list[str] = args.root or [str(ROOT)]
    for tool in ("wrk",):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is needed: apt install {tool}")
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as redis, PostgresCluster() as pg:
        script = str(Path(tmp) / "keys.lua")
        Path(script).write_text(_WRK_SCRIPT)
        db_url = pg.create_database("middleware_bench")
        upgrade(db_url)
        if len(roots) > 1:
            for i, root in enumerate(roots):
                print(f"checkout {i}: {root}")
        print(f"{'framework':<10}{'workload':<10}{'req/s':>10}{'x bare':>9}{'CPU us/req':>12}")
        for n, framework in enumerate(args.frameworks.split(",")):
            bare: dict[int, float] = {}
            for workload in args.workloads.split(","):
                runs: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(roots))}
                for rep in range(args.repeat):
                    # The checkouts take turns, so that a slower minute of the box is shared.
                    for i, root in enumerate(roots):
                        env = {
                            **os.environ,
                            "PYTHONPATH": f"{root}{os.pathsep}{ROOT}",
                            "DEDUP_BENCH_REDIS": redis.url,
                            "DEDUP_BENCH_DATABASE": db_url,
                            "DEDUP_BENCH_GUARDED": _GUARDED.get(workload, "1"),
                            "DEDUP_BENCH_KIND": f"b{n}{workload}{uuid.uuid4().hex[:8]}",
                        }
                        tag = (f"-{i}" if len(roots) > 1 else "") + (f"-{rep}" if rep else "")
                        runs[i].append(_run_one(framework, workload, env, args, script, root, tag))
                for i, measured in runs.items():
                    rate = statistics.median(r for r, _ in measured)
                    cpu_us = statistics.median(c for _, c in measured)
                    if workload == "bare":
                        bare[i] = rate
                    ratio = f"{rate / bare[i]:>9.2f}" if i in bare else f"{'':>9}"
                    name = workload if len(roots) == 1 else f"{workload} @{i}"
                    line = f"{framework:<10}{name:<10}{rate:>10.0f}{ratio}{cpu_us:>12.0f}"
                    if args.repeat > 1:
                        line += "   (" + " / ".join(f"{r:.0f}" for r, _ in measured) + ")"
                    print(line, flush=True)


if __name__ == "__main__":
    main()
