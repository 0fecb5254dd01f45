"""``dedup serve --workers N`` as an operator runs it: one /metrics for the whole service,
a hung worker replaced, workers that end with their supervisor, a worker that cannot start
retried with backoff while the others serve, JSON logs, and settings that refuse nonsense.

Real processes against a real redis-server and PostgreSQL (helpers in tests/test_service.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from collections.abc import Set as AbstractSet
from dataclasses import fields
from pathlib import Path
from typing import Any, Self

import aiohttp
import asyncpg
import pytest

from dedup.errors import ConfigError
from dedup.service.logs import JsonFormatter
from dedup.service.settings import ServiceSettings, load_service_settings
from tests.servers import PostgresCluster
from tests.test_service import (
    ROOT,
    ServiceProcess,
    parse_metrics,
    service_env,
    spawn_service,
    wait_exit,
    wait_healthy,
)

WAIT_S = 60.0  # bound of every "until" below: generous, the machine is shared


async def until(what: str, check: Callable[[], Awaitable[Any]], timeout: float = WAIT_S) -> Any:
    """Await ``check()`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {timeout} s")
        await asyncio.sleep(0.05)


def _parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _workers(supervisor: int) -> set[int]:
    """Live children of ``supervisor`` started by multiprocessing's spawn."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (
                _parent_pid(int(entry.name)) == supervisor
                and b"spawn_main" in (entry / "cmdline").read_bytes()
                and _alive(int(entry.name))
            ):
                found.add(int(entry.name))
        except OSError:
            continue  # gone meanwhile
    return found


async def _fresh(method: str, url: str, **kwargs: Any) -> tuple[int, bytes]:
    """One request on a connection of its own (the kernel spreads connections, not requests)."""
    connector = aiohttp.TCPConnector(force_close=True)
    timeout = aiohttp.ClientTimeout(total=10)
    async with (
        aiohttp.ClientSession(connector=connector, timeout=timeout) as http,
        http.request(method, url, **kwargs) as r,
    ):
        return r.status, await r.read()


async def _healthz_pid(svc: ServiceProcess) -> int | None:
    try:
        status, body = await _fresh("GET", f"{svc.url}/healthz")
    except (aiohttp.ClientError, TimeoutError):
        return None
    return int(json.loads(body)["pid"]) if status == 200 else None


async def _all_answered(svc: ServiceProcess, want: set[int] | int) -> set[int]:
    """Poll /healthz on fresh connections until every worker wanted has answered."""
    seen: set[int] = set()

    async def enough() -> bool:
        pid = await _healthz_pid(svc)
        if pid is not None:
            seen.add(pid)
        return len(seen) >= want if isinstance(want, int) else want <= seen

    await until(f"workers {want} to answer", enough)
    return seen


async def _save(svc: ServiceProcess, kind: str, value: str) -> int:
    status, _ = await _fresh("POST", f"{svc.url}/v1/save", json={"kind": kind, "value": value})
    return status


async def _scrape(svc: ServiceProcess) -> dict[str, float]:
    status, body = await _fresh("GET", f"{svc.url}/metrics")
    assert status == 200
    return parse_metrics(body.decode())


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (field 22 of its stat), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class _Seen(set[int]):
    """Worker PIDs a test saw, with their start times: the teardown signals a PID only
    while it still names that process (never one the system gave to another since)."""

    def __init__(self) -> None:
        super().__init__()
        self.started: dict[int, str | None] = {}

    def add(self, pid: int) -> None:
        self.started.setdefault(pid, _start_time(pid))
        super().add(pid)

    def __ior__(self, pids: AbstractSet[int]) -> Self:  # type: ignore[override,misc]
        for pid in pids:
            self.add(pid)
        return self


def _kill_all(svc: ServiceProcess, seen: _Seen) -> None:
    """Teardown: wake any stopped worker, then SIGKILL it, and the service (by PID)."""
    for pid in seen:
        started = seen.started.get(pid)
        for sig in (signal.SIGCONT, signal.SIGKILL):
            if started is None or _start_time(pid) != started:
                break
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    if svc.proc.poll() is None:  # not reaped yet: the PID is still the service's
        svc.proc.send_signal(signal.SIGCONT)
        svc.kill()


@pytest.fixture
def seen_pids() -> _Seen:
    """Worker PIDs a test saw, for the teardown (by PID, never by name)."""
    return _Seen()


# --------------------------------------------------------------------------- metrics


async def test_every_scrape_shows_the_whole_service(
    redis_url: str, pg_url: str, tmp_path: Path, seen_pids: _Seen
) -> None:
    svc = spawn_service(tmp_path, service_env(redis_url, pg_url), args=["--workers", "2"])
    try:
        await wait_healthy(svc)
        workers = await _all_answered(svc, 2)
        seen_pids |= workers
        saves = 120
        statuses = [await _save(svc, "m", f"v{i}") for i in range(saves)]
        assert statuses == [201] * saves

        async def totals_show_every_save() -> bool:
            m = await _scrape(svc)
            return m["dedup_http_items_total"] == saves

        # Each worker pushes its counts about once a second.
        await until("the scrape to show every save", totals_show_every_save)
        for _ in range(8):  # any connection, so any worker: always the sum
            m = await _scrape(svc)
            assert m["dedup_http_items_total"] == saves
            assert m['dedup_answers_total{source="write"}'] == saves
            assert m['dedup_http_responses_total{code="201",route="/v1/save"}'] == saves
            assert m['dedup_http_request_duration_seconds_count{route="/v1/save"}'] == saves
            assert m["dedup_pending"] == 0 and m["dedup_degraded"] == 0
            assert m["dedup_redis_round_trips_total"] > 0
            assert 0 < m["process_start_time_seconds"] <= time.time()
            # One series per metric: no pid label, the workers are merged.
            assert not any("pid=" in key for key in m)

        # A worker that dies keeps its counts in the totals; its replacement adds to them.
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        await until("the worker to be replaced", lambda: _replaced(svc, workers, seen_pids))
        for _ in range(4):
            assert (await _scrape(svc))["dedup_http_items_total"] == saves
        assert await _save(svc, "m", "after") == 201

        async def one_more() -> bool:
            return (await _scrape(svc))["dedup_http_items_total"] == saves + 1

        await until("the new save to count", one_more)
        svc.terminate()
        assert await wait_exit(svc) == 0, svc.log_text()
    finally:
        _kill_all(svc, seen_pids)


async def _replaced(svc: ServiceProcess, old: set[int], seen: _Seen) -> bool:
    pid = await _healthz_pid(svc)
    if pid is None or pid in old:
        return False
    seen.add(pid)
    return _parent_pid(pid) == svc.proc.pid


async def test_the_metrics_folder_is_fresh_and_removed_at_exit(
    redis_url: str, pg_url: str, tmp_path: Path, seen_pids: _Seen
) -> None:
    folders = []
    for _ in range(2):  # two runs: each gets a folder of its own
        svc = spawn_service(tmp_path, service_env(redis_url, pg_url), args=["--workers", "2"])
        try:
            await wait_healthy(svc)
            workers = await _all_answered(svc, 2)
            seen_pids |= workers
            environs = [Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for pid in workers]
            (folder,) = {
                Path(item.split(b"=", 1)[1].decode())
                for environ in environs
                for item in environ
                if item.startswith(b"PROMETHEUS_MULTIPROC_DIR=")
            }  # one folder, shared by the workers of the run
            assert folder.name.startswith("dedup-metrics-") and any(folder.glob("*.db"))
            folders.append(folder)
            svc.terminate()
            assert await wait_exit(svc) == 0, svc.log_text()
            assert not folder.exists()
        finally:
            _kill_all(svc, seen_pids)
    assert folders[0] != folders[1]


# ------------------------------------------------------------------------ supervisor


async def test_a_stopped_worker_is_replaced(
    redis_url: str, pg_url: str, tmp_path: Path, seen_pids: _Seen
) -> None:
    env = service_env(redis_url, pg_url, DEDUP_WORKER_TIMEOUT_S="3")
    svc = spawn_service(tmp_path, env, args=["--workers", "2"])
    try:
        await wait_healthy(svc)
        workers = await _all_answered(svc, 2)
        seen_pids |= workers
        hung = min(workers)
        os.kill(hung, signal.SIGSTOP)  # its event loop no longer beats, its socket stays

        async def gone() -> bool:
            return not _alive(hung)

        await until("the stopped worker to be killed", gone)
        assert "sent no heartbeat" in svc.log_text()
        await until("its replacement to serve", lambda: _replaced(svc, workers, seen_pids))
        assert max(workers) in _workers(svc.proc.pid)  # the other one was left alone
        assert await _save(svc, "h", "x") == 201
        svc.terminate()
        assert await wait_exit(svc) == 0, svc.log_text()
    finally:
        _kill_all(svc, seen_pids)


async def test_workers_end_when_the_supervisor_is_killed(
    redis_url: str, pg_url: str, tmp_path: Path, seen_pids: _Seen
) -> None:
    svc = spawn_service(tmp_path, service_env(redis_url, pg_url), args=["--workers", "2"])
    try:
        await wait_healthy(svc)
        workers = await _all_answered(svc, 2)
        seen_pids |= workers
        os.kill(svc.proc.pid, signal.SIGKILL)  # the OOM killer's way: no signal forwarded
        assert svc.proc.wait(timeout=WAIT_S) == -signal.SIGKILL

        async def all_gone() -> bool:
            return not any(_alive(pid) for pid in workers)

        await until("the orphaned workers to exit", all_gone)
        assert await _healthz_pid(svc) is None  # nobody listens any more
    finally:
        _kill_all(svc, seen_pids)


async def test_a_failing_supervisor_stops_its_workers_and_exits(
    redis_url: str, pg_url: str, tmp_path: Path, seen_pids: _Seen
) -> None:
    """The supervisor runs out of file descriptors (its limit lowered to what it has
    open) when it must start a replacement worker: it stops the other worker and exits
    with an error, rather than wait for a worker that goes on serving."""
    svc = spawn_service(tmp_path, service_env(redis_url, pg_url), args=["--workers", "2"])
    try:
        await wait_healthy(svc)
        workers = await _all_answered(svc, 2)
        seen_pids |= workers
        supervisor = svc.proc.pid
        held = len(os.listdir(f"/proc/{supervisor}/fd"))
        resource.prlimit(supervisor, resource.RLIMIT_NOFILE, (held, held))
        os.kill(min(workers), signal.SIGKILL)  # its replacement needs new descriptors
        status = await wait_exit(svc, timeout=WAIT_S)
        assert status != 0, svc.log_text()
        assert "the supervisor failed" in svc.log_text()

        async def all_gone() -> bool:
            return not any(_alive(pid) for pid in workers)

        await until("the other worker to stop", all_gone)
    finally:
        _kill_all(svc, seen_pids)


def _database_name(url: str) -> str:
    return url.rsplit("/", 1)[1].split("?", 1)[0]


async def _allow_connections(pg_cluster: PostgresCluster, name: str, allow: bool) -> None:
    conn = await asyncpg.connect(pg_cluster.url("postgres"))
    try:
        await conn.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS {str(allow).lower()}')
    finally:
        await conn.close()


async def test_a_worker_that_cannot_start_backs_off_while_the_others_serve(
    pg_cluster: PostgresCluster, redis_url: str, pg_url: str, tmp_path: Path, seen_pids: _Seen
) -> None:
    """The database refuses new connections (as when max_connections is reached): the
    worker that serves keeps its connection and goes on; its killed sibling cannot open
    its Gateway, and is retried with a growing delay until the database accepts again."""
    name = _database_name(pg_url)
    svc = spawn_service(tmp_path, service_env(redis_url, pg_url), args=["--workers", "2"])
    try:
        await wait_healthy(svc)
        workers = await _all_answered(svc, 2)
        seen_pids |= workers
        survivor, victim = max(workers), min(workers)
        await _allow_connections(pg_cluster, name, False)
        try:
            os.kill(victim, signal.SIGKILL)

            async def victim_reaped() -> bool:
                return f"(pid {victim}) exited with -9" in svc.log_text()

            # Until the last of its threads has exited and closed its listening socket
            # (its main thread may already show as a zombie), the kernel may still hand
            # the victim a new connection, which its exit then resets: save only once
            # the supervisor has reaped it.
            await until("the supervisor to reap the killed worker", victim_reaped)

            async def retried_three_times() -> bool:
                return "consecutive failures: 3" in svc.log_text()

            i = 0

            async def served_meanwhile() -> bool:
                nonlocal i
                i += 1
                assert await _save(svc, "b", f"v{i}") == 201  # only the survivor listens
                assert svc.proc.poll() is None
                return await retried_three_times()

            await until("three failed starts", served_meanwhile, timeout=120)
            assert _alive(survivor) and survivor in _workers(svc.proc.pid)
            delays = [
                float(line.split("restarting in ")[1].split(" s")[0])
                for line in svc.log_text().splitlines()
                if "restarting in" in line
            ]
            # 0.5 s, 1 s, 2 s... each jittered by +-50%: the third wait is above the first.
            assert len(delays) >= 3 and delays[2] > delays[0], delays
            assert "cannot serve" in svc.log_text()
        finally:
            await _allow_connections(pg_cluster, name, True)
        await until("the retried worker to serve", lambda: _replaced(svc, workers, seen_pids))
        svc.terminate()
        assert await wait_exit(svc) == 0, svc.log_text()
    finally:
        with contextlib.suppress(Exception):  # teardown: the database may be gone
            await _allow_connections(pg_cluster, name, True)
        _kill_all(svc, seen_pids)


# ---------------------------------------------------------------------------- logs


def _json_lines(text: str) -> list[dict[str, Any]]:
    """Every non-empty line parsed as one JSON object (fails on the first that is not)."""
    records = []
    for line in text.splitlines():
        if line.strip():
            record = json.loads(line)
            assert isinstance(record, dict), line
            assert {"time", "level", "logger", "pid", "message"} <= set(record), line
            records.append(record)
    return records


async def test_json_logs_parse_line_by_line(
    redis_url: str, pg_url: str, tmp_path: Path, seen_pids: _Seen
) -> None:
    env = service_env(redis_url, pg_url, DEDUP_WORKER_TIMEOUT_S="3", DEDUP_ACCESS_LOG="true")
    svc = spawn_service(tmp_path, env, args=["--workers", "2", "--log-format", "json"])
    try:
        await wait_healthy(svc)
        workers = await _all_answered(svc, 2)
        seen_pids |= workers
        assert await _save(svc, "j", "x") == 201
        os.kill(min(workers), signal.SIGKILL)  # the supervisor logs it, as JSON too
        await until("the worker to be replaced", lambda: _replaced(svc, workers, seen_pids))
        # The save above may have been answered by the worker just killed, before its
        # access line was written: a save now, by a live worker, is logged for sure.
        assert await _save(svc, "j", "y") == 201

        async def logged() -> bool:
            return '"POST /v1/save' in svc.log_text()

        await until("the access line", logged)
        svc.terminate()
        assert await wait_exit(svc) == 0, svc.log_text()
    finally:
        _kill_all(svc, seen_pids)
    records = _json_lines(svc.log_text())
    messages = [r["message"] for r in records]
    assert any("serving on" in m for m in messages)
    assert any("exited with -9" in m for m in messages)
    assert any('"POST /v1/save' in m for m in messages)  # the access log
    assert len({r["pid"] for r in records}) >= 3  # supervisor and workers, one stream


def test_json_log_keeps_a_traceback_in_one_line(tmp_path: Path) -> None:
    code = (
        "import logging\n"
        "from dedup.service.logs import setup_logging\n"
        "setup_logging('info', 'json')\n"
        "try:\n"
        "    raise ValueError('boom\\nsecond line')\n"
        "except ValueError:\n"
        "    logging.getLogger('dedup.test').exception('it failed', extra={'worker': 3})\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    (record,) = _json_lines(run.stderr)
    assert record["message"] == "it failed" and record["level"] == "error"
    assert record["logger"] == "dedup.test" and record["worker"] == 3
    assert "Traceback" in record["exception"] and "ValueError: boom" in record["exception"]

    uncaught = (
        "from dedup.service.logs import setup_logging\nsetup_logging('info', 'json')\n1 / 0\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", uncaught], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 1
    (record,) = _json_lines(run.stderr)
    assert record["level"] == "critical" and "ZeroDivisionError" in record["exception"]


def test_serve_startup_error_is_json_too(redis_url: str, pg_empty_url: str) -> None:
    env = service_env(redis_url, pg_empty_url)  # not migrated: serve refuses to start
    run = subprocess.run(
        [sys.executable, "-m", "dedup", "serve", "--port", "0", "--log-format", "json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    records = _json_lines(run.stderr)
    assert any("dedup migrate" in r["message"] for r in records), records


def test_json_formatter_escapes_every_newline() -> None:
    import logging

    record = logging.makeLogRecord({"msg": "a\nb", "levelname": "INFO", "name": "x"})
    line = JsonFormatter().format(record)
    assert "\n" not in line and json.loads(line)["message"] == "a\nb"


# ------------------------------------------------------------------------ settings

_FLOATS = [f.name for f in fields(ServiceSettings) if f.type == "float"]


@pytest.mark.parametrize("name", _FLOATS)
@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "NaN", "Infinity"])
def test_non_finite_service_settings_are_refused(name: str, raw: str, tmp_path: Path) -> None:
    assert _FLOATS  # drain_timeout_s, ready_timeout_s, keepalive_timeout_s, worker_timeout_s
    env = {f"DEDUP_{name.upper()}": raw}
    with pytest.raises(ConfigError, match=name):
        load_service_settings(config_path=None, environ=env, flags={})
    config = tmp_path / "dedup.toml"
    literal = {"nan": "nan", "NaN": "nan", "inf": "inf", "Infinity": "inf", "-inf": "-inf"}[raw]
    config.write_text(f"[service]\n{name} = {literal}\n")
    with pytest.raises(ConfigError, match=name):
        load_service_settings(config_path=config, environ={}, flags={})
    with pytest.raises(ConfigError, match=name):
        given: dict[str, Any] = {name: float(raw)}
        ServiceSettings(**given)
    value = float(raw)
    assert not math.isfinite(value)


def test_check_refuses_a_non_finite_service_setting() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEDUP_")}
    env["DEDUP_DRAIN_TIMEOUT_S"] = "nan"
    run = subprocess.run(
        [sys.executable, "-m", "dedup", "check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "drain_timeout_s" in run.stderr and "finite number" in run.stderr
    assert "Traceback" not in run.stderr


def test_log_format_and_worker_timeout_are_checked() -> None:
    with pytest.raises(ConfigError, match="log_format"):
        ServiceSettings(log_format="xml")
    with pytest.raises(ConfigError, match="worker_timeout_s"):
        ServiceSettings(worker_timeout_s=1.0)
    settings = load_service_settings(
        config_path=None, environ={"DEDUP_LOG_FORMAT": "json"}, flags={}
    )
    assert settings.log_format == "json"
