"""A Redis Cluster primary fails under load (3 primaries, 3 replicas, on this box).

Both scenarios check the contract from the PostgreSQL table and the callers' own
records (tests/test_faults.py's ``Ledger`` and ``check_contract``): nothing
acknowledged is lost, no value gets ``created=True`` twice; and the gateway serves
again by itself, with claims back on Redis. The figures (acknowledged, errors, lost,
created twice, seconds degraded) are printed like test_faults' ones.

* SIGKILL a primary: its replica is promoted after ``cluster-node-timeout`` (1 s); the
  gateway is degraded while the slots have no primary (the database's unique key
  decides), then claims on the new primary.
* SIGSTOP a primary that took writes its replica never got (the replica paused, its
  link closed), and promote the replica at once (CLUSTER FAILOVER TAKEOVER): those
  saved markers are lost (a new gateway finds such values in the database instead:
  ``source == "db"``), but ``created`` stays exactly once because the database
  decides; on SIGCONT the old primary rejoins as a replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from dedup import Gateway
from tests.servers import RedisClusterServers
from tests.test_faults import Ledger, Load, check_contract, loaded, until

pytestmark = pytest.mark.slow

OPTIONS: dict[str, Any] = {
    "redis_timeout_s": 0.5,
    "breaker_cooldown_s": 0.5,
    "lease_ms": 1000,
    "local_cache_size": 0,
}


@pytest.fixture
def servers() -> Iterator[RedisClusterServers]:
    with RedisClusterServers(3, 1, node_timeout_ms=1000) as cluster:
        yield cluster


class Degraded:
    """Samples ``gw.degraded`` every 10 ms: the seconds it was degraded in all."""

    def __init__(self, gw: Gateway) -> None:
        self.gw, self.seconds = gw, 0.0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            if self.gw.degraded:
                self.seconds += now - last
            last = now


@contextlib.asynccontextmanager
async def sampled(gw: Gateway) -> AsyncIterator[Degraded]:
    degraded = Degraded(gw)
    try:
        yield degraded
    finally:
        degraded.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await degraded.task


@contextlib.asynccontextmanager
async def under_load(
    servers: RedisClusterServers, pg_url: str, ledger: Ledger
) -> AsyncIterator[tuple[Gateway, Degraded, Load]]:
    """A gateway on the cluster, its degraded time sampled, under a load that has made
    500 saves already."""
    async with (
        Gateway(servers.url, pg_url, **OPTIONS) as gw,
        sampled(gw) as degraded,
        loaded([gw], ledger, both=False) as load,
    ):
        await load.grows_by(500, "saves before the fault")
        yield gw, degraded, load


async def serves_on_redis_again(gw: Gateway, load: Load) -> float:
    """Wait until the circuit is closed and claims go to Redis again; the seconds it took."""
    started = time.monotonic()
    await until("the circuit to close", lambda: not gw.degraded)
    batches = gw.stats().claim_batches
    await load.grows_by(300, "saves after the failover")
    await until("claims on Redis again", lambda: gw.stats().claim_batches > batches + 5)
    assert not gw.degraded
    return time.monotonic() - started


async def saved_again(url: str, pg_url: str, ledger: Ledger) -> Counter[str]:
    """A new gateway saves every acknowledged value again: none may be created."""
    acked = sorted(key for key, flags in ledger.acks.items() if flags)
    async with Gateway(url, pg_url, **OPTIONS) as gw:
        results = await gw.save_many(acked)
    ledger.record_all(acked, results)
    assert not any(r.created for r in results)
    return Counter(r.source for r in results)


async def test_primary_sigkilled_under_load_replica_promoted(
    servers: RedisClusterServers, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    victim = servers.nodes[1]
    (replica,) = servers.replicas_of(victim)
    ledger = Ledger()
    async with under_load(servers, pg_url, ledger) as (gw, degraded, load):
        victim.kill()  # SIGKILL
        killed = time.monotonic()
        promoted_s = await until(
            "the replica to be promoted", lambda: servers.role(replica)[0] == "master"
        )
        await until("cluster_state:ok", servers.cluster_ok)
        recovered_s = await serves_on_redis_again(gw, load)
        serving_s = time.monotonic() - killed
        stats = gw.stats()
    sources = await saved_again(servers.url, pg_url, ledger)
    await check_contract(
        capsys, "cluster primary SIGKILLed, replica promoted", pg_url, ledger,
        promoted_after_s=round(promoted_s, 2), degraded_s=round(degraded.seconds, 2),
        on_redis_again_after_s=round(serving_s, 2), breaker_opens=stats.breaker_opens,
        degraded_answers=stats.degraded_answers, saved_again=dict(sources),
    )  # fmt: skip
    assert recovered_s < 20


async def test_paused_primary_replaced_by_takeover(
    servers: RedisClusterServers, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    victim = servers.nodes[2]
    (replica,) = servers.replicas_of(victim)
    ledger = Ledger()
    async with under_load(servers, pg_url, ledger) as (gw, degraded, load):
        # Make the primary take writes its replica never gets: the replica is paused (it
        # cannot reconnect) and its link closed; the primary goes on taking writes alone.
        replica.pause()
        try:
            servers.command(victim, "CLIENT", "KILL", "TYPE", "replica")
            await load.grows_by(300, "saves the replica does not get")
        finally:
            victim.pause()  # SIGSTOP: it keeps what its replica never received
            replica.resume()
        try:
            paused = time.monotonic()
            await asyncio.sleep(0.3)
            servers.command(replica, "CLUSTER", "FAILOVER", "TAKEOVER")
            await until("the replica to take over", lambda: servers.role(replica)[0] == "master")
            await until(
                "cluster_state:ok",
                lambda: servers.cluster_ok([n for n in servers.nodes if n is not victim]),
            )
            recovered_s = await serves_on_redis_again(gw, load)
            serving_s = time.monotonic() - paused
        finally:
            victim.resume()
        # The old primary wakes up, sees a newer epoch for its slots, becomes a replica.
        await until("the old primary to rejoin as a replica",
                    lambda: servers.role(victim)[0] == "slave")  # fmt: skip
        await load.grows_by(300, "saves after the old primary rejoined")
        stats = gw.stats()
    sources = await saved_again(servers.url, pg_url, ledger)
    await check_contract(
        capsys, "cluster primary SIGSTOPped, replica TAKEOVER", pg_url, ledger,
        degraded_s=round(degraded.seconds, 2), on_redis_again_after_s=round(serving_s, 2),
        breaker_opens=stats.breaker_opens, degraded_answers=stats.degraded_answers,
        markers_lost=sources.get("db", 0), saved_again=dict(sources),
    )  # fmt: skip
    assert recovered_s < 20
    # Markers were lost with the writes the replica never got; the table decided.
    assert sources["db"] > 0
