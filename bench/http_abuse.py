"""How one adversarial client affects one ``dedup serve`` worker. A measurement, not a test.

    .venv/bin/python bench/http_abuse.py                       # this checkout's dedup
    .venv/bin/python bench/http_abuse.py --root /tmp/before    # another tree's dedup
    .venv/bin/python bench/http_abuse.py --only upgrade,tracebacks

It starts a throwaway redis-server and PostgreSQL (dedup.testing.servers, as the tests
do), migrates (``python -m dedup migrate``), and for each measurement a fresh
``python -m dedup serve --workers 1`` on a free port, with ``PYTHONPATH=<root>`` and
``cwd=<root>``: the service runs the ``dedup`` package of ``--root`` (default: the
checkout this script is in), which is printed (``dedup.__file__`` as that environment
imports it, and the service's cwd and PYTHONPATH read from /proc). No setting besides
DEDUP_REDIS_URL, DEDUP_DATABASE_URL, DEDUP_HOST and DEDUP_PORT is passed.

The measurements (``--only NAME[,NAME]``), each bounded in time:

- ``rss-openapi``, ``rss-healthz``: one connection pipelines ``GET /openapi.json`` (or
  ``/healthz``) in 64 KB blocks and never reads, for up to ``--rss-seconds`` (30) or until
  the socket accepts nothing for 3 s (or the worker passes ``--rss-cap-mb``, a guard for
  the machine); the worker's VmRSS before, at its peak, 2 s after the client closed, and
  once the worker is idle again (it may still be answering what it had read).
- ``latency-reading``, ``latency-not-reading``: the same adversary on ``/healthz`` for 10 s
  (in a process of its own), its answers read and dropped by a thread, or never read;
  meanwhile a second connection sends one ``GET /healthz`` at a time, 20 ms apart (10 s
  timeout each): its median, p99, max and timeouts, and its median before, idle.
- ``slow-heads``: 300 connections each send ``POST /v1/save HTTP/1.1`` and then one byte
  of a header name every 5 s; how many are open at a third, two thirds and the end of
  ``--slow-seconds`` (90), and what the closed ones received.
- ``upgrade``: an h2c upgrade, a CONNECT, and a POST with ``Upgrade: websocket`` followed
  by a pipelined GET, each on a fresh connection: the statuses answered.
- ``tracebacks``: a ``Connection: close`` request with another pipelined behind it
  (HTTP/1.1 and 1.0), and SIGTERM while 50 pipelined saves of new values are in flight
  (right after sending them, and after their first answer, each on a service of its
  own); the Traceback, ERROR and "Task exception was never retrieved" lines each caused,
  and those lines over every service of the run.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import re
import secrets
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import psutil  # type: ignore[import-untyped]  # no stubs in the venv

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
MB = 1024 * 1024
BLOCK = 64 * 1024
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 45.0  # over the service's default drain_timeout_s (30)

MEASUREMENTS = (
    "rss-openapi",
    "rss-healthz",
    "latency-reading",
    "latency-not-reading",
    "slow-heads",
    "upgrade",
    "tracebacks",
)

_STATUS_LINE = re.compile(rb"HTTP/\d\.\d (\d{3})[^\r\n]*\r\n")


def request(path: str, version: str = "1.1", extra: str = "") -> bytes:
    """A bodiless GET of ``path`` with ``Host: x`` and ``extra`` header lines."""
    return f"GET {path} HTTP/{version}\r\nHost: x\r\n{extra}\r\n".encode()


def pipelined_block(one: bytes, size: int = BLOCK) -> bytes:
    """As many whole copies of ``one`` as fit in ``size`` bytes."""
    return one * max(1, size // len(one))


# --------------------------------------------------------------------- the service


@dataclass
class Stderr:
    """What a service wrote that matters here, counted from its log."""

    tracebacks: int = 0
    errors: int = 0
    never_retrieved: int = 0

    @classmethod
    def of(cls, text: str) -> Stderr:
        return cls(
            tracebacks=text.count("Traceback"),
            errors=len(re.findall(r"^.*\bERROR\b.*$", text, re.M)),
            never_retrieved=text.count("Task exception was never retrieved"),
        )

    def __add__(self, other: Stderr) -> Stderr:
        return Stderr(
            self.tracebacks + other.tracebacks,
            self.errors + other.errors,
            self.never_retrieved + other.never_retrieved,
        )

    def __sub__(self, other: Stderr) -> Stderr:
        return Stderr(
            self.tracebacks - other.tracebacks,
            self.errors - other.errors,
            self.never_retrieved - other.never_retrieved,
        )

    def __str__(self) -> str:
        return (
            f"Traceback {self.tracebacks}, ERROR {self.errors}, "
            f"never-retrieved {self.never_retrieved}"
        )


@dataclass
class Backends:
    """The throwaway servers every service of the run uses, and where logs go."""

    root: Path
    redis_url: str
    database_url: str
    log_dir: Path
    services: list[Service] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        """The service's environment: no DEDUP_* but ours; PYTHONPATH is ``root``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEDUP_")}
        env.update(
            PYTHONPATH=str(self.root),
            DEDUP_REDIS_URL=self.redis_url,
            DEDUP_DATABASE_URL=self.database_url,
        )
        return env


class Service:
    """One ``python -m dedup serve --workers 1`` of ``backends.root``, on a free port."""

    def __init__(self, backends: Backends, name: str) -> None:
        from dedup.testing.servers import free_port

        self.name = name
        self.port = free_port()
        self.log_path = backends.log_dir / f"{name}.log"
        env = backends.env()
        env.update(DEDUP_HOST=HOST, DEDUP_PORT=str(self.port))
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dedup", "serve", "--workers", "1"],
            cwd=backends.root,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        backends.services.append(self)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.worker_pid = self._find_worker()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name}: the service exited with {self.proc.returncode}")
            with contextlib.suppress(OSError):
                got, _ = exchange(request("/readyz"), port=self.port, timeout_s=1.0, linger_s=0)
                if statuses(got) == [200]:
                    return
            time.sleep(0.1)
        raise SystemExit(f"{self.name}: not ready within {START_TIMEOUT_S} s\n{self.log_text()}")

    def _find_worker(self) -> int:
        """The process serving: the service itself, or its child if it forked one."""
        with contextlib.suppress(psutil.Error):
            children = psutil.Process(self.proc.pid).children()
            workers = [c for c in children if "python" in c.name().lower()]
            if workers:
                return int(workers[0].pid)
        return self.proc.pid

    def rss_mb(self) -> float:
        """The worker's VmRSS (0 when it is gone)."""
        try:
            status = Path(f"/proc/{self.worker_pid}/status").read_text()
        except OSError:
            return 0.0
        found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        return int(found[1]) / 1024 if found else 0.0

    def proc_facts(self) -> tuple[str, str]:
        """The service's cwd and PYTHONPATH, as /proc says."""
        cwd = os.readlink(f"/proc/{self.proc.pid}/cwd")
        environ = Path(f"/proc/{self.proc.pid}/environ").read_bytes().split(b"\0")
        pythonpath = next(
            (e[len(b"PYTHONPATH=") :].decode() for e in environ if e.startswith(b"PYTHONPATH=")),
            "",
        )
        return cwd, pythonpath

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def stderr(self) -> Stderr:
        return Stderr.of(self.log_text())

    def terminate(self, timeout_s: float = STOP_TIMEOUT_S) -> tuple[int | None, float]:
        """SIGTERM (by PID) and wait up to ``timeout_s``: (exit status or None, seconds)."""
        started = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
        return self.proc.poll(), time.monotonic() - started

    def stop(self) -> None:
        """SIGTERM, then SIGKILL of its own process group past the timeout."""
        status, _ = self.terminate()
        if status is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._log.close()


@contextlib.contextmanager
def service(backends: Backends, name: str) -> Iterator[Service]:
    """A fresh service for one measurement, stopped after it."""
    svc = Service(backends, name)
    try:
        yield svc
    finally:
        svc.stop()


@contextlib.contextmanager
def started_backends(root: Path, log_dir: Path) -> Iterator[Backends]:
    """A throwaway redis-server and PostgreSQL, migrated by ``root``'s dedup."""
    from dedup.testing.servers import PostgresCluster, RedisServer

    with RedisServer() as redis_server, PostgresCluster() as pg:
        pg.create_database("abuse")
        backends = Backends(root, redis_server.url, pg.url("abuse"), log_dir)
        subprocess.run(
            [sys.executable, "-m", "dedup", "migrate"],
            cwd=root,
            env=backends.env(),
            check=True,
            capture_output=True,
            timeout=120,
        )
        yield backends


def imported_dedup(root: Path) -> str:
    """``dedup.__file__`` as the service's environment imports it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEDUP_")}
    env["PYTHONPATH"] = str(root)
    out = subprocess.run(
        [sys.executable, "-c", "import dedup.service.http as h; print(h.__file__)"],
        cwd=root,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip()


# ---------------------------------------------------------------------- the clients


def connect(port: int, timeout_s: float = 5.0) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def responses(data: bytes) -> list[tuple[int, bytes]]:
    """The (status, body) of the answers in ``data``, read one after the other by their
    Content-Length (a 1xx has no body)."""
    found: list[tuple[int, bytes]] = []
    at = 0
    while True:
        line = _STATUS_LINE.match(data, at)
        end = data.find(b"\r\n\r\n", at)
        if line is None or end < 0:
            return found
        status = int(line[1])
        length = re.search(rb"\r\ncontent-length:\s*(\d+)", data[at : end + 2], re.I)
        size = int(length[1]) if length and status >= 200 else 0
        found.append((status, data[end + 4 : end + 4 + size]))
        at = end + 4 + size


def statuses(data: bytes) -> list[int]:
    """The statuses of the answers in ``data``."""
    return [status for status, _ in responses(data)]


def answers(data: bytes) -> str:
    """The answers in ``data`` as ``200, 400 malformed_http``: status and error code."""
    out = []
    for status, body in responses(data):
        code = re.search(rb'"code":"([^"]*)"', body)
        out.append(f"{status} {code[1].decode()}" if code else str(status))
    return "[" + ", ".join(out) + "]"


def read_until_quiet(
    sock: socket.socket, quiet_s: float, limit_s: float = 30.0
) -> tuple[bytes, str]:
    """Read until the peer closes (``closed``), resets (``reset``) or ``quiet_s`` of
    silence (``open``)."""
    chunks: list[bytes] = []
    deadline = time.monotonic() + limit_s
    sock.settimeout(quiet_s)
    how = "open"
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionError:
            how = "reset"
            break
        if not chunk:
            how = "closed"
            break
        chunks.append(chunk)
    return b"".join(chunks), how


def exchange(
    data: bytes, *, port: int, timeout_s: float = 5.0, linger_s: float = 2.0
) -> tuple[bytes, str]:
    """Send ``data`` on a fresh connection, read until closed or ``linger_s`` of silence
    (at least the first answer, within ``timeout_s``): what came, and how it ended."""
    sock = connect(port, timeout_s)
    with sock:
        sock.sendall(data)
        sock.settimeout(timeout_s)
        first = b""
        with contextlib.suppress(TimeoutError, ConnectionError):
            first = sock.recv(65536)
        if not first:
            return b"", "closed"
        rest, how = read_until_quiet(sock, linger_s) if linger_s else (b"", "open")
        return first + rest, how


def read_response(sock: socket.socket, pending: bytearray) -> int:
    """Read one whole answer from ``sock`` (bytes past it stay in ``pending``): its status."""
    while b"\r\n\r\n" not in pending:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        pending += chunk
    end = pending.index(b"\r\n\r\n") + 4
    head = bytes(pending[:end])
    line = _STATUS_LINE.match(head)
    if line is None:
        raise ConnectionError(f"not an answer: {head[:40]!r}")
    length = re.search(rb"\r\ncontent-length:\s*(\d+)", head, re.I)
    total = end + (int(length[1]) if length else 0)
    while len(pending) < total:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        pending += chunk
    del pending[:total]
    return int(line[1])


@dataclass
class Push:
    """What an adversary's sending did."""

    sent: int = 0
    seconds: float = 0.0
    ended: str = "time"


def push(
    sock: socket.socket,
    block: bytes,
    *,
    seconds: float,
    stall_s: float,
    stop: Callable[[], str | None] = lambda: None,
) -> Push:
    """Send ``block`` again and again on ``sock`` (made non-blocking) for ``seconds``,
    until nothing is accepted for ``stall_s`` (``stalled``), the peer is gone (``reset``)
    or ``stop()`` names a reason."""
    sock.setblocking(False)
    result = Push()
    started = time.monotonic()
    deadline = started + seconds
    last_progress = started
    view = memoryview(block)
    offset = 0
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_WRITE)
        while (now := time.monotonic()) < deadline:
            reason = stop()
            if reason is not None:
                result.ended = reason
                break
            if now - last_progress > stall_s:
                result.ended = "stalled"
                break
            if not selector.select(0.05):
                continue
            try:
                n = sock.send(view[offset:])
            except BlockingIOError:
                continue
            except OSError:
                result.ended = "reset"
                break
            result.sent += n
            offset = (offset + n) % len(block)
            last_progress = time.monotonic()
    result.seconds = time.monotonic() - started
    return result


def drain_reader(sock: socket.socket, stop: threading.Event) -> Callable[[], int]:
    """A thread reading and dropping what ``sock`` receives until ``stop``; returns a
    function giving the bytes read so far."""
    read = [0]

    def run() -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(sock, selectors.EVENT_READ)
            while not stop.is_set():
                if not selector.select(0.1):
                    continue
                try:
                    chunk = sock.recv(1 << 20)
                except BlockingIOError:
                    continue
                except OSError:
                    return
                if not chunk:
                    return
                read[0] += len(chunk)

    threading.Thread(target=run, name="adversary-reader", daemon=True).start()
    return lambda: read[0]


def settle(svc: Service, limit_s: float = 60.0) -> tuple[float, float]:
    """Wait (up to ``limit_s``) until the worker uses under 5 % of a CPU over half a
    second: (seconds waited, counting the 2 s already waited, and its RSS then)."""
    started = time.monotonic()
    try:
        worker = psutil.Process(svc.worker_pid)
        while time.monotonic() - started < limit_s:
            if worker.cpu_percent(interval=0.5) < 5.0:
                break
    except psutil.Error:
        pass
    return 2.0 + time.monotonic() - started, svc.rss_mb()


class PeakRss:
    """The worker's VmRSS sampled every 50 ms in a thread, while in the ``with`` block."""

    def __init__(self, svc: Service) -> None:
        self._svc = svc
        self.peak = 0.0
        self.last = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.last = self._svc.rss_mb()
            self.peak = max(self.peak, self.last)
            self._stop.wait(0.05)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def probe_healthz(port: int) -> str:
    """One ``GET /healthz`` on a fresh connection after a measurement: ok, or what failed."""
    try:
        got, _ = exchange(request("/healthz"), port=port, timeout_s=5.0, linger_s=0.0)
    except OSError as exc:
        return f"failed ({type(exc).__name__})"
    return "ok" if statuses(got) == [200] else f"answered {answers(got)}"


# -------------------------------------------------------------------- measurements

Row = tuple[str, str]


def measure_rss(svc: Service, path: str, args: argparse.Namespace) -> list[Row]:
    """Pipeline GETs of ``path`` on one connection that never reads; the worker's RSS."""
    time.sleep(0.5)
    before = svc.rss_mb()
    cap = float(args.rss_cap_mb)
    sock = connect(svc.port)
    with PeakRss(svc) as rss:
        result = push(
            sock,
            pipelined_block(request(path)),
            seconds=args.rss_seconds,
            stall_s=3.0,
            stop=lambda: "rss-cap" if rss.last > cap else None,
        )
        sock.close()
        time.sleep(2.0)
    after = svc.rss_mb()
    settled_s, settled = settle(svc)
    name = f"rss-{path.strip('/').split('.')[0]}"
    return [
        (
            name,
            f"RSS before {before:.0f} MB, peak {rss.peak:.0f} MB (+{rss.peak - before:.0f}), "
            f"2 s after close {after:.0f} MB (+{after - before:.0f}), "
            f"idle again {settled_s:.0f} s after close: {settled:.0f} MB (+{settled - before:.0f})",
        ),
        (
            f"{name} client",
            f"sent {result.sent / MB:.0f} MB ({result.sent // len(request(path))} requests) "
            f"in {result.seconds:.1f} s, ended: {result.ended}; "
            f"then /healthz {probe_healthz(svc.port)}",
        ),
    ]


def idle_latencies_ms(port: int, count: int = 50) -> list[float]:
    """``count`` sequential /healthz on one connection, 20 ms apart: their latencies."""
    found: list[float] = []
    pending = bytearray()
    with connect(port, 10.0) as sock:
        for _ in range(count):
            started = time.perf_counter()
            sock.sendall(request("/healthz"))
            read_response(sock, pending)
            found.append((time.perf_counter() - started) * 1e3)
            time.sleep(0.02)
    return found


def adversary_main(port: int, reading: bool, seconds: float, conn: Connection) -> None:
    """The latency measurements' adversary, in a process of its own (its loop would
    otherwise compete with the probe for this process's GIL): connects, says so, pushes
    pipelined /healthz for ``seconds`` (its answers read and dropped if ``reading``),
    and sends back (bytes sent, seconds, why it ended, bytes read)."""
    sock = connect(port)
    conn.send("connected")
    stop_reader = threading.Event()
    read = drain_reader(sock, stop_reader) if reading else (lambda: 0)
    result = push(sock, pipelined_block(request("/healthz")), seconds=seconds, stall_s=5.0)
    stop_reader.set()
    conn.send((result.sent, result.seconds, result.ended, read()))
    sock.close()
    conn.close()


def measure_latency(svc: Service, *, reading: bool, seconds: float) -> list[Row]:
    """A second client's /healthz latency while one connection pipelines /healthz."""
    time.sleep(0.5)
    before = svc.rss_mb()
    idle = statistics.median(idle_latencies_ms(svc.port))
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    adversary = multiprocessing.get_context("spawn").Process(
        target=adversary_main, args=(svc.port, reading, seconds, theirs), daemon=True
    )
    adversary.start()
    if not ours.poll(30.0) or ours.recv() != "connected":
        adversary.kill()
        adversary.join()
        raise SystemExit("the adversary did not connect within 30 s")
    latencies: list[float] = []
    timeouts = 0
    errors: Counter[str] = Counter()
    done = threading.Event()

    def prober() -> None:
        nonlocal timeouts
        sock: socket.socket | None = None
        pending = bytearray()
        while not done.is_set():
            try:
                if sock is None:
                    sock = connect(svc.port, 10.0)
                    sock.settimeout(10.0)
                    pending.clear()
                started = time.perf_counter()
                sock.sendall(request("/healthz"))
                status = read_response(sock, pending)
                latencies.append(time.perf_counter() - started)
                if status != 200:
                    errors[str(status)] += 1
            except TimeoutError:
                timeouts += 1
                if sock is not None:
                    sock.close()
                sock = None
            except OSError as exc:
                errors[type(exc).__name__] += 1
                if sock is not None:
                    sock.close()
                sock = None
                time.sleep(0.1)
            time.sleep(0.02)
        if sock is not None:
            sock.close()

    with PeakRss(svc) as rss:
        thread = threading.Thread(target=prober, name="prober", daemon=True)
        thread.start()
        pushed = ours.recv() if ours.poll(seconds + 30.0) else (0, 0.0, "no report", 0)
        done.set()
        thread.join(timeout=15.0)
        adversary.join(timeout=10.0)
        if adversary.is_alive():
            adversary.kill()
            adversary.join()
    sent, pushed_s, ended, read = pushed
    figure_idle = f" (idle before: median {idle:.2f} ms)"
    name = "latency-reading" if reading else "latency-not-reading"
    if latencies:
        ms = sorted(x * 1e3 for x in latencies)
        p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
        figure = (
            f"probe n={len(ms)}: median {statistics.median(ms):.2f} ms, p99 {p99:.2f} ms, "
            f"max {ms[-1]:.2f} ms, timeouts (10 s) {timeouts}"
        )
    else:
        figure = f"probe: no answer at all, timeouts {timeouts}"
    figure += figure_idle
    if errors:
        figure += f", errors {dict(errors)}"
    adversary_figure = (
        f"sent {sent / MB:.0f} MB ({sent // len(request('/healthz'))} requests) "
        f"in {pushed_s:.1f} s, ended: {ended}"
    )
    if reading:
        adversary_figure += f", read {read / MB:.0f} MB of answers"
    adversary_figure += f"; worker RSS {before:.0f} -> peak {rss.peak:.0f} MB"
    return [(name, figure), (f"{name} adversary", adversary_figure)]


def measure_slow_heads(svc: Service, *, seconds: float, count: int = 300) -> list[Row]:
    """``count`` connections sending a request head one byte every 5 s."""
    time.sleep(0.5)
    socks: dict[socket.socket, bytearray] = {}
    closed: dict[socket.socket, str] = {}
    refused = 0
    for _ in range(count):
        try:
            sock = connect(svc.port)
            sock.sendall(b"POST /v1/save HTTP/1.1\r\n")
        except OSError:
            refused += 1
            continue
        sock.setblocking(False)
        socks[sock] = bytearray()
    checkpoints = [seconds * i / 3 for i in (1, 2, 3)]
    open_at: list[tuple[float, int]] = []
    started = time.monotonic()
    next_byte = started + 5.0
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)

        def close(sock: socket.socket, how: str) -> None:
            closed[sock] = how
            selector.unregister(sock)

        while checkpoints:
            now = time.monotonic()
            if now - started >= checkpoints[0]:
                open_at.append((checkpoints.pop(0), len(socks) - len(closed)))
                continue
            if now >= next_byte:
                next_byte += 5.0
                for sock in socks:
                    if sock in closed:
                        continue
                    try:
                        sock.send(b"X")
                    except OSError as exc:
                        close(sock, f"send failed ({type(exc).__name__})")
                continue
            wait = min(next_byte, started + checkpoints[0]) - now
            for key, _ in selector.select(max(0.0, wait)):
                sock = key.fileobj  # type: ignore[assignment]
                try:
                    chunk = sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    close(sock, f"reset ({type(exc).__name__})")
                    continue
                if chunk:
                    socks[sock] += chunk
                else:
                    close(sock, "closed")
        during = probe_healthz(svc.port)
    for sock in socks:
        sock.close()
    # What the closed ones got: the statuses they were answered, and how they ended.
    seen: Counter[str] = Counter()
    for sock, how in closed.items():
        got = bytes(socks[sock])
        seen[f"{answers(got) if got else 'no answer'} then {how}"] += 1
    unanswered_open = sum(1 for s in socks if s not in closed and socks[s])
    opens = ", ".join(f"{at:.0f} s: {n}" for at, n in open_at)
    rows: list[Row] = [
        ("slow-heads", f"open of {len(socks)} at {opens}"),
        (
            "slow-heads closed",
            ", ".join(f"{n}x {what}" for what, n in seen.most_common()) or "none closed",
        ),
        (
            "slow-heads other",
            f"connect failed {refused}, open ones answered something {unanswered_open}; "
            f"/healthz at the end (connections still open) {during}",
        ),
    ]
    return rows


UPGRADES: dict[str, bytes] = {
    "upgrade h2c": (
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n"
    ),
    "upgrade CONNECT": b"CONNECT 127.0.0.1:443 HTTP/1.1\r\nHost: 127.0.0.1:443\r\n\r\n",
    "upgrade websocket POST+GET": (
        b"POST /v1/save HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Content-Type: application/json\r\nContent-Length: 24\r\n\r\n"
        b'{"kind":"k","value":"v"}' + request("/healthz")
    ),
}


def measure_upgrade(svc: Service) -> list[Row]:
    """Each upgrade-like request on a fresh connection: the statuses answered."""
    rows: list[Row] = []
    for name, data in UPGRADES.items():
        try:
            got, how = exchange(data, port=svc.port)
            rows.append((name, f"answers {answers(got)}, connection then {how}"))
        except OSError as exc:
            rows.append((name, f"failed ({type(exc).__name__}: {exc})"))
    return rows


def measure_close_pipelined(svc: Service) -> list[Row]:
    """``Connection: close`` with a request pipelined behind it, HTTP/1.1 and 1.0."""
    rows: list[Row] = []
    for version in ("1.1", "1.0"):
        before = svc.stderr()
        data = request("/healthz", version, "Connection: close\r\n") + request("/healthz", version)
        try:
            got, how = exchange(data, port=svc.port)
            figure = f"answers {answers(got)}, connection then {how}"
        except OSError as exc:
            figure = f"failed ({type(exc).__name__})"
        time.sleep(0.5)  # a log line of the server's, if any, is written by now
        figure += f"; stderr {svc.stderr() - before}; /healthz after {probe_healthz(svc.port)}"
        rows.append((f"tracebacks close+pipelined HTTP/{version}", figure))
    return rows


def measure_drain(backends: Backends, *, after_first: bool) -> Row:
    """SIGTERM while 50 pipelined saves of new values are in flight."""
    name = "tracebacks drain " + ("after 1st answer" if after_first else "immediate")
    run = secrets.token_hex(4)
    data = b"".join(
        b"POST /v1/save HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        for body in (f'{{"kind":"abuse","value":"{run}-{i}"}}' for i in range(50))
    )
    with service(backends, name.replace(" ", "-")) as svc:
        sock = connect(svc.port)
        sock.sendall(data)
        first = b""
        if after_first:
            sock.settimeout(5.0)
            with contextlib.suppress(TimeoutError, ConnectionError):
                first = sock.recv(65536)
        status, took = svc.terminate()
        rest, how = read_until_quiet(sock, 2.0)
        sock.close()
        log = svc.stderr()
    answered = Counter(statuses(first + rest))
    exited = "did not exit" if status is None else f"exit {status}"
    return (
        name,
        f"{exited} after {took:.1f} s; client got {dict(answered) or 'nothing'} "
        f"of 50, then {how}; stderr {log}",
    )


# ---------------------------------------------------------------------------- main


def run(args: argparse.Namespace, chosen: Sequence[str]) -> list[Row]:
    """Start the backends, run each chosen measurement on a service of its own."""
    root: Path = args.root
    rows: list[Row] = []
    where = imported_dedup(root)
    print(f"root {root}: the service's environment imports {where}", flush=True)
    log_dir = Path(tempfile.mkdtemp(prefix="http-abuse-"))
    with started_backends(root, log_dir) as backends:

        def measured(name: str, measure: Callable[[Service], list[Row]]) -> None:
            print(f"... {name}", flush=True)
            with service(backends, name) as svc:
                cwd, pythonpath = svc.proc_facts()
                print(
                    f"    service pid {svc.proc.pid} (worker pid {svc.worker_pid}), "
                    f"cwd {cwd}, PYTHONPATH {pythonpath}",
                    flush=True,
                )
                found = measure(svc)
                if not svc.alive():
                    found.append((f"{name} service", f"exited with {svc.proc.returncode}"))
                rows.extend(found)

        if "rss-openapi" in chosen:
            measured("rss-openapi", lambda s: measure_rss(s, "/openapi.json", args))
        if "rss-healthz" in chosen:
            measured("rss-healthz", lambda s: measure_rss(s, "/healthz", args))
        if "latency-reading" in chosen:
            measured(
                "latency-reading",
                lambda s: measure_latency(s, reading=True, seconds=args.latency_seconds),
            )
        if "latency-not-reading" in chosen:
            measured(
                "latency-not-reading",
                lambda s: measure_latency(s, reading=False, seconds=args.latency_seconds),
            )
        if "slow-heads" in chosen:
            measured("slow-heads", lambda s: measure_slow_heads(s, seconds=args.slow_seconds))
        if "upgrade" in chosen:
            measured("upgrade", measure_upgrade)
        if "tracebacks" in chosen:
            measured("tracebacks", measure_close_pipelined)
            for after_first in (False, True):
                print(f"... drain ({'after first answer' if after_first else 'immediate'})")
                rows.append(measure_drain(backends, after_first=after_first))
            total = Stderr()
            each: list[str] = []
            for svc in backends.services:
                found = svc.stderr()
                total += found
                if found.tracebacks or found.errors or found.never_retrieved:
                    each.append(f"{svc.name}: {found.tracebacks}/{found.errors}")
            rows.append(
                (
                    "tracebacks whole run",
                    f"{total} over {len(backends.services)} services"
                    + (f" (Traceback/ERROR by service: {', '.join(each)})" if each else ""),
                )
            )
    print(f"service logs: {log_dir}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root",
        type=lambda p: Path(p).resolve(),
        default=ROOT,
        help=f"the source tree whose dedup the service runs (default {ROOT})",
    )
    parser.add_argument("--only", default=",".join(MEASUREMENTS), help="NAME[,NAME] of these")
    parser.add_argument("--slow-seconds", type=float, default=90.0, help="slow-heads (90)")
    parser.add_argument("--rss-seconds", type=float, default=30.0, help="rss-* at most (30)")
    parser.add_argument("--latency-seconds", type=float, default=10.0, help="latency-* (10)")
    parser.add_argument(
        "--rss-cap-mb",
        type=float,
        default=4096.0,
        help="rss-*: stop sending once the worker's RSS passes this (4096)",
    )
    args = parser.parse_args()
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(MEASUREMENTS))
    if unknown:
        parser.error(f"unknown measurements {unknown}; known: {', '.join(MEASUREMENTS)}")
    if not (args.root / "dedup" / "__init__.py").is_file():
        parser.error(f"{args.root} has no dedup package")
    # The throwaway servers' helpers come from the same tree as the service.
    sys.path.insert(0, str(args.root))
    rows = run(args, chosen)
    width = max(len(name) for name, _ in rows) if rows else 10
    print()
    print(f"{'measurement':<{width}} | figure")
    print(f"{'-' * width}-+-{'-' * 60}")
    for name, figure in rows:
        print(f"{name:<{width}} | {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
