"""A Redis that answers but cannot take writes (full, read-only, MISCONF) is not an outage:
the gateway degrades, the database's unique key decides, and it comes back by itself."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from dedup import Gateway
from tests.servers import RedisServer
from tests.test_faults import WAIT_S, Ledger, check_contract, until

pytestmark = pytest.mark.slow

FAST: dict[str, Any] = {
    "breaker_cooldown_s": 0.2,
    "degraded_max_queue": 100_000,
    "degraded_queue_timeout_s": 10.0,
    "wait_timeout_s": WAIT_S,
}


async def test_full_redis_degrades_and_recovers(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with RedisServer(extra_args=["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"]) as r:
        admin = aioredis.Redis.from_url(r.url)
        ledger = Ledger()
        reasons: set[str] = set()
        try:
            async with Gateway(r.url, pg_url, shared_writes="off", **FAST) as gw:
                n = 0
                while not gw.degraded:  # fill Redis with markers until it refuses
                    batch = [("full", f"v{n + i}") for i in range(500)]
                    n += 500
                    ledger.record_all(batch, await gw.save_many(batch))
                    assert n < 400_000, "Redis never filled up"
                reasons.add(gw.degraded_reason)
                for _ in range(20):  # full: every save still acknowledged, via the database
                    batch = [("full", f"v{n + i}") for i in range(500)]
                    n += 500
                    ledger.record_all(batch, await gw.save_many(batch))
                assert gw.degraded and gw.degraded_reason == "oom"
                await admin.config_set("maxmemory", "0")  # memory freed
                await until("the circuit to close", lambda: not gw.degraded)
                batch = [("full", f"v{n + i}") for i in range(500)]
                ledger.record_all(batch, await gw.save_many(batch))
                stats = gw.stats()
        finally:
            await admin.aclose()
    await check_contract(
        capsys, "Redis at maxmemory (OOM)", pg_url, ledger,
        degraded_answers=stats.degraded_answers, reasons=sorted(reasons),
    )  # fmt: skip
    assert reasons == {"oom"}
    assert stats.degraded_answers >= 20 * 500
    assert not ledger.errors
    assert all(flags == [True] for flags in ledger.acks.values())  # one created=True each


async def test_read_only_replica_degrades_and_recovers(
    fresh_redis: RedisServer, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = Ledger()
    with RedisServer() as primary:
        admin = aioredis.Redis.from_url(fresh_redis.url)
        try:
            async with Gateway(fresh_redis.url, pg_url, shared_writes="off", **FAST) as gw:
                first = [("ro", f"a{i}") for i in range(200)]
                ledger.record_all(first, await gw.save_many(first))
                # A failover made this server a replica: it answers, but refuses writes.
                await admin.replicaof("127.0.0.1", primary.port)
                more = [("ro", f"b{i}") for i in range(200)]
                ledger.record_all(more, await gw.save_many(more))
                assert gw.degraded and gw.degraded_reason == "readonly"
                await admin.replicaof("NO", "ONE")  # promoted back
                await until("the circuit to close", lambda: not gw.degraded)
                last = [("ro", f"c{i}") for i in range(200)]
                ledger.record_all(last, await gw.save_many(last))
        finally:
            await admin.aclose()
    await check_contract(capsys, "Redis turned read-only (READONLY)", pg_url, ledger)
    assert not ledger.errors and len(ledger.acks) == 600


async def test_probe_needs_a_write_not_a_ping(fresh_redis: RedisServer, pg_url: str) -> None:
    """A read-only Redis answers PING: the circuit stays open until a write succeeds."""
    with RedisServer() as primary:
        admin = aioredis.Redis.from_url(fresh_redis.url)
        try:
            async with Gateway(fresh_redis.url, pg_url, shared_writes="off", **FAST) as gw:
                await admin.replicaof("127.0.0.1", primary.port)
                assert (await gw.save("probe", "x")).created
                assert gw.degraded
                assert await admin.ping()
                await asyncio.sleep(1.0)  # several cooldowns: each probe's write is refused
                assert gw.degraded and gw.stats().breaker_opens == 1
                await admin.replicaof("NO", "ONE")
                await until("the circuit to close", lambda: not gw.degraded)
        finally:
            await admin.aclose()
