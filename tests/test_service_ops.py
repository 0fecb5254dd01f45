"""``dedup serve`` and ``dedup check`` in operation: SIGTERM under load, several workers on
one port, PostgreSQL going away, overload, startup failures, the embedded default.

Each test starts its own service process (helpers in tests/test_service.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import orjson
import redis.asyncio as aioredis

from dedup._claims.keys import KeySpace
from dedup._values import digest
from tests.servers import PostgresCluster, RedisServer
from tests.test_service import (
    ROOT,
    assert_error,
    migrate_in_thread,
    request,
    rows_for,
    service_env,
    spawn_service,
    wait_exit,
    wait_healthy,
)

JSON = {"Content-Type": "application/json"}
WAIT = 30.0  # bound of every "until" loop below


async def until(what: str, check: Any, timeout: float = WAIT) -> Any:
    """Await ``check()`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {timeout} s")
        await asyncio.sleep(0.02)


async def lease_keys(redis_url: str) -> list[bytes]:
    """Keys of the default namespace that still hold a lease token (tokens start with L)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        keys = [k async for k in client.scan_iter(match=b"dedup:*", count=1000)]
        values = await client.mget(keys) if keys else []
    finally:
        await client.aclose()
    return [k for k, v in zip(keys, values, strict=True) if isinstance(v, bytes) and v[:1] == b"L"]


# ------------------------------------------------------------------------ graceful stop


async def test_sigterm_under_load_finishes_in_flight_requests(
    redis_url: str, pg_url: str, tmp_path: Path
) -> None:
    # A long lease keeps the writes blocked below (by a table lock) inside their lease.
    env = service_env(redis_url, pg_url, DEDUP_LEASE_MS="60000", DEDUP_DRAIN_TIMEOUT_S="60")
    svc = spawn_service(tmp_path, env)
    try:
        await wait_healthy(svc)
        acked: list[str] = []
        other: list[tuple[int, Any]] = []
        ended: Counter[str] = Counter()
        async with aiohttp.ClientSession(
            base_url=svc.url, timeout=aiohttp.ClientTimeout(total=120)
        ) as http:

            async def single(w: int) -> None:
                for i in range(10**9):
                    value = f"s{w}-{i}"
                    try:
                        status, body, _ = await request(
                            http, "POST", "/v1/save", json={"kind": "drain", "value": value}
                        )
                    except aiohttp.ClientError as exc:  # refused or closed: acknowledged nothing
                        ended[type(exc).__name__] += 1
                        return
                    if status in (200, 201):
                        acked.append(value)
                    else:
                        other.append((status, body))

            async def batch(w: int) -> None:
                for i in range(10**9):
                    values = [f"b{w}-{i}-{j}" for j in range(20)]
                    items = [{"kind": "drain", "value": v} for v in values]
                    try:
                        status, body, _ = await request(
                            http, "POST", "/v1/save/batch", json={"items": items}
                        )
                    except aiohttp.ClientError as exc:
                        ended[type(exc).__name__] += 1
                        return
                    if status == 200:
                        acked.extend(values)
                    else:
                        other.append((status, body))

            tasks = [asyncio.create_task(single(w)) for w in range(16)]
            tasks += [asyncio.create_task(batch(w)) for w in range(4)]
            try:

                async def some_acked() -> bool:
                    return len(acked) >= 300

                await until("a load to run", some_acked)
                # Block every INSERT: the requests under way now stay in flight.
                blocker = await asyncpg.connect(pg_url)
                try:
                    locked = blocker.transaction()
                    await locked.start()
                    await blocker.execute("LOCK TABLE dedup_items IN SHARE MODE")

                    async def inserts_waiting() -> bool:
                        n = await blocker.fetchval(
                            "SELECT count(*) FROM pg_stat_activity "
                            "WHERE application_name = 'dedup' AND wait_event_type = 'Lock'"
                        )
                        return bool(n)

                    await until("an INSERT to wait on the lock", inserts_waiting)
                    acked_before = len(acked)
                    svc.terminate()

                    async def refuses_new_connections() -> bool:
                        try:
                            async with (
                                aiohttp.ClientSession() as probe,
                                probe.get(f"{svc.url}/healthz"),
                            ):
                                return False
                        except aiohttp.ClientConnectionError:
                            return True

                    await until("the listening socket to close", refuses_new_connections)
                    assert svc.proc.poll() is None  # still draining: requests are in flight
                    await locked.rollback()  # the blocked INSERTs go through now
                finally:
                    await blocker.close()
                await asyncio.wait_for(asyncio.gather(*tasks), WAIT * 2)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        status = await wait_exit(svc)
        assert status == 0, svc.log_text()
        # The requests in flight at SIGTERM were answered, all of them with success.
        assert len(acked) > acked_before
        assert other == []
        assert sum(ended.values()) == 20
        rows = await rows_for(pg_url, "drain")
        assert set(acked) <= set(rows), "an acknowledged value has no row"
        assert await lease_keys(redis_url) == []
        assert "draining" in svc.log_text()
    finally:
        if svc.proc.poll() is None:
            svc.kill()


# -------------------------------------------------------------------------- workers


def _parent_pid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


async def test_two_workers_serve_one_port(redis_url: str, pg_url: str, tmp_path: Path) -> None:
    svc = spawn_service(tmp_path, service_env(redis_url, pg_url), args=["--workers", "2"])
    try:
        await wait_healthy(svc)
        pids: set[int] = set()

        async def healthz_pid() -> int | None:
            # A fresh connection each time: the kernel spreads connections, not requests.
            try:
                async with (
                    aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http,
                    http.get(f"{svc.url}/healthz") as r,
                ):
                    pid: int = (await r.json())["pid"]
                    return pid
            except aiohttp.ClientError:  # a worker that was just killed
                return None

        async def both_answered() -> bool:
            pid = await healthz_pid()
            if pid is not None:
                pids.add(pid)
            return len(pids) == 2

        await until("both workers to answer", both_answered)
        assert {_parent_pid(pid) for pid in pids} == {svc.proc.pid}
        assert svc.proc.pid not in pids

        # Exactly one created=True across both processes for one value sent 40 times at once.
        async def one(i: int) -> int:
            async with (
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http,
                http.post(
                    f"{svc.url}/v1/save", json={"kind": "w", "value": "same"}, headers=JSON
                ) as r,
            ):
                await r.read()
                return r.status

        statuses = await asyncio.gather(*(one(i) for i in range(40)))
        assert sorted(statuses) == [200] * 39 + [201]
        assert await rows_for(pg_url, "w") == {"same": None}

        # The supervisor replaces a worker that dies.
        original = set(pids)
        os.kill(min(original), signal.SIGKILL)

        async def replaced() -> bool:
            pid = await healthz_pid()
            if pid is None or pid in original:
                return False
            pids.add(pid)
            return _parent_pid(pid) == svc.proc.pid

        await until("the killed worker to be replaced", replaced)
        assert "exited with -9" in svc.log_text()

        svc.terminate()
        assert await wait_exit(svc) == 0, svc.log_text()
        for pid in pids:  # the workers are gone with their supervisor
            assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
        assert await lease_keys(redis_url) == []
    finally:
        if svc.proc.poll() is None:
            svc.kill()


# --------------------------------------------------------------------------- outages


async def test_database_down_is_503_with_retry_after(
    fresh_pg: PostgresCluster, redis_url: str, tmp_path: Path
) -> None:
    fresh_pg.create_database("dedup")
    secret = "pg-secret-for-this-test"
    url = fresh_pg.url("dedup").replace("postgres@", f"postgres:{secret}@")  # trust auth
    migrate_in_thread(url)
    env = service_env(redis_url, url, DEDUP_RETRY_AFTER_S="3")
    svc = spawn_service(tmp_path, env)
    try:
        await wait_healthy(svc)
        async with aiohttp.ClientSession(
            base_url=svc.url, timeout=aiohttp.ClientTimeout(total=60)
        ) as http:
            status, _, _ = await request(
                http, "POST", "/v1/save", json={"kind": "pg", "value": "before"}
            )
            assert status == 201

            fresh_pg.kill()
            for path, body in [
                ("/v1/save", {"kind": "pg", "value": "during"}),
                ("/v1/save/batch", {"items": [{"kind": "pg", "value": "during2"}]}),
            ]:
                status, answer, headers = await request(http, "POST", path, json=body)
                error = assert_error(status, answer, "unavailable")
                assert status == 503 and headers["Retry-After"] == "3"
                assert error["component"] == "database"
                assert secret not in orjson.dumps(answer).decode()
            status, answer, headers = await request(http, "GET", "/readyz")
            error = assert_error(status, answer, "not_ready")
            assert status == 503 and headers["Retry-After"] == "3"
            assert error["checks"] == {"redis": True, "database": False}
            status, _, _ = await request(http, "GET", "/healthz")
            assert status == 200  # alive, only not ready
            assert await lease_keys(redis_url) == []  # the failed writes released theirs

            fresh_pg.start()

            async def saved() -> Any:
                status, answer, _ = await request(
                    http, "POST", "/v1/save", json={"kind": "pg", "value": "during"}
                )
                return (status, answer) if status != 503 else None

            # Nothing was committed while it was down: the retry's own write creates the row.
            assert await until("the database to come back", saved) == (
                201,
                {"created": True, "source": "write"},
            )

            async def ready() -> bool:
                status, _, _ = await request(http, "GET", "/readyz")
                return status == 200

            await until("/readyz to recover", ready)
        svc.terminate()
        assert await wait_exit(svc) == 0
        assert set(await rows_for(url, "pg")) == {"before", "during"}
        assert secret not in svc.log_text()
        assert "database" in svc.log_text()  # the outage was logged (redacted)
    finally:
        if svc.proc.poll() is None:
            svc.kill()


async def test_overloaded_429_and_wait_timeout_503(
    redis_url: str, pg_url: str, tmp_path: Path
) -> None:
    env = service_env(
        redis_url,
        pg_url,
        DEDUP_MAX_PENDING="1",
        DEDUP_MAX_BATCH="1",
        DEDUP_WAIT_TIMEOUT_S="0.3",
        DEDUP_RETRY_AFTER_S="7",
    )
    svc = spawn_service(tmp_path, env)
    client = aioredis.Redis.from_url(redis_url)
    try:
        await wait_healthy(svc)
        async with aiohttp.ClientSession(base_url=svc.url) as http:
            items = [{"kind": "o", "value": "1"}, {"kind": "o", "value": "2"}]
            status, answer, headers = await request(
                http, "POST", "/v1/save/batch", json={"items": items}
            )
            assert status == 429 and headers["Retry-After"] == "7"
            assert_error(status, answer, "overloaded")

            # Another writer holds the value's lease longer than wait_timeout_s.
            key = KeySpace("dedup").key("o", digest("held"))
            await client.set(key, b"Lsomeone-else", px=60_000)
            status, answer, headers = await request(
                http, "POST", "/v1/save", json={"kind": "o", "value": "held"}
            )
            assert status == 503 and headers["Retry-After"] == "7"
            assert_error(status, answer, "wait_timeout")
            await client.delete(key)  # that writer gave up: the next save goes through
            status, answer, _ = await request(
                http, "POST", "/v1/save", json={"kind": "o", "value": "held"}
            )
            assert (status, answer) == (201, {"created": True, "source": "write"})
        svc.terminate()
        assert await wait_exit(svc) == 0
        assert await rows_for(pg_url, "o") == {"held": None}
    finally:
        await client.aclose()
        if svc.proc.poll() is None:
            svc.kill()


# ------------------------------------------------------------------ startup and check


def _dedup(
    *args: str, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dedup", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_serve_refuses_an_evicting_redis_and_an_unmigrated_database(
    redis_url: str, pg_empty_url: str, tmp_path: Path
) -> None:
    with RedisServer(extra_args=["--maxmemory-policy", "allkeys-lru"]) as evicting:
        run = _dedup("serve", "--port", "0", env=service_env(evicting.url, pg_empty_url))
        assert run.returncode == 2
        assert "noeviction" in run.stderr

        run = _dedup("check", env=service_env(evicting.url, pg_empty_url))
        assert run.returncode == 1, run.stdout + run.stderr
        assert "FAIL redis    maxmemory-policy allkeys-lru" in run.stdout
        assert "FAIL database no table dedup_items: run `dedup migrate`" in run.stdout
        assert "problem(s)" in run.stdout.splitlines()[-1]

    run = _dedup("serve", "--port", "0", env=service_env(redis_url, pg_empty_url))
    assert run.returncode == 2
    assert "dedup migrate" in run.stderr


def test_check_reports_what_it_found(redis_url: str, pg_url: str, tmp_path: Path) -> None:
    run = _dedup("check", env=service_env(redis_url, pg_url))
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "OK   redis    redis://127.0.0.1:" in out and "Redis 7" in out
    assert "OK   redis    maxmemory-policy noeviction" in out
    assert "OK   database postgresql://postgres@127.0.0.1:" in out
    assert "schema at revision 0002 (the newest)" in out
    assert out.splitlines()[-1].startswith("dedup check: OK")

    down = "redis://127.0.0.1:1/0"
    run = _dedup("check", "--redis-url", down, env=service_env(redis_url, pg_url))
    assert run.returncode == 1
    assert "FAIL redis    redis://127.0.0.1:1/0: cannot connect" in run.stdout

    bad = tmp_path / "bad.toml"
    bad.write_text("[service]\nport = 99999\n")
    run = _dedup("check", "--config", str(bad), env=service_env(redis_url, pg_url))
    assert run.returncode == 2 and "port must be 0-65535" in run.stderr

    env = service_env(redis_url, pg_url, DEDUP_HOST="0.0.0.0", DEDUP_WORKERS="2")
    run = _dedup("check", env=env)
    assert run.returncode == 0 and "WARN config   host 0.0.0.0" in run.stdout


async def test_embedded_default_serves(tmp_path: Path) -> None:
    """No URLs: a private redis-server and SQLite under --data-dir, as documented
    (docs/configuration.md, "The embedded default")."""
    env = service_env("", "")
    del env["DEDUP_REDIS_URL"], env["DEDUP_DATABASE_URL"]
    svc = spawn_service(tmp_path, env, args=["--data-dir", str(tmp_path / "data")])
    try:
        await wait_healthy(svc)
        async with aiohttp.ClientSession(base_url=svc.url) as http:
            item = {"kind": "e", "value": "x"}
            status, body, _ = await request(http, "POST", "/v1/save", json=item)
            assert (status, body) == (201, {"created": True, "source": "write"})
            status, body, _ = await request(http, "GET", "/readyz")
            assert status == 200 and body["checks"] == {"redis": True, "database": True}
        svc.terminate()
        assert await wait_exit(svc) == 0
        assert (tmp_path / "data" / "dedup.sqlite3").is_file()
        run = _dedup("serve", "--workers", "2", "--data-dir", str(tmp_path / "d2"), env=env)
        assert run.returncode == 2 and "embedded default belongs to one process" in run.stderr
    finally:
        if svc.proc.poll() is None:
            svc.kill()


def test_sigint_while_workers_start_exits_cleanly(
    redis_url: str, pg_url: str, tmp_path: Path
) -> None:
    """A supervisor stopped while its workers start ends them all (bounded) with no error."""
    svc = spawn_service(tmp_path, service_env(redis_url, pg_url), args=["--workers", "2"])
    try:
        deadline = time.monotonic() + WAIT
        # Signal once both workers exist (a spawned worker takes a while to import).
        while len(_worker_pids(svc.proc.pid)) < 2:
            assert time.monotonic() < deadline and svc.proc.poll() is None, svc.log_text()
            time.sleep(0.01)
        svc.proc.send_signal(signal.SIGINT)
        assert svc.wait() == 0, svc.log_text()
    finally:
        if svc.proc.poll() is None:
            svc.kill()


def _worker_pids(pid: int) -> list[int]:
    """Children of ``pid`` started by multiprocessing's spawn (not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (
                _parent_pid(int(entry.name)) == pid
                and b"spawn_main" in (entry / "cmdline").read_bytes()
            ):
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return found


async def test_serves_while_redis_is_down_at_start_then_uses_it(
    pg_url: str, tmp_path: Path
) -> None:
    """`dedup serve` listens with Redis down, answers new values (201) through the
    database, says so in /readyz, and leaves degraded mode once Redis starts."""
    from tests.servers import free_port

    port = free_port()
    env = service_env(
        f"redis://127.0.0.1:{port}/0", pg_url, DEDUP_BREAKER_COOLDOWN_S="0.2",
        DEDUP_REDIS_TIMEOUT_S="0.5",
    )  # fmt: skip
    svc = spawn_service(tmp_path, env)
    try:
        await wait_healthy(svc)
        async with aiohttp.ClientSession(
            base_url=svc.url, timeout=aiohttp.ClientTimeout(total=60)
        ) as http:
            status, body, _ = await request(
                http, "POST", "/v1/save", json={"kind": "down-at-start", "value": "a"}
            )
            assert (status, body) == (201, {"created": True, "source": "write"})
            status, ready, _ = await request(http, "GET", "/readyz")
            assert status == 200 and ready["degraded"] is True
            assert ready["reason"] == "unreachable" and ready["checks"]["redis"] is False
            with RedisServer(port):
                deadline = time.monotonic() + WAIT
                while True:
                    status, ready, _ = await request(http, "GET", "/readyz")
                    if status == 200 and not ready["degraded"]:
                        break
                    assert time.monotonic() < deadline, ready
                    await asyncio.sleep(0.1)
                assert "reason" not in ready
                status, body, _ = await request(
                    http, "POST", "/v1/save", json={"kind": "down-at-start", "value": "b"}
                )
                assert (status, body) == (201, {"created": True, "source": "write"})
                status, body, _ = await request(
                    http, "POST", "/v1/save", json={"kind": "down-at-start", "value": "a"}
                )
                assert status == 200 and body["created"] is False
    finally:
        svc.stop()
    assert "starting degraded" in svc.log_text()
