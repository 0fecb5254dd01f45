"""The Gateway against real redis-server and PostgreSQL/SQLite: tiers, outcomes, contract."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest
import redis.asyncio as aioredis

from dedup import (
    ConfigError,
    DedupError,
    Gateway,
    InvalidInput,
    Overloaded,
    Row,
    Unavailable,
    WaitTimeout,
)
from dedup._claims.keys import KeySpace
from dedup._values import digest
from tests.servers import PostgresCluster, RedisServer
from tests.slow_proxy import SlowProxy

GatewayFactory = Callable[..., Gateway]


@pytest.fixture(params=["postgres", "sqlite"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each test runs on both default sinks: PostgreSQL and SQLite."""
    if request.param == "postgres":
        url: str = request.getfixturevalue("pg_url")
        return url
    from dedup.store.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'items.sqlite3'}"
    upgrade(url)
    return url


@pytest.fixture
async def gw(redis_url: str, database_url: str) -> AsyncIterator[Gateway]:
    async with Gateway(redis_url, database_url) as gateway:
        yield gateway


def key_of(kind: str, value: str, namespace: str = "dedup") -> bytes:
    return KeySpace(namespace).key(kind, digest(value))


async def test_first_save_writes_then_local(gw: Gateway) -> None:
    first = await gw.save("email", "a@example.com", payload={"src": "web"})
    assert (first.created, first.source) == (True, "write")
    again = await gw.save("email", "a@example.com")
    assert (again.created, again.source) == (False, "local")
    # Another kind is another value.
    other = await gw.save("phone", "a@example.com")
    assert other.created
    assert await gw.count_rows(["email", "phone"]) == 2
    stats = gw.stats()
    assert (stats.write, stats.local, stats.db_statements, stats.db_rows_sent) == (2, 1, 2, 2)


async def test_repeat_answered_by_its_text_keeps_the_checks(gw: Gateway) -> None:
    """A repeat answered from the local tier is kept by its text, so that the next one
    skips the digest: it is still a local answer, a bad payload is still refused, and a
    closed gateway answers nothing (test_closed_gateway_refuses)."""
    assert (await gw.save("email", "t@example.com")).created
    assert (await gw.save("email", "t@example.com")).source == "local"  # by its digest
    assert "t@example.com" in gw._local.fronts["email"]
    again = await gw.save("email", "t@example.com")  # by its text
    assert (again.created, again.source) == (False, "local")
    assert gw.stats().local == 2
    with pytest.raises(InvalidInput, match="payload"):
        await gw.save("email", "t@example.com", payload={"x": float("nan")})
    assert (await gw.save("email", "t@example.com", payload={"x": 1})).source == "local"
    assert (await gw.save("phone", "t@example.com")).created  # another kind: another value
    assert gw.stats().local == 3


async def test_redis_tier_answers_for_another_gateway(redis_url: str, database_url: str) -> None:
    async with (
        Gateway(redis_url, database_url) as one,
        Gateway(redis_url, database_url, local_cache_size=0) as two,
    ):
        assert (await one.save("email", "x")).created
        r = await two.save("email", "x")
        assert (r.created, r.source) == (False, "redis")
        r = await two.save("email", "x")  # no local tier: Redis answers again
        assert r.source == "redis"
        assert two.stats().db_statements == 0


async def test_db_tier_when_redis_lost_the_marker(redis_url: str, database_url: str) -> None:
    async with Gateway(redis_url, database_url) as one:
        assert (await one.save("email", "x")).created
    client = aioredis.Redis.from_url(redis_url)
    await client.flushall()
    await client.aclose()
    async with Gateway(redis_url, database_url) as two:
        r = await two.save("email", "x")
        assert (r.created, r.source) == (False, "db")
        assert await two.count_rows(["email"]) == 1
        # The conflicting insert still marked it saved in Redis.
        async with Gateway(redis_url, database_url, local_cache_size=0) as three:
            assert (await three.save("email", "x")).source == "redis"


async def test_concurrent_saves_share_one_flight(gw: Gateway) -> None:
    results = await asyncio.gather(*(gw.save("email", "hot") for _ in range(50)))
    assert [r.created for r in results].count(True) == 1
    assert {r.source for r in results} == {"write", "inflight"}
    assert all(r.created == (r.source == "write") for r in results)
    assert gw.stats().db_rows_sent == 1


async def test_many_coroutines_two_gateways_exactly_once(redis_url: str, database_url: str) -> None:
    values = [f"v{i}" for i in range(1500)]
    async with (
        Gateway(redis_url, database_url, max_batch=64) as one,
        Gateway(redis_url, database_url, max_batch=64) as two,
    ):
        created: dict[str, int] = dict.fromkeys(values, 0)
        stream = values * 2
        random.Random(7).shuffle(stream)

        async def worker(gw: Gateway, seed: int) -> None:
            for v in stream[seed::16]:
                r = await gw.save("email", v)
                assert r.created == (r.source == "write")
                created[v] += r.created

        await asyncio.gather(*(worker(one if i % 2 else two, i) for i in range(16)))
        assert set(created.values()) == {1}
        assert await one.count_rows(["email"]) == len(values)
        sent = one.stats().db_rows_sent + two.stats().db_rows_sent
        assert sent == len(values)  # no duplicate ever reached the database


async def test_save_many_results_in_order(gw: Gateway) -> None:
    await gw.save("email", "old")
    rs = await gw.save_many(
        [("email", "old"), ("email", "new", {"n": 1}), ("email", "new"), ("phone", "new")]
    )
    assert [(r.created, r.source) for r in rs] == [
        (False, "local"),
        (True, "write"),
        (False, "inflight"),
        (True, "write"),
    ]
    assert await gw.save_many([]) == []


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (("", "v"), "kind"),
        (("k" * 129, "v"), "kind"),
        ((3, "v"), "kind"),
        (("email", 3), "value"),
        (("email", b"bytes"), "value"),
        (("email", None), "value"),
        (("email", "x" * 8193), "value"),
        (("email", "nul\x00"), "value"),
        (("email", "\ud800"), "value"),
        (("email", "v", {"big": "x" * 70000}), "payload"),
        (("email", "v", {"obj": object()}), "payload"),
        (("email", "v", "\x00"), "payload"),
    ],
)
async def test_bad_input_rejects_whole_batch(gw: Gateway, bad: tuple[Any, ...], field: str) -> None:
    items: list[Any] = [("email", "good-1"), bad, ("email", "good-2")]
    with pytest.raises(InvalidInput) as caught:
        await gw.save_many(items)
    assert caught.value.index == 1 and caught.value.field == field
    assert "item 1" in str(caught.value)
    assert isinstance(caught.value, ValueError)
    with pytest.raises(InvalidInput):
        await gw.save(*bad)
    assert await gw.count_rows(["email", "", "k" * 129]) == 0
    assert gw.pending == 0


async def test_malformed_batch_items(gw: Gateway) -> None:
    for item in ["email", ("email",), ("a", "b", None, "extra"), ["email", "v"]]:
        with pytest.raises(InvalidInput) as caught:
            await gw.save_many([("email", "ok"), item])  # type: ignore[list-item]
        assert caught.value.index == 1
    assert await gw.count_rows(["email"]) == 0


async def test_payload_is_stored(redis_url: str, pg_url: str) -> None:
    async with Gateway(redis_url, pg_url) as gw:
        await gw.save("email", "p@x", payload={"src": "web", "n": [1, 2]})
        await gw.save("email", "p@x", payload={"src": "ignored"})
    conn = await asyncpg.connect(pg_url)
    try:
        row = await conn.fetchrow("SELECT value, payload::text, digest FROM dedup_items")
    finally:
        await conn.close()
    assert row is not None
    assert row["value"] == "p@x"
    assert row["payload"] == '{"n": [1, 2], "src": "web"}'
    assert bytes(row["digest"]) == digest("p@x")


class BlockingSink:
    """A sink that waits for a signal before inserting, and can fail on purpose."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.fail_next = 0
        self.rows: dict[tuple[str, bytes], str] = {}
        self.calls = 0

    async def __call__(self, rows: Sequence[Row]) -> list[tuple[str, bytes]]:
        self.calls += 1
        self.entered.set()
        await self.release.wait()
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("database went away")
        inserted = []
        for r in rows:
            if (r.kind, r.digest) not in self.rows:
                self.rows[(r.kind, r.digest)] = r.value
                inserted.append((r.kind, r.digest))
        return inserted


async def test_cancelled_caller_does_not_cancel_shared_work(redis_url: str) -> None:
    sink = BlockingSink()
    async with Gateway(redis_url, sink=sink) as gw:
        first = asyncio.create_task(gw.save("email", "c"))
        await asyncio.wait_for(sink.entered.wait(), 10)
        second = asyncio.create_task(gw.save("email", "c"))
        await asyncio.sleep(0.01)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        sink.release.set()
        r = await asyncio.wait_for(second, 10)
        assert (r.created, r.source) == (False, "inflight")
        assert list(sink.rows.values()) == ["c"]
        # Committed work is known saved afterwards.
        assert (await gw.save("email", "c")).source == "local"


async def test_failure_is_not_cached_and_leases_are_released(redis_url: str) -> None:
    sink = BlockingSink()
    sink.fail_next = 1
    async with Gateway(redis_url, sink=sink) as gw:
        calls = [asyncio.create_task(gw.save("email", "f")) for _ in range(3)]
        await asyncio.wait_for(sink.entered.wait(), 10)
        sink.release.set()
        for call in calls:
            with pytest.raises(Unavailable) as caught:
                await asyncio.wait_for(call, 10)
            assert caught.value.component == "database"
        client = aioredis.Redis.from_url(redis_url)
        try:
            assert await client.exists(key_of("email", "f")) == 0  # the lease was released
        finally:
            await client.aclose()
        r = await gw.save("email", "f")
        assert (r.created, r.source) == (True, "write")
        assert gw.stats().db_errors == 1


async def test_waits_for_other_writer_then_takes_over_expired_lease(
    redis_url: str, database_url: str
) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        # Another writer holds the lease for 400 ms and then dies without a word.
        await client.set(key_of("email", "w"), "Lsomeone-else", px=400)
        async with Gateway(redis_url, database_url) as gw:
            r = await gw.save("email", "w")
            assert (r.created, r.source) == (True, "write")
            stats = gw.stats()
            assert stats.busy >= 1
            assert stats.claim_batches < 200  # backoff, not a hot loop
    finally:
        await client.aclose()


async def test_waiter_sees_other_writers_commit(redis_url: str, database_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.set(key_of("email", "w2"), "Lother", px=10_000)
        async with Gateway(redis_url, database_url) as gw:
            task = asyncio.create_task(gw.save("email", "w2"))
            await asyncio.sleep(0.05)
            assert not task.done()
            await client.set(key_of("email", "w2"), "1")  # the other writer committed
            r = await asyncio.wait_for(task, 10)
            assert (r.created, r.source) == (False, "redis")
    finally:
        await client.aclose()


async def test_wait_timeout(redis_url: str, database_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.set(key_of("email", "stuck"), "Lother", px=60_000)
        async with Gateway(redis_url, database_url, wait_timeout_s=0.3) as gw:
            with pytest.raises(WaitTimeout):
                await gw.save("email", "stuck")
            assert gw.stats().wait_timeouts == 1
            assert gw.pending == 0
            assert await gw.count_rows(["email"]) == 0
    finally:
        await client.aclose()


async def test_nearly_spent_lease_is_renewed_before_writing(redis_url: str) -> None:
    """One write at a time, each 0.3 s: the third winner waits 0.6 s for its turn, more
    than its 1 s lease can spare (0.4 s timeout + margin), so it renews before writing."""
    written: list[str] = []

    async def slow(rows: Sequence[Row]) -> list[tuple[str, bytes]]:
        await asyncio.sleep(0.3)
        written.extend(r.value for r in rows)
        return [(r.kind, r.digest) for r in rows]

    async with Gateway(
        redis_url, sink=slow, lease_ms=1000, write_timeout_ms=400, max_write_batches=1, max_batch=1
    ) as gw:
        results = await asyncio.gather(*(gw.save("email", f"r{i}") for i in range(3)))
        assert all(r.created for r in results)
        assert gw.stats().reclaims >= 1
        assert sorted(written) == ["r0", "r1", "r2"]


async def test_overloaded(redis_url: str) -> None:
    sink = BlockingSink()
    async with Gateway(redis_url, sink=sink, max_pending=3, max_batch=3) as gw:
        tasks = [asyncio.create_task(gw.save("email", f"o{i}")) for i in range(3)]
        await asyncio.wait_for(sink.entered.wait(), 10)
        with pytest.raises(Overloaded):
            await gw.save("email", "one-too-many")
        with pytest.raises(Overloaded):
            await gw.save_many([("email", "a"), ("email", "b")])
        sink.release.set()
        assert all(r.created for r in await asyncio.gather(*tasks))
        assert gw.stats().overloaded == 2


async def test_custom_sink_on_own_table(redis_url: str, pg_empty_url: str) -> None:
    pool = await asyncpg.create_pool(pg_empty_url, min_size=1, max_size=2)
    try:
        await pool.execute("CREATE TABLE emails (address text PRIMARY KEY)")

        async def write(rows: Sequence[Row]) -> list[tuple[str, bytes]]:
            recs = await pool.fetch(
                "INSERT INTO emails (address) SELECT * FROM unnest($1::text[]) "
                "ON CONFLICT DO NOTHING RETURNING address",
                [r.value for r in rows],
            )
            inserted = {rec["address"] for rec in recs}
            return [(r.kind, r.digest) for r in rows if r.value in inserted]

        async with Gateway(redis_url, sink=write) as gw:
            rs = await gw.save_many([("email", f"u{i}") for i in range(100)] * 2)
            assert sum(r.created for r in rs) == 100
            with pytest.raises(DedupError):
                await gw.count_rows(["email"])  # only the default sink has a table
        assert await pool.fetchval("SELECT count(*) FROM emails") == 100
    finally:
        await pool.close()


async def test_options_are_checked() -> None:
    with pytest.raises(ConfigError):
        Gateway("redis://x", "postgresql://y", sink=BlockingSink())
    with pytest.raises(ConfigError):
        Gateway(lease_ms=1000, write_timeout_ms=1000)
    with pytest.raises(ConfigError):
        Gateway(max_batch=0)
    with pytest.raises(ConfigError):
        Gateway(namespace="bad*")
    with pytest.raises(ConfigError):
        Gateway(local_cache_size=-1)
    with pytest.raises(ConfigError):
        Gateway("http://nope", "sqlite:///x")
    closed = Gateway("redis://127.0.0.1:1")
    with pytest.raises(DedupError):
        await closed.save("email", "v")


async def test_bad_urls_fail_clearly(tmp_path: Path, redis_url: str) -> None:
    with pytest.raises(ConfigError, match="redis_url must start"):
        async with Gateway("http://127.0.0.1:1", f"sqlite:///{tmp_path}/x.db"):
            pass
    with pytest.raises(ConfigError, match="database_url must start"):
        async with Gateway(redis_url, "mysql://x/y"):
            pass


async def test_redis_unreachable_at_open(tmp_path: Path) -> None:
    from tests.servers import free_port

    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    with pytest.raises(Unavailable) as caught:
        async with Gateway(
            url, f"sqlite:///{tmp_path}/x.db", migrate=True, redis_timeout_s=1, require_redis=True
        ):
            pass
    assert caught.value.component == "redis"
    assert "s3cret" not in str(caught.value)


async def _until(condition: Callable[[], bool], deadline_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not condition():
        assert loop.time() < end, "condition not met before the deadline"
        await asyncio.sleep(0.05)


async def test_starts_degraded_while_redis_is_down_then_uses_it(pg_url: str) -> None:
    from tests.servers import RedisServer, free_port

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    async with Gateway(url, pg_url, redis_timeout_s=0.5, breaker_cooldown_s=0.2) as gw:
        assert gw.degraded and gw.degraded_reason == "unreachable"
        first = await gw.save("start", "while-down")
        assert first.created and first.source == "write"  # the unique key decided
        assert not (await gw.save("start", "while-down")).created
        with RedisServer(port) as server:
            await _until(lambda: not gw.degraded)
            assert gw.degraded_reason == ""
            r = await gw.save("start", "after-up")
            assert r.created and r.source == "write"
            # The marker went to this Redis: a second gateway answers from it.
            async with Gateway(server.url, pg_url, local_cache_size=0) as other:
                assert (await other.save("start", "after-up")).source == "redis"
        assert await gw.count_rows(["start"]) == 2


async def test_an_unsafe_redis_that_comes_up_later_is_never_used(pg_url: str) -> None:
    from tests.servers import RedisServer, free_port

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    async with Gateway(url, pg_url, redis_timeout_s=0.5, breaker_cooldown_s=0.1) as gw:
        assert gw.degraded
        with RedisServer(port, extra_args=["--maxmemory-policy", "allkeys-lru"]) as server:
            await asyncio.sleep(1.0)  # several probes: each finds the policy unsafe
            assert gw.degraded
            assert (await gw.save("unsafe", "v")).created
            client = aioredis.from_url(server.url)
            try:
                assert await client.dbsize() == 0  # no lease, no marker ever went there
            finally:
                await client.aclose()


async def test_database_missing_table_or_unreachable(redis_url: str, pg_empty_url: str) -> None:
    with pytest.raises(ConfigError, match="dedup migrate"):
        async with Gateway(redis_url, pg_empty_url):
            pass
    from tests.servers import free_port

    with pytest.raises(Unavailable) as caught:
        async with Gateway(redis_url, f"postgresql://u:pw@127.0.0.1:{free_port()}/db"):
            pass
    assert caught.value.component == "database"
    assert ":pw@" not in str(caught.value)


async def test_eviction_policy_guard(fresh_redis: RedisServer, tmp_path: Path) -> None:
    client = aioredis.Redis.from_url(fresh_redis.url)
    try:
        await client.config_set("maxmemory-policy", "volatile-lru")
    finally:
        await client.aclose()
    db = f"sqlite:///{tmp_path}/x.db"
    with pytest.raises(ConfigError, match="maxmemory-policy volatile-lru"):
        async with Gateway(fresh_redis.url, db, migrate=True):
            pass
    async with Gateway(fresh_redis.url, db, migrate=True, allow_eviction=True) as gw:
        assert (await gw.save("email", "e")).created


async def test_database_down_then_back(redis_url: str, fresh_pg: PostgresCluster) -> None:
    url = fresh_pg.create_database("app")
    from dedup.store.migrate import upgrade_async

    await upgrade_async(url)
    async with Gateway(redis_url, url, lease_ms=2000) as gw:
        assert (await gw.save("email", "before")).created
        fresh_pg.kill()
        with pytest.raises(Unavailable) as caught:
            await gw.save("email", "during")
        assert caught.value.component == "database"
        client = aioredis.Redis.from_url(redis_url)
        try:
            assert await client.exists(key_of("email", "during")) == 0  # lease released
        finally:
            await client.aclose()
        fresh_pg.restart()
        deadline = asyncio.get_running_loop().time() + 30
        while True:  # recovers by itself: the pool reconnects
            try:
                r = await gw.save("email", "during")
                break
            except Unavailable:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.2)
        assert (r.created, r.source) == (True, "write")
        assert await gw.count_rows(["email"]) == 2


async def test_redis_flushed_mid_run(redis_url: str, database_url: str) -> None:
    """FLUSHALL while saves run: no duplicate rows, every acknowledgement is in the table."""
    values = [f"m{i}" for i in range(3000)]
    created: dict[str, int] = dict.fromkeys(values, 0)
    async with (
        Gateway(redis_url, database_url, max_batch=32, local_cache_size=0) as one,
        Gateway(redis_url, database_url, max_batch=32, local_cache_size=0) as two,
    ):
        client = aioredis.Redis.from_url(redis_url)

        async def worker(gw: Gateway, offset: int) -> None:
            for v in values[offset::8] + values[offset::8]:
                r = await gw.save("email", v)
                created[v] += r.created

        async def flusher() -> None:
            for _ in range(5):
                await asyncio.sleep(0.05)
                await client.flushall()

        try:
            await asyncio.gather(*(worker(one if i % 2 else two, i) for i in range(8)), flusher())
        finally:
            await client.aclose()
        assert await one.count_rows(["email"]) == len(values)
        assert set(created.values()) == {1}


async def test_redis_restarted_empty_mid_run(fresh_redis: RedisServer, database_url: str) -> None:
    """Redis killed and restarted empty under load: failed saves are typed errors, every
    acknowledged value is in the table, no value is created twice, and service resumes."""
    values = [f"k{i}" for i in range(4000)]
    acked: dict[str, list[bool]] = {v: [] for v in values}
    errors = 0
    async with Gateway(fresh_redis.url, database_url, local_cache_size=0, redis_timeout_s=1) as gw:

        async def worker(offset: int) -> None:
            nonlocal errors
            for v in values[offset::8]:
                try:
                    r = await gw.save("email", v)
                except Unavailable:
                    errors += 1
                    continue
                acked[v].append(r.created)

        async def chaos() -> None:
            await asyncio.sleep(0.1)
            fresh_redis.kill()
            await asyncio.sleep(0.3)
            fresh_redis.restart()

        await asyncio.gather(*(worker(i) for i in range(8)), chaos())
        # The gateway serves again by itself: save everything once more.
        for v in values:
            r = await gw.save("email", v)
            acked[v].append(r.created)
        rows = await gw.count_rows(["email"])
    created = {v: sum(a) for v, a in acked.items()}
    lost = sum(1 for a in acked.values() if not a)
    print(f"\nacknowledged={sum(map(len, acked.values()))} errors={errors} lost={lost}")
    assert rows == len(values)
    assert max(created.values()) <= 1  # at most one created=True per value
    assert lost == 0


async def test_close_lets_the_last_batch_mark_its_values_saved(
    redis_url: str, database_url: str
) -> None:
    """A gateway closed as soon as its saves are answered still marks them saved in
    Redis: the markers' commit follows the answers, and here it ends after the close
    began (its replies come 0.2 s late, and its script must be loaded first: the
    server's script cache is empty). Cut off, it would leave the leases to expire, and
    another gateway would wait them out as busy values, then write each again."""
    client = aioredis.Redis.from_url(redis_url)
    parts = urlsplit(redis_url)
    assert parts.hostname is not None and parts.port is not None
    try:
        await client.script_flush()
        values = [("email", f"closing{i}") for i in range(20)]
        async with (
            SlowProxy(parts.hostname, parts.port, delay_s=0.2) as slow,
            # Per-process writes: nothing else (leaving the fleet) delays the close.
            Gateway(slow.url, database_url, shared_writes="off") as gw,
        ):
            first = await gw.save_many(values)
        assert [r.created for r in first] == [True] * len(values)
        async with Gateway(redis_url, database_url, local_cache_size=0) as again:
            results = await again.save_many(values)
            stats = again.stats()
    finally:
        await client.aclose()
    assert [r.source for r in results] == ["redis"] * len(values)
    assert (stats.busy, stats.db_statements) == (0, 0)


async def test_closed_gateway_refuses(redis_url: str, database_url: str) -> None:
    gw = Gateway(redis_url, database_url)
    await gw.open()
    assert (await gw.save("email", "early")).created
    assert (await gw.save("email", "early")).source == "local"  # now kept by its text too
    await gw.aclose()
    with pytest.raises(DedupError, match="closed"):
        await gw.save("email", "early")  # not even from the local tier
    await gw.aclose()  # twice is fine
    with pytest.raises(DedupError, match="closed"):
        await gw.save("email", "late")
    with pytest.raises(DedupError):
        await gw.open()


async def test_scripts_reload_after_script_flush(redis_url: str, database_url: str) -> None:
    async with Gateway(redis_url, database_url) as gw:
        assert (await gw.save("email", "s1")).created
        client = aioredis.Redis.from_url(redis_url)
        try:
            await client.script_flush()
        finally:
            await client.aclose()
        assert (await gw.save("email", "s2")).created  # NOSCRIPT -> loaded again
        assert gw.stats().redis_errors == 0


def test_a_postgresql_gateway_does_not_import_sqlalchemy(redis_url: str, pg_url: str) -> None:
    """SQLAlchemy (the SQLite sink's) and Alembic (migrations) stay out of a process that
    saves to PostgreSQL: about 41,000 objects more that every full pass of the garbage
    collector scans, in every gateway process, and their import time and memory."""
    code = (
        "import asyncio, sys\n"
        "from dedup import Gateway\n"
        "async def main():\n"
        f"    async with Gateway({redis_url!r}, {pg_url!r}) as gw:\n"
        "        assert (await gw.save('k', 'v')).created\n"
        "asyncio.run(main())\n"
        "print(sorted(m for m in ('sqlalchemy', 'alembic') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
