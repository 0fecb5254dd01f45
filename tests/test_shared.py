"""Shared writes: one elected writer for the fleet, and what happens when it fails.

Each scenario checks the contract from the table and the callers' answers
(:func:`tests.test_faults.check_contract`): nothing acknowledged is missing, no
value got created=True twice.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable
from typing import Any

import pytest

from dedup import Gateway
from dedup.store import default_identity
from tests.servers import RedisServer
from tests.test_faults import WAIT_S, Ledger, check_contract, loaded, table, until
from tests.test_processes import Child

pytestmark = pytest.mark.slow

SHARED: dict[str, Any] = {"shared_writes": "on", "lease_ms": 800, "wait_timeout_s": WAIT_S}


def _shared(gw: Gateway) -> Any:
    engine = gw._engine
    assert engine is not None and engine.shared is not None
    return engine.shared


async def test_one_writer_writes_for_every_gateway(
    redis_url: str, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = Ledger()
    async with (
        Gateway(redis_url, pg_url, **SHARED) as a,
        Gateway(redis_url, pg_url, **SHARED) as b,
        Gateway(redis_url, pg_url, **SHARED) as c,
    ):
        gateways = [a, b, c]
        await until("every gateway to listen", lambda: all(_shared(g).active for g in gateways))
        async with loaded(gateways, ledger, both=True) as load:
            await load.grows_by(3000, "saves through the shared writer")
        stats = [g.stats() for g in gateways]
    writers = [s for s in stats if s.shared_statements]
    await check_contract(
        capsys, "shared writes, 3 gateways", pg_url, ledger,
        queued=sum(s.shared_rows_queued for s in stats),
        shared_statements=sum(s.shared_statements for s in stats),
        statements=sum(s.db_statements for s in stats),
    )  # fmt: skip
    assert sum(s.shared_rows_queued for s in stats) > 0
    assert writers, "no gateway wrote for the fleet"
    # Every winner's row went through the one queue: each gateway queued some.
    assert all(s.shared_rows_queued > 0 for s in stats)


async def test_auto_shares_only_while_several_gateways_live(redis_url: str, pg_url: str) -> None:
    ns: dict[str, Any] = {"namespace": "auto-mode"}
    async with Gateway(redis_url, pg_url, **ns) as alone:
        await asyncio.sleep(1.5)  # a heartbeat or two: a fleet of one
        assert not _shared(alone).active
        assert (await alone.save("auto", "one")).created
        assert alone.stats().shared_rows_queued == 0  # written here, no extra hop
        async with Gateway(redis_url, pg_url, **ns) as second:
            await until("both to see a fleet of two", lambda: _shared(alone).active)
            await until("the second to see it too", lambda: _shared(second).active)
            results = await asyncio.gather(*(alone.save("auto", f"v{i}") for i in range(50)))
            assert all(r.created for r in results)
            assert alone.stats().shared_rows_queued > 0
        # The second one left: the first goes back to writing its own winners.
        await until("a fleet of one again", lambda: not _shared(alone).active, 10)


def _hold_child(spawn: Callable[[dict[str, Any]], Child], redis_url: str, pg_url: str) -> Child:
    """A gateway whose sink hangs for good: as the fleet's writer it pops rows and never
    writes them (a hung writer); its own claim batch is what made it the writer."""
    child = spawn(
        {
            "mode": "hold",
            "redis_url": redis_url,
            "identity": default_identity(pg_url),
            "items": [["held", f"h{i}"] for i in range(5)],
            "options": SHARED,
        }
    )
    assert child.read_line().startswith("HOLDING")
    return child


async def test_hung_then_killed_writer_loses_nothing(
    redis_url: str,
    pg_url: str,
    spawn: Callable[[dict[str, Any]], Child],
    capsys: pytest.CaptureFixture[str],
) -> None:
    holder = _hold_child(spawn, redis_url, pg_url)
    ledger = Ledger()
    async with Gateway(redis_url, pg_url, **SHARED) as gw:
        await until("listening", lambda: _shared(gw).active)
        values = [("email", f"hung{i}") for i in range(200)]
        # Queued for the hung writer: answered after one lease, written here.
        for key, r in zip(values, await gw.save_many(values), strict=True):
            ledger.record(key, r)
        assert all(r for flags in ledger.acks.values() for r in flags)
        assert not _shared(gw).writer
        holder.kill()  # SIGKILL: its writer lease runs out, this gateway takes over
        await until("the writer lease to pass here", lambda: _shared(gw).writer)
        more = [("email", f"after{i}") for i in range(200)]
        for key, r in zip(more, await gw.save_many(more), strict=True):
            ledger.record(key, r)
        stats = gw.stats()
    await check_contract(
        capsys, "shared writer hung, then SIGKILLed", pg_url, ledger,
        shared_statements=stats.shared_statements,
    )  # fmt: skip
    assert stats.shared_statements > 0  # it became the writer after the kill
    assert len(ledger.acks) == 400 and all(all(f) for f in ledger.acks.values())


async def test_paused_writer_is_taken_over(
    redis_url: str,
    pg_url: str,
    spawn: Callable[[dict[str, Any]], Child],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Any,
) -> None:
    values = [f"p{i}" for i in range(600)]
    out = tmp_path / "paused.jsonl"
    writer = spawn(
        {
            "mode": "save",
            "redis_url": redis_url,
            "database_url": pg_url,
            "items": [["email", v] for v in values],
            "concurrency": 8,
            "out": str(out),
            "name": "paused",
            "options": SHARED,
        }
    )
    assert writer.read_line() == "READY"  # it opened first: it stands for writer first
    ledger = Ledger()
    async with Gateway(redis_url, pg_url, **SHARED) as gw:
        await until("listening", lambda: _shared(gw).active)
        first = [("email", v) for v in values[:200]]
        for key, r in zip(first, await gw.save_many(first), strict=True):
            ledger.record(key, r)
        assert gw.stats().shared_statements == 0  # the child wrote them
        os.kill(writer.pid, signal.SIGSTOP)  # paused, past its lease
        try:
            rest = [("email", v) for v in values[200:]]
            for key, r in zip(rest, await gw.save_many(rest), strict=True):
                ledger.record(key, r)
            await until("the writer lease to pass here", lambda: _shared(gw).writer)
        finally:
            os.kill(writer.pid, signal.SIGCONT)
        writer.send("go\n")  # the woken writer now saves every value again
        while (line := writer.read_line()) != "DONE":
            pass
    for line in out.read_text().splitlines():
        ledger.record_line(json.loads(line))
    rows = await check_contract(capsys, "shared writer SIGSTOPped past its lease", pg_url, ledger)
    assert {v for _, v in rows} >= set(values)


async def test_redis_restarted_under_shared_writes(
    fresh_redis: RedisServer, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = Ledger()
    options: dict[str, Any] = {**SHARED, "redis_timeout_s": 0.5, "breaker_cooldown_s": 0.3}
    async with (
        Gateway(fresh_redis.url, pg_url, **options) as a,
        Gateway(fresh_redis.url, pg_url, **options) as b,
    ):
        await until("listening", lambda: _shared(a).active and _shared(b).active)
        async with loaded([a, b], ledger, both=True) as load:
            await load.grows_by(500, "saves before the fault")
            fresh_redis.kill()  # the queue, the leases and the writer lease are gone
            await until("degraded", lambda: a.degraded and b.degraded)
            await load.grows_by(200, "saves while Redis is down")
            await asyncio.to_thread(fresh_redis.restart)
            await until("normal again", lambda: not a.degraded and not b.degraded)
            await until("listening again", lambda: _shared(a).active and _shared(b).active)
            await load.grows_by(500, "saves after the restart")
    await check_contract(capsys, "Redis restarted under shared writes", pg_url, ledger)
    assert len(await table(pg_url)) >= len([k for k, f in ledger.acks.items() if f])
