"""Redis Sentinel: a primary, a replica and three sentinels, each a real process.

The gateway follows the primary the sentinels name (``redis+sentinel://``): on a
SIGKILLed primary it is degraded (the database decides) until the sentinels promote
the replica, then claims on the new primary; a demoted primary's READONLY makes it ask
the sentinels again. The contract holds throughout: nothing acknowledged is lost and no
value is created twice (tests/test_faults.py's ledger and checks).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import ReadOnlyError, ResponseError

from dedup import ConfigError, Gateway
from dedup._redis.connect import connect_redis
from dedup._redis.script import Script, run_script
from dedup.lock import Lock, fenced_set
from dedup.testing.sentinel import SERVICE, RedisSentinelServers
from dedup.urls import parse_sentinel_url, redact
from tests.test_cluster_failover import sampled, serves_on_redis_again
from tests.test_faults import Ledger, check_contract, loaded, until
from tests.test_multiprocess import read_line
from tests.test_service import request, service_env, spawn_service, wait_healthy

ROOT = Path(__file__).resolve().parent.parent

OPTIONS: dict[str, Any] = {
    "redis_timeout_s": 0.5,
    "breaker_cooldown_s": 0.5,
    "lease_ms": 1000,
}


_SET = Script("return redis.call('SET', KEYS[1], ARGV[1])")


@pytest.fixture
def sentinel() -> Iterator[RedisSentinelServers]:
    with RedisSentinelServers(1, 3, down_after_ms=1000) as servers:
        yield servers


def test_sentinel_urls_are_read_and_checked() -> None:
    parts = parse_sentinel_url(
        "redis+sentinel://app:p%40ss@10.0.0.1:26379,[::1]:26380/cache/2?sentinel_password=s"
    )
    assert parts.sentinels == [("10.0.0.1", 26379), ("::1", 26380)]
    assert (parts.service, parts.db, parts.username, parts.password) == ("cache", 2, "app", "p@ss")
    assert parts.options == {"sentinel_password": "s"} and not parts.tls
    tls = parse_sentinel_url("rediss+sentinel://h:1/svc?ssl_ca_certs=/ca.pem")
    assert tls.tls and tls.db == 0 and tls.password is None
    for bad, words in (
        ("redis+sentinel://h:1/", "names its service"),
        ("redis+sentinel://h/svc", "host:port"),
        ("redis+sentinel://h:1,h2:x/svc", "host:port"),
        ("redis+sentinel://h:1/svc/zero", "a number"),
        ("redis+sentinel://h:1/svc?retries=3", "not 'retries'"),
        ("redis+sentinel://h:1/svc?ssl_ca_certs=/ca.pem", "rediss"),
        ("redis+sentinel://u:pa/ss@h:1/svc", "percent-encode"),
    ):
        with pytest.raises(ConfigError, match=words) as info:
            parse_sentinel_url(bad)
        assert "pa/ss" not in str(info.value)
    assert redact("redis+sentinel://:secret@h:1/s?sentinel_password=other") == (
        "redis+sentinel://:***@h:1/s?sentinel_password=***"
    )


@pytest.mark.redis6
async def test_everything_works_through_the_sentinels(
    sentinel: RedisSentinelServers, pg_url: str, tmp_path: Path
) -> None:
    # The Gateway (claims, shared writes' channels, the invalidation channel, forget), the
    # lock library with fences, dedup check and the service, all through the sentinels.
    async with Gateway(sentinel.url, pg_url, **OPTIONS) as gw:
        assert (await gw.save("email", "a@example.com")).created
        assert (await gw.save("email", "a@example.com")).source == "local"
        assert await gw.forget("email", "a@example.com") is True
        assert (await gw.save("email", "a@example.com")).created
    client = connect_redis(sentinel.url, max_connections=4, timeout_s=2)
    managers = Sentinel([("127.0.0.1", s.port) for s in sentinel.sentinels])  # type: ignore[no-untyped-call]
    theirs = managers.master_for(SERVICE)  # redis-py's own Sentinel client
    try:
        assert isinstance(client, Redis)
        for lockable in (client, theirs):
            async with Lock(lockable, "job", timeout=5) as lock:
                assert lock.fence is not None and lock.fence >= 1
                await fenced_set(lockable, "job-resource", "written", lock.fence)
        primary = await client.connection_pool.get_master_address()  # type: ignore[attr-defined]
        assert primary == ("127.0.0.1", sentinel.primary.port)
    finally:
        await client.aclose()
        await theirs.aclose()
        for s in managers.sentinels:
            await s.aclose()
    out = subprocess.run(
        [sys.executable, "-m", "dedup", "check", "--redis-url", sentinel.url,
         "--database-url", pg_url],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    svc = spawn_service(tmp_path, service_env(sentinel.url, pg_url))
    try:
        await wait_healthy(svc)
        async with aiohttp.ClientSession(svc.url) as http:
            body = {"kind": "email", "value": "svc@example.com"}
            status, answer, _ = await request(http, "POST", "/v1/save", json=body)
            assert (status, answer["created"]) == (201, True)
            status, answer, _ = await request(http, "POST", "/v1/forget", json=body)
            assert (status, answer) == (200, {"forgotten": True})
    finally:
        svc.stop()
    assert f"primary 127.0.0.1:{sentinel.primary.port}" in out.stdout


@pytest.mark.redis6
async def test_a_demoted_primary_is_left_for_the_new_one(sentinel: RedisSentinelServers) -> None:
    # SENTINEL FAILOVER promotes the replica; the old primary is turned replica (here
    # at once, by hand, before the sentinels reconfigure it and close its clients) and
    # answers writes with READONLY. A client still connected to it gets that answer once,
    # drops the connection and asks the sentinels again: its next call goes to the new
    # primary.
    old, (new,) = sentinel.primary, sentinel.replicas
    client = connect_redis(sentinel.url, max_connections=4, timeout_s=2)
    try:
        assert isinstance(client, Redis)
        mux = client.connection_pool.mux  # type: ignore[attr-defined]
        assert (await run_script(client, _SET, [b"k"], ["before"]))[0] == b"OK"
        assert mux.address == ("127.0.0.1", old.port)
        sentinel.command(sentinel.sentinels[0], "SENTINEL", "FAILOVER", SERVICE)
        await until(
            "every sentinel to name the new primary", lambda: sentinel.named_by_all(new.port)
        )
        sentinel.command(old, "REPLICAOF", "127.0.0.1", new.port)
        with pytest.raises(ResponseError) as info:  # ReadOnlyError, or ERR around it (6.2)
            await run_script(client, _SET, [b"k"], ["on the demoted primary"])
        assert "READONLY" in str(info.value) or isinstance(info.value, ReadOnlyError)
        assert (await run_script(client, _SET, [b"k"], ["after"]))[0] == b"OK"
        assert mux.address == ("127.0.0.1", new.port)
    finally:
        await client.aclose()


async def test_a_gateway_follows_a_manual_failover_before_the_old_primary_is_demoted(
    sentinel: RedisSentinelServers, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The sentinels name the new primary seconds before the old one stops taking writes:
    # a gateway asks them every second, so its claims move within about that, without a
    # READONLY, an error or degraded mode.
    new = sentinel.replicas[0]
    ledger = Ledger()
    async with (
        Gateway(sentinel.url, pg_url, **OPTIONS) as gw,
        sampled(gw) as degraded,
        loaded([gw], ledger, both=False) as load,
    ):
        await load.grows_by(300, "saves before the failover")
        sentinel.command(sentinel.sentinels[0], "SENTINEL", "FAILOVER", SERVICE)
        named_s = await until("the new primary named", lambda: sentinel.primary_port() == new.port)

        def clients() -> int:
            return int(sentinel.command(new, "INFO", "clients")["connected_clients"])

        before = clients()
        moved_s = await until("the claims on the new primary", lambda: clients() > before + 1)
        await load.grows_by(300, "saves after the failover")
        stats = gw.stats()
    await check_contract(
        capsys, "sentinel manual failover", pg_url, ledger,
        named_after_s=round(named_s, 2), moved_after_s=round(named_s + moved_s, 2),
        degraded_s=round(degraded.seconds, 2), breaker_opens=stats.breaker_opens,
    )  # fmt: skip
    assert moved_s < 10


CHILD_CAP_S = 60.0
"""Bound of the child's stream in the failover test (it stops when told, well before)."""
CHILD_SAVES_AFTER = 100
"""Saves the child makes once the test saw the gateway on Redis again, before it stops."""


def _child(url: str, pg_url: str, seconds: float) -> subprocess.Popen[str]:
    job = {"redis_url": url, "database_url": pg_url, "options": OPTIONS}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.forget_child", json.dumps(job)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert read_line(proc, 60) == "READY"
    values = [f"u{i}@example.com" for i in range(30_000)]  # the in-process load's values
    assert proc.stdin is not None
    proc.stdin.write(json.dumps({"op": "stream", "values": values, "seconds": seconds}) + "\n")
    proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
    proc.stdin.flush()
    return proc


@pytest.mark.redis6
async def test_primary_sigkilled_under_load_from_two_processes(
    sentinel: RedisSentinelServers, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two gateway processes save (this one and a child); the primary is SIGKILLed; the
    # sentinels promote the replica. Nothing acknowledged is lost, nothing is created
    # twice, every row is a value someone tried; the time without Redis is measured.
    ledger = Ledger()
    child = _child(sentinel.url, pg_url, seconds=CHILD_CAP_S)
    try:
        async with (
            Gateway(sentinel.url, pg_url, **OPTIONS) as gw,
            sampled(gw) as degraded,
            loaded([gw], ledger, both=False) as load,
        ):
            await load.grows_by(500, "saves before the kill")
            sentinel.primary.kill()  # SIGKILL
            killed = time.monotonic()
            (replica,) = sentinel.replicas
            promoted_s = await until(
                "the replica to be promoted", lambda: sentinel.role(replica) == "master"
            )
            await serves_on_redis_again(gw, load)
            back = time.monotonic()
            on_redis_s = back - killed
            stats = gw.stats()
            # The child stops once it has saved CHILD_SAVES_AFTER values more from now.
            assert child.stdin is not None
            child.stdin.write(json.dumps({"op": "stop", "then": CHILD_SAVES_AFTER}) + "\n")
            child.stdin.flush()
        records = json.loads(await asyncio.to_thread(read_line, child, 90))
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()
    # The child's answers join the ledger: one value list, both processes' flags.
    for value, _, _, created, source in records:
        key = ("email", value)
        ledger.attempted.add(key)
        if created is None:
            ledger.errors[source.split("(")[0]] += 1
        else:
            ledger.acks.setdefault(key, []).append(created)
    rows = await check_contract(
        capsys, "sentinel primary SIGKILLed, replica promoted", pg_url, ledger,
        promoted_after_s=round(promoted_s, 2), degraded_s=round(degraded.seconds, 2),
        on_redis_again_after_s=round(on_redis_s, 2), breaker_opens=stats.breaker_opens,
        degraded_answers=stats.degraded_answers, child_saves=len(records),
    )  # fmt: skip
    assert rows <= ledger.attempted  # no row that nobody tried
    assert stats.breaker_opens >= 1  # the kill was seen
    # The child saved throughout, and again after the failover.
    assert sum(1 for r in records if r[3] is not None and r[2] < killed) > 0
    assert sum(1 for r in records if r[3] is not None and r[1] > back) >= CHILD_SAVES_AFTER
