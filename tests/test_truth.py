"""The database stays the source of truth when it loses rows (dedup._engine.guardian).

Against the real servers: rows deleted by plain SQL (DELETE, TRUNCATE; PostgreSQL and
SQLite), a PostgreSQL cluster put back in time (its data folder halted, copied, and put
back with the gateways still running), a SQLite file put back and ``reconcile``, and
saves during a reconcile. In each, the contract is checked: after the bound, every lost
value saves as new exactly once (one ``created=True`` over every gateway), its row is
back, and nothing else is created twice. The tests whose Redis work differs between
server versions (the forget's scripts, the reset) run on Redis 6.2 too (``redis6``).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import asyncpg
import pytest

from dedup import Gateway
from dedup._engine.guardian import GUARD_S
from dedup._engine.invalidation import FORGET_WAIT_S
from dedup.cli.main import main as cli_main
from dedup.store.migrate import upgrade
from dedup.testing.servers import PostgresCluster, RedisServer

KIND = "email"
DEADLINE_S = 30.0
"""The bound on every wait for something that must happen."""
SQL_DELETE_BOUND_S = 2 * GUARD_S + FORGET_WAIT_S + 1.0
"""The documented bound: a value deleted by SQL saves as new within this (a round of
the drainer to find its tombstone, the forget's wait, and a round's slack)."""


def _values(n: int, tag: str) -> list[str]:
    return [f"{tag}-{i}@example.com" for i in range(n)]


async def _pg_rows(url: str) -> Counter[str]:
    conn = await asyncpg.connect(url, timeout=DEADLINE_S)
    try:
        records = await conn.fetch("SELECT value FROM dedup_items WHERE kind = $1", KIND)
    finally:
        await conn.close()
    return Counter(r[0] for r in records)


async def _pg_execute(url: str, sql: str, *args: object) -> None:
    conn = await asyncpg.connect(url, timeout=DEADLINE_S)
    try:
        await conn.execute(sql, *args)
    finally:
        await conn.close()


async def _save_until_created(
    gateways: Sequence[Gateway], values: Sequence[str], deadline_s: float
) -> tuple[Counter[str], float]:
    """Save every value through every gateway, round after round, until each of
    ``values`` was created once (or the deadline): how many times each was created,
    and how long it took."""
    created: Counter[str] = Counter()
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        for gw in gateways:
            results = await gw.save_many([(KIND, v) for v in values])
            created.update(v for v, r in zip(values, results, strict=True) if r.created)
        if all(created[v] for v in values):
            break
        await asyncio.sleep(0.05)
    return created, time.monotonic() - start


# ------------------------------------------------------------------ deleted by SQL


@pytest.mark.redis6
@pytest.mark.parametrize("layout", ["compact", "keys"])
async def test_rows_deleted_by_sql_save_again_once_through_both_gateways(
    redis_url: str, pg_url: str, layout: str
) -> None:
    values = _values(300, "del")
    gone = values[:150]
    async with (
        Gateway(redis_url, pg_url, marker_layout=layout) as a,
        Gateway(redis_url, pg_url, marker_layout=layout) as b,
    ):
        assert all(r.created for r in await a.save_many([(KIND, v) for v in values]))
        # Both gateways know every value (B from Redis, then from its own tier).
        assert not any(r.created for r in await b.save_many([(KIND, v) for v in values]))
        assert {r.source for r in await b.save_many([(KIND, v) for v in values])} == {"local"}

        await _pg_execute(pg_url, "DELETE FROM dedup_items WHERE value = ANY($1::text[])", gone)
        created, took = await _save_until_created([a, b], gone, DEADLINE_S)
        assert all(created[v] == 1 for v in gone), Counter(created.values())
        assert took < SQL_DELETE_BOUND_S + 1.0, took  # the bound, and a second of slack
        # Saved again and again meanwhile and since: created once, never twice.
        for gw in (a, b):
            again = await gw.save_many([(KIND, v) for v in values])
            assert not any(r.created for r in again)
        assert (a.stats().tombstones_drained + b.stats().tombstones_drained) == len(gone)
    assert await _pg_rows(pg_url) == Counter({v: 1 for v in values})


@pytest.mark.redis6
async def test_a_truncated_table_saves_every_value_again_once(redis_url: str, pg_url: str) -> None:
    values = _values(200, "trunc")
    async with Gateway(redis_url, pg_url) as a, Gateway(redis_url, pg_url) as b:
        await a.save_many([(KIND, v) for v in values])
        await b.save_many([(KIND, v) for v in values])
        await _pg_execute(pg_url, "TRUNCATE dedup_items")
        created, _ = await _save_until_created([a, b], values, DEADLINE_S)
        assert all(created[v] == 1 for v in values), Counter(created.values())
        assert a.stats().marker_resets + b.stats().marker_resets >= 1
    assert await _pg_rows(pg_url) == Counter({v: 1 for v in values})


async def test_dedups_own_forgets_leave_no_tombstones(redis_url: str, pg_url: str) -> None:
    async with Gateway(redis_url, pg_url) as gw:
        await gw.save_many([(KIND, v) for v in _values(10, "own")])
        assert await gw.forget_many([(KIND, v) for v in _values(5, "own")]) == [True] * 5
        conn = await asyncpg.connect(pg_url, timeout=DEADLINE_S)
        try:
            assert await conn.fetchval("SELECT count(*) FROM dedup_tombstones") == 0
            await conn.execute("DELETE FROM dedup_items WHERE kind = $1", KIND)
            assert await conn.fetchval("SELECT count(*) FROM dedup_tombstones") == 5
        finally:
            await conn.close()


async def test_rows_deleted_from_sqlite_save_again(redis_url: str, tmp_path: Path) -> None:
    path = tmp_path / "items.db"
    url = f"sqlite:///{path}"
    await asyncio.to_thread(upgrade, url)
    values = _values(50, "lite")
    async with Gateway(redis_url, url) as gw:
        await gw.save_many([(KIND, v) for v in values])

        def delete() -> None:
            with sqlite3.connect(path, timeout=DEADLINE_S) as db:
                marks = ",".join("?" * 25)
                db.execute(f"DELETE FROM dedup_items WHERE value IN ({marks})", values[:25])

        await asyncio.to_thread(delete)
        created, _ = await _save_until_created([gw], values[:25], DEADLINE_S)
        assert all(created[v] == 1 for v in values[:25]), Counter(created.values())
        assert not any(r.created for r in await gw.save_many([(KIND, v) for v in values]))
        assert await gw.count_rows([KIND]) == 50


# ---------------------------------------------------------------- back in time


async def test_a_database_put_back_in_time_is_noticed_and_lost_values_save_once(
    redis_url: str, fresh_pg: PostgresCluster
) -> None:
    """The data folder halted and copied (a backup), values saved, the copy put back
    (a restore), PostgreSQL started on the same port with the gateways still running:
    no command is run; the gateways notice and each lost value is created once."""
    url = fresh_pg.create_database("rewind")
    await asyncio.to_thread(upgrade, url)
    before, after = _values(100, "old"), _values(200, "new")
    async with Gateway(redis_url, url) as a, Gateway(redis_url, url) as b:
        await a.save_many([(KIND, v) for v in before])
        await asyncio.to_thread(fresh_pg.halt)
        backup = await asyncio.to_thread(fresh_pg.snapshot)
        await asyncio.to_thread(fresh_pg.start)
        created, _ = await _save_until_created([a], after, DEADLINE_S)
        assert all(created[v] == 1 for v in after)
        await b.save_many([(KIND, v) for v in after])  # in B's tier too
        await asyncio.sleep(3 * GUARD_S)  # the gateways read the database's position

        await asyncio.to_thread(fresh_pg.halt)
        await asyncio.to_thread(fresh_pg.rewind, backup)
        await asyncio.to_thread(fresh_pg.start)
        assert await _pg_rows(url) == Counter({v: 1 for v in before})  # the 200 are lost

        created, _ = await _save_until_created([a, b], after, DEADLINE_S)
        assert all(created[v] == 1 for v in after), Counter(created.values())
        assert a.stats().marker_resets + b.stats().marker_resets >= 1
        for gw in (a, b):  # nothing is created twice since, old or new
            again = await gw.save_many([(KIND, v) for v in before + after])
            assert not any(r.created for r in again)
    assert await _pg_rows(url) == Counter({v: 1 for v in before + after})


async def test_reconcile_after_a_sqlite_file_was_put_back(
    fresh_redis: RedisServer, tmp_path: Path
) -> None:
    """A SQLite file cannot tell that it went back in time: ``dedup reconcile`` (the
    command, next to the running gateway) resets the markers, and each lost value is
    created once."""
    path, backup = tmp_path / "items.db", tmp_path / "backup.db"
    url = f"sqlite:///{path}"
    await asyncio.to_thread(upgrade, url)
    before, after = _values(20, "kept"), _values(30, "lost")

    def copy(src: Path, dst: Path) -> None:
        with sqlite3.connect(src, timeout=DEADLINE_S) as s, sqlite3.connect(dst) as d:
            s.backup(d)

    async with Gateway(fresh_redis.url, url) as gw:
        await gw.save_many([(KIND, v) for v in before])
        await asyncio.to_thread(copy, path, backup)
        await gw.save_many([(KIND, v) for v in after])
        await asyncio.to_thread(copy, backup, path)  # the restore: the 30 rows are gone
        assert await gw.count_rows([KIND]) == 20
        assert not any(r.created for r in await gw.save_many([(KIND, v) for v in after]))

        argv = ["reconcile", "--redis-url", fresh_redis.url, "--database-url", url]
        assert await asyncio.to_thread(cli_main, argv) == 0
        created, _ = await _save_until_created([gw], after, DEADLINE_S)
        assert all(created[v] == 1 for v in after), Counter(created.values())
        assert not any(r.created for r in await gw.save_many([(KIND, v) for v in before]))
        assert await gw.count_rows([KIND]) == 50


@pytest.mark.redis6
async def test_saves_during_a_reconcile_lose_nothing_and_create_nothing_twice(
    redis_url: str, pg_url: str
) -> None:
    values = _values(400, "busy")
    created: Counter[str] = Counter()
    async with Gateway(redis_url, pg_url) as a, Gateway(redis_url, pg_url) as b:
        await a.save_many([(KIND, v) for v in values[:200]])
        stop = asyncio.Event()

        async def saver(gw: Gateway, offset: int) -> None:
            i = offset
            while not stop.is_set():
                chunk = [values[(i + j) % len(values)] for j in range(37)]
                results = await gw.save_many([(KIND, v) for v in chunk])
                created.update(v for v, r in zip(chunk, results, strict=True) if r.created)
                i += 37

        tasks = [asyncio.create_task(saver(a, 0)), asyncio.create_task(saver(b, 111))]
        try:
            done = await asyncio.wait_for(b.reconcile(), DEADLINE_S)
            assert done.epoch >= 1
            await asyncio.sleep(GUARD_S)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        # Every value saved before or during it has its row: one each, created once.
        for gw in (a, b):
            assert not any(r.created for r in await gw.save_many([(KIND, v) for v in values]))
    rows = await _pg_rows(pg_url)
    assert rows == Counter({v: 1 for v in values})
    assert all(created[v] == 1 for v in values[200:]), Counter(created.values())
    assert not any(created[v] for v in values[:200])


async def test_a_standby_promoted_without_the_last_commits_is_noticed(
    redis_url: str, fresh_pg: PostgresCluster
) -> None:
    """Asynchronous replication, the standby's link cut while values are saved on the
    primary, the primary SIGKILLed, the standby promoted and moved to its address:
    the gateways, still running, notice the new timeline, and each value the standby
    never received is created once."""
    url = fresh_pg.create_database("failover")
    await asyncio.to_thread(upgrade, url)
    standby = await asyncio.to_thread(fresh_pg.standby)
    try:
        kept, lost = _values(100, "replicated"), _values(150, "tail")
        async with Gateway(redis_url, url) as a, Gateway(redis_url, url) as b:
            await a.save_many([(KIND, v) for v in kept])
            at = fresh_pg.psql("SELECT pg_current_wal_lsn()").strip()
            deadline = time.monotonic() + DEADLINE_S
            while standby.psql(f"SELECT pg_last_wal_replay_lsn() >= '{at}'").strip() != "t":
                assert time.monotonic() < deadline, "the standby did not catch up"
                await asyncio.sleep(0.05)
            # The standby stops receiving (its link cut): what follows never reaches it.
            standby.psql("ALTER SYSTEM SET primary_conninfo = ''")
            standby.psql("SELECT pg_reload_conf()")
            while standby.psql("SELECT count(*) FROM pg_stat_wal_receiver").strip() != "0":
                assert time.monotonic() < deadline, "the standby kept its link"
                await asyncio.sleep(0.05)
            await a.save_many([(KIND, v) for v in lost])
            await b.save_many([(KIND, v) for v in kept + lost])  # in B's tier too
            await asyncio.sleep(3 * GUARD_S)  # the gateways read the primary's position
            await asyncio.to_thread(fresh_pg.kill)  # the primary is gone
            assert standby.psql("SELECT pg_promote()").strip() == "t"
            await asyncio.to_thread(standby.halt)
            standby.listen_on(fresh_pg.port)  # the failover moves the address
            await asyncio.to_thread(standby.start)

            created, _ = await _save_until_created([a, b], lost, DEADLINE_S)
            assert all(created[v] == 1 for v in lost), Counter(created.values())
            assert a.stats().marker_resets + b.stats().marker_resets >= 1
            for gw in (a, b):
                again = await gw.save_many([(KIND, v) for v in kept + lost])
                assert not any(r.created for r in again)
        assert await _pg_rows(url) == Counter({v: 1 for v in kept + lost})
    finally:
        standby.stop()
