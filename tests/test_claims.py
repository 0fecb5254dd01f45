"""The claim protocol on a real redis-server: the compact default layout, the old one,
retention by generations, Redis Cluster, and a Redis that cannot take writes."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    ConnectionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
)

from dedup import Gateway
from dedup._claims.bloom import BloomSpec
from dedup._claims.keys import KeySpace, MarkerLayout
from dedup._claims.protocol import Claims
from dedup._claims.scripts import (
    ABORT,
    CLAIM,
    CLAIM_BLOOM,
    CLAIM_COMPACT,
    COMMIT,
    COMMIT_BLOOM,
    COMMIT_COMPACT,
    FORGET,
    FORGET_RELEASE,
)
from dedup._redis.connect import connect_redis, info_of_every_node, probe_write
from dedup._redis.script import (
    REDIS_6,
    REDIS_7,
    VARIANTS,
    Script,
    ScriptVariant,
    cross_slot,
    render,
    run_together,
)
from dedup._redis.server import older_than_floor, script_variant, unwritable_reason
from dedup._values import digest
from dedup.errors import ConfigError
from dedup.metrics import Stats
from tests.servers import RedisServer
from tests.test_cluster import cluster  # noqa: F401 (the fixture)

SPACE = KeySpace("dedup")


def keys_of(*values: str, kind: str = "email", space: KeySpace = SPACE) -> list[bytes]:
    return [space.key(kind, digest(v)) for v in values]


def claims(client: Any, **kwargs: Any) -> Claims:
    kwargs.setdefault("retention_ms", 0)
    return Claims(client, lease_ms=kwargs.pop("lease_ms", 10_000), stats=Stats(), **kwargs)


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Redis]:
    rds = Redis.from_url(redis_url)
    yield rds
    await rds.aclose()


# When a key expires, Unix ms, on every version: PEXPIRETIME is Redis 7.0+, so the
# server's clock plus PTTL, read together (within a millisecond or two of it).
_EXPIRE_TIME = """
local t = redis.call('TIME')
return t[1] * 1000 + math.floor(t[2] / 1000) + redis.call('PTTL', KEYS[1])
"""


async def expire_time_ms(client: Redis, key: bytes) -> int:
    """When ``key`` expires (Unix ms, +-2 ms), on Redis 6 and 7 alike."""
    return int(await client.eval(_EXPIRE_TIME, 1, key))


async def until(check: Any, deadline_s: float = 15.0) -> None:
    """Poll the async ``check`` until it is true, within a generous deadline."""
    end = time.monotonic() + deadline_s
    while not await check():
        assert time.monotonic() < end, "not reached within the deadline"
        await asyncio.sleep(0.05)


# ------------------------------------------------------------------ compact layout


async def test_compact_claim_commit_abort(client: Redis) -> None:
    one, two = claims(client), claims(client)
    assert one.layout == "compact"
    keys = keys_of(*(f"v{i}" for i in range(6)))
    assert await one.claim(keys) == "WWWWWW"
    assert await one.claim(keys) == "WWWWWW"  # our own leases: extended, not busy
    assert await two.claim(keys) == "BBBBBB"
    assert await one.commit(keys[:3]) == 3
    assert await one.abort(keys[3:5]) == 2
    assert await two.claim(keys) == "SSSWWB"
    assert await one.states(keys) == "SSSLLL"  # read only: nothing changes
    assert await claims(client, layout="keys").states(keys[:3]) == "---"  # not its layout
    # Saved values live in buckets, not under their lease keys.
    assert await client.exists(*keys[:3]) == 0
    layout = MarkerLayout()
    for key in keys[:3]:
        (bucket,), field = layout.locate(key)
        assert await client.hget(bucket, field) == b"1"
        # A compact hash, not a hashtable (a listpack from Redis 7.0, a ziplist before).
        assert await client.object("encoding", bucket) in (b"listpack", b"ziplist")
        assert await client.pttl(bucket) == -1  # no retention: no expiry
    # The stranger's commit of a value we still lease: saved all the same.
    assert await two.commit(keys[5:]) == 0
    assert await one.claim(keys) == "SSSBBS"  # 3 and 4: the stranger's leases now
    assert await client.exists(keys[5]) == 0


@pytest.mark.parametrize(("buckets", "shards"), [(65536, 0), (1000, 0), (1, 0), (600, 3)])
async def test_scripts_name_the_buckets_and_fields_the_layout_does(
    client: Redis, buckets: int, shards: int
) -> None:
    # The scripts build bucket names from the lease key and its locator; MarkerLayout
    # .locate, which states() and tools use, must name the same ones.
    space = KeySpace("dedup", cluster_shards=shards)
    gw = claims(client, marker_buckets=buckets, cluster_shards=shards, retention_ms=60_000)
    keys = [
        *keys_of(*(f"n{i}" for i in range(150)), space=space),
        *keys_of(*(f"n{i}" for i in range(150)), kind="phone", space=space),
    ]
    assert await gw.claim(keys) == "W" * 300
    assert await gw.commit(keys) == 300
    reads, _ = gw.generations()
    expected = set()
    for key in keys:
        (bucket, _), field = gw.markers.locate(key, reads)
        expected.add((bucket, field))
    found: set[tuple[Any, Any]] = set()
    async for bucket in client.scan_iter(match=b"dedup:*m*"):
        found.update((bucket, field) for field in await client.hkeys(bucket))
    assert found == expected
    assert await gw.states(keys) == "S" * 300


async def test_compact_retries_are_safe(client: Redis) -> None:
    gw = claims(client)
    keys = keys_of("a", "b")
    assert await gw.claim(keys) == "WW"
    assert await gw.commit(keys) == 2
    assert await gw.commit(keys) == 0  # a retried commit: still saved, nothing held
    assert await gw.claim(keys) == "SS"
    assert await gw.abort(keys) == 0  # an abort after the commit removes nothing
    assert await gw.claim(keys) == "SS"


async def test_a_lease_expires(client: Redis) -> None:
    gw, other = claims(client, lease_ms=300), claims(client)
    keys = keys_of("slow")
    assert await gw.claim(keys) == "W"
    assert await other.claim(keys) == "B"

    async def taken() -> bool:
        return await other.claim(keys) == "W"

    await until(taken)
    assert await gw.commit(keys) == 0  # the first writer lost its lease
    assert await other.claim(keys) == "S"


async def test_values_saved_in_the_old_layout_stay_saved(client: Redis) -> None:
    """An upgrade needs no migration: the compact claim reads old "1" markers."""
    old, new = claims(client, layout="keys"), claims(client)
    keys = keys_of(*(f"old{i}" for i in range(50)))
    assert await old.claim(keys) == "W" * 50
    assert await old.commit(keys) == 50
    assert set(await client.mget(keys)) == {b"1"}
    assert await new.states(keys) == "S" * 50
    assert await new.claim(keys) == "S" * 50  # nothing is created twice
    # A rolling upgrade: an old gateway sees a new gateway's lease as busy...
    fresh = keys_of("mixed")
    assert await new.claim(fresh) == "W"
    assert await old.claim(fresh) == "B"
    # ...and a value the new one saved as new (the database's unique key has the last
    # word for the old gateway, which no longer sees it in Redis).
    assert await new.commit(fresh) == 1
    assert await old.claim(fresh) == "W"
    assert await old.commit(fresh) == 1  # writes an old marker...
    assert await new.claim(fresh) == "S"  # ...which reads as saved too
    # A commit moves an old marker into the bucket.
    assert await new.commit(keys[:1]) == 0
    assert await client.exists(keys[0]) == 0
    assert await new.claim(keys[:1]) == "S"


async def test_old_layout_unchanged(client: Redis) -> None:
    gw = claims(client, layout="keys", retention_ms=60_000)
    keys = keys_of("x", "y")
    assert await gw.claim(keys) == "WW"
    assert await gw.commit(keys[:1]) == 1
    assert await client.get(keys[0]) == b"1"
    assert 0 < await client.pttl(keys[0]) <= 60_000
    assert await gw.abort(keys[1:]) == 1
    assert await client.exists(keys[1]) == 0


def test_new_scripts_have_headers() -> None:
    for source in (CLAIM_COMPACT, COMMIT_COMPACT, CLAIM_BLOOM, COMMIT_BLOOM):
        assert "-- KEYS:" in source and "-- ARGV" in source and "-- Returns:" in source


def test_bad_layouts_are_refused() -> None:
    client = Redis()
    with pytest.raises(ValueError, match="layout"):
        claims(client, layout="sparse")
    with pytest.raises(ValueError, match="marker_generations"):
        claims(client, marker_generations=1)


# ------------------------------------------------------------------------ retention


async def test_retention_expires_whole_generations(client: Redis) -> None:
    gw = claims(client, retention_ms=400)
    keys = keys_of(*(f"r{i}" for i in range(20)))
    assert await gw.claim(keys) == "W" * 20
    committed = time.monotonic()
    assert await gw.commit(keys) == 20
    assert await gw.claim(keys) == "S" * 20
    reads, expire_at = gw.generations()
    assert len(reads) == 2 and int(reads[0]) == int(reads[1]) + 1
    layout = gw.markers
    buckets = {layout.locate(k, reads[:1])[0][0] for k in keys}
    # Every bucket of the generation expires whole, at one moment.
    for bucket in buckets:
        assert abs(await expire_time_ms(client, bucket) - expire_at) <= 2

    async def forgotten() -> bool:
        return await gw.claim(keys) == "W" * 20

    await until(forgotten)
    # Kept at least the retention (400 ms), and read for at most two generations.
    assert time.monotonic() - committed >= 0.4
    assert await gw.commit(keys) == 20
    assert await gw.claim(keys) == "S" * 20

    async def gone() -> bool:
        return not [k async for k in client.scan_iter(match=b"dedup:m*")]

    await until(gone)  # buckets expired by Redis itself: memory is returned


def test_generations_cover_the_retention() -> None:
    gw = claims(Redis(), retention_ms=3_600_000, marker_generations=3)
    reads, expire_at = gw.generations(now_ms=10 * 1_800_000 + 5)
    assert reads == [b"10", b"9", b"8"]
    # Readers stop reading generation 10 at (10 + 3) * period; a minute of allowance.
    assert expire_at == 13 * 1_800_000 + 60_000
    assert claims(Redis()).generations() == ([b""], 0)


# -------------------------------------------------------------------------- cluster


async def test_compact_layout_on_a_cluster(cluster: list[RedisServer]) -> None:  # noqa: F811
    rc = RedisCluster(host="127.0.0.1", port=cluster[0].port)
    try:
        space = KeySpace("dedup", cluster_shards=16)
        stats = Stats()
        one = Claims(rc, lease_ms=10_000, retention_ms=60_000, stats=stats, cluster_shards=16)
        two = Claims(rc, lease_ms=10_000, retention_ms=60_000, stats=Stats(), cluster_shards=16)
        keys = keys_of(*(f"c{i}" for i in range(600)), space=space)
        assert await one.claim(keys) == "W" * 600
        assert stats.redis_round_trips <= 3 * 16  # one call per hash tag (3: script loads)
        assert await two.claim(keys) == "B" * 600
        assert await one.commit(keys[:400]) == 400
        assert await two.claim(keys) == "S" * 400 + "B" * 200
        assert await two.states(keys) == "S" * 400 + "L" * 200
        assert await one.abort(keys[400:]) == 200
        assert await two.claim(keys) == "S" * 400 + "W" * 200
        # Untagged keys cannot share a slot with their buckets: refused, not CROSSSLOT.
        with pytest.raises(ConfigError, match="hash-tagged"):
            await one.claim(keys_of("plain", "keys", "here"))
        await probe_write(rc, "dedup")
    finally:
        await rc.aclose()


async def test_each_variant_a_cluster_runs(cluster: list[RedisServer]) -> None:  # noqa: F811
    """The cluster form of every variant the nodes' version allows: Redis 7 runs the
    Redis 6 scripts too (no cross-slot flag line: Redis 7 runs such a script in its
    compatible mode), and Redis 6 runs its own (no flag line, which it could not parse)."""
    rc = RedisCluster(host="127.0.0.1", port=cluster[0].port)
    try:
        info = await info_of_every_node(rc, "server")
        runnable = variants_of(info)
        assert len(info) == 3 and script_variant(info) is runnable[0]  # every node asked
        space = KeySpace("dedup", cluster_shards=16)
        for n, variant in enumerate(runnable):
            one = claims(rc, cluster_shards=16, variant=variant)
            two = claims(rc, cluster_shards=16, variant=variant)
            keys = keys_of(*(f"v{n}-{i}" for i in range(200)), space=space)
            assert await one.claim(keys) == "W" * 200
            assert await two.claim(keys) == "B" * 200
            assert await one.commit(keys[:100]) == 100
            assert await one.abort(keys[100:150]) == 50
            assert await two.claim(keys) == "S" * 100 + "W" * 50 + "B" * 50
    finally:
        await rc.aclose()


# ------------------------------------------------------------------ server versions


def variants_of(server_info: Any) -> list[ScriptVariant]:
    """The variants every node of an ``INFO server`` answer can run, newest first."""
    infos = server_info.values() if "redis_version" not in server_info else [server_info]
    oldest = min(tuple(int(x) for x in i["redis_version"].split(".")[:2]) for i in infos)
    return [variant for variant in VARIANTS if oldest >= variant.since]


def test_the_variant_follows_the_oldest_node() -> None:
    assert script_variant({"redis_version": "7.0.15"}) is REDIS_7
    assert script_variant({"redis_version": "8.0.2"}) is REDIS_7
    # Valkey reports a Redis-compatible version: 7.2 for Valkey 7.2, 8 and later.
    assert script_variant({"redis_version": "7.2.4", "valkey_version": "8.0.1"}) is REDIS_7
    assert script_variant({"redis_version": "6.2.14"}) is REDIS_6
    assert script_variant({"redis_version": "6.0.16"}) is REDIS_6
    upgrading = {"a:1": {"redis_version": "7.2.4"}, "b:2": {"redis_version": "6.2.14"}}
    assert script_variant(upgrading) is REDIS_6
    assert script_variant({"a:1": {"redis_version": "7.0.15"}, "b:2": {"redis_version": "7.4.0"}})
    # A version it cannot read gets the scripts every supported server runs.
    assert script_variant({"redis_version": "unstable"}) is REDIS_6
    assert script_variant({}) is REDIS_6


def test_a_server_older_than_the_floor_is_named() -> None:
    """redis-py (RESP3, its default from 8.0) first sends HELLO, which came in Redis 6.0: a
    Redis 5 answers "unknown command", which redis-py wraps in a ConnectionError. Checked
    by hand against a Redis 5.0.6 built from source (see docs/guarantees.md, "Failure modes")."""
    refused = ResponseError("unknown command `HELLO`, with args beginning with: `3`, ")
    try:
        try:
            raise refused
        except ResponseError as exc:
            raise ConnectionError(str(exc)) from exc
    except ConnectionError as wrapped:
        assert older_than_floor(wrapped)
    assert older_than_floor(refused)
    assert not older_than_floor(ConnectionError("Connection refused"))
    assert not older_than_floor(ResponseError("unknown command `GETDEL`"))


# What Redis 6.0 has of what the scripts call (SET's GET option came in 6.2, GETDEL in 6.2).
_REDIS_6_0 = {"GET", "SET", "DEL", "PEXPIRE", "PEXPIREAT", "PTTL", "EXISTS", "HEXISTS", "HSET"}
_REDIS_6_0 |= {"HDEL"}  # the forget's clearing of compact markers (Redis 2.0)
_REDIS_6_0 |= {"GETBIT", "SETBIT"}
_SOURCES = (CLAIM, COMMIT, ABORT, CLAIM_COMPACT, COMMIT_COMPACT, CLAIM_BLOOM, COMMIT_BLOOM,
            FORGET, FORGET_RELEASE)  # fmt: skip


def test_the_redis_6_scripts_call_only_what_redis_6_0_has() -> None:
    """The CI's second pass runs Redis 6.2, which has more than 6.0: this checks the
    rest. Every command the Redis 6 scripts call exists in 6.0, SET never with GET, and
    the cluster form has no ``#!lua`` line (a syntax error before 7.0)."""
    for source in _SOURCES:
        # Redis 7: each helper call became its command; Redis 6: the helpers are defined.
        assert not re.search(r"\b(lease_or_get|set_get|getdel)\(", render(source, REDIS_7))
        for helper in ("lease_or_get(", "set_get(", "getdel("):
            assert helper not in source or f"function {helper}" in render(source, REDIS_6)
        text = render(source, REDIS_6)
        calls = re.findall(r"redis\.call\('([A-Z]+)'([^)]*)\)", text)
        assert calls
        for name, args in calls:
            assert name in _REDIS_6_0, (name, source[:80])
            assert not (name == "SET" and "'GET'" in args)
        assert not cross_slot(text, REDIS_6).startswith("#!")
        assert cross_slot(render(source, REDIS_7), REDIS_7).startswith("#!lua")


@pytest.mark.parametrize("layout", ["keys", "compact", "approximate"])
async def test_each_variant_this_server_runs(client: Redis, layout: str) -> None:
    """Every layout, with the scripts of each variant the server's version allows (Redis 7
    runs both, which is also what a cluster mid-upgrade does); a newer variant than the
    server's is refused by the server, which is why the variant is chosen at open."""
    runnable = variants_of(await client.info("server"))
    options: dict[str, Any] = {"layout": "compact" if layout == "approximate" else layout}
    if layout == "approximate":
        options["approximate"] = BloomSpec(1000)
    for n, variant in enumerate(runnable):
        for retention_ms in (0, 60_000):  # the keys layout's marker: with PX, and without
            one = claims(client, variant=variant, retention_ms=retention_ms, **options)
            two = claims(client, variant=variant, retention_ms=retention_ms, **options)
            keys = keys_of(*(f"{n}-{retention_ms}-{i}" for i in range(5)))
            assert await one.claim(keys) == "WWWWW"
            assert await one.claim(keys) == "WWWWW"  # our own leases: extended
            assert await two.claim(keys) == "BBBBB"
            assert await one.commit(keys[:2]) == 2
            assert await two.commit(keys[2:3]) == 0  # not its lease: saved all the same
            assert await one.abort(keys[3:4]) == 1
            assert await two.claim(keys) == "SSSWB"
            assert await one.states(keys) == "SSSLL"
            assert await client.exists(*keys[:3]) == (3 if layout == "keys" else 0)
            if layout == "keys" and retention_ms:
                assert 0 < await client.pttl(keys[0]) <= retention_ms
    for variant in VARIANTS:
        if variant not in runnable:
            with pytest.raises(ResponseError):
                await claims(client, variant=variant, **options).claim(keys_of("new"))


async def test_the_variant_is_read_from_the_server_once(client: Redis) -> None:
    """A Claims given no variant asks the server (INFO server) before its first script,
    and never again; a Gateway passes the one its version check chose."""
    gw = claims(client)
    assert gw.variant is None
    assert await gw.claim(keys_of("a")) == "W"
    assert gw.variant is script_variant(await client.info("server"))
    trips = gw._stats.redis_round_trips
    assert await gw.commit(keys_of("a")) == 1
    assert gw._stats.redis_round_trips == trips + 1


async def test_a_gateway_chooses_the_variant_at_open(redis_url: str, tmp_path: Path) -> None:
    client = Redis.from_url(redis_url)
    try:
        expected = script_variant(await client.info("server"))
    finally:
        await client.aclose()
    sqlite = f"sqlite:///{tmp_path / 'd.sqlite3'}"
    async with Gateway(redis_url, sqlite, migrate=True) as gw:
        backends = gw._backends
        assert backends.variant is expected
        assert backends.claims is not None and backends.claims.variant is expected
        assert (await gw.save("email", "a")).created
        assert (await gw.save_many([("email", "a"), ("email", "b")]))[1].created


# ------------------------------------------------------- a Redis that cannot write


def test_unwritable_reason_reads_redis_py_errors() -> None:
    assert unwritable_reason(OutOfMemoryError("command not allowed")) == "oom"
    assert unwritable_reason(ReadOnlyError("You can't write against a read only replica.")) == (
        "readonly"
    )
    misconf = ResponseError("MISCONF Redis is configured to save RDB snapshots, but ...")
    assert unwritable_reason(misconf) == "misconf"
    # Wrapped, as an engine raising its own error from the Redis one would.
    try:
        try:
            raise misconf
        except ResponseError as exc:
            raise RuntimeError("Redis failed a claim") from exc
    except RuntimeError as outer:
        assert unwritable_reason(outer) == "misconf"
    assert unwritable_reason(ConnectionError("refused")) is None
    assert unwritable_reason(ResponseError("WRONGTYPE Operation against a key")) is None
    assert unwritable_reason(ValueError("no")) is None


async def test_a_full_redis(fresh_redis: RedisServer) -> None:
    rds = Redis.from_url(fresh_redis.url)
    try:
        gw = claims(rds)
        saved = keys_of("before")
        assert await gw.claim(saved) == "W" and await gw.commit(saved) == 1
        used = (await rds.info("memory"))["used_memory"]
        await rds.config_set("maxmemory", used + 400_000)
        with pytest.raises(OutOfMemoryError) as full:  # filled up as traffic would
            for i in range(10_000):
                await rds.set(f"filler:{i}", "x" * 1000)
        assert unwritable_reason(full.value) == "oom"
        # The refused SET's own 1 kB query buffer tipped the balance; freed, it leaves
        # the server just under its limit, where a tiny write passes. Use past the
        # limit, as when other keys keep growing: nothing but a read passes then.
        used = (await rds.info("memory"))["used_memory"]
        await rds.config_set("maxmemory", used - 100_000)
        with pytest.raises(RedisError) as probe:
            await probe_write(rds, "dedup")
        assert unwritable_reason(probe.value) == "oom"
        with pytest.raises(RedisError) as claim:
            await gw.claim(keys_of("new"))
        assert unwritable_reason(claim.value) == "oom"
        assert await gw.claim(saved) == "S"  # answering "saved" needs no write
        await rds.config_set("maxmemory", 0)  # memory freed (here: the limit lifted)
        await probe_write(rds, "dedup")
        assert await gw.claim(keys_of("new")) == "W"
        assert [k async for k in rds.scan_iter(match="dedup:probe:*")] == []
    finally:
        await rds.aclose()


async def test_a_read_only_replica(fresh_redis: RedisServer) -> None:
    with RedisServer() as primary:
        rds = Redis.from_url(fresh_redis.url)
        try:
            await probe_write(rds, "dedup")
            await rds.replicaof(primary.host, primary.port)
            with pytest.raises(RedisError) as probe:
                await probe_write(rds, "dedup")
            assert unwritable_reason(probe.value) == "readonly"
            with pytest.raises(RedisError) as claim:
                await claims(rds).claim(keys_of("new"))
            assert unwritable_reason(claim.value) == "readonly"
            assert await rds.ping()  # a PING would have said all is well
            await rds.replicaof("NO", "ONE")
            await probe_write(rds, "dedup")
        finally:
            await rds.aclose()


async def test_failing_snapshots(fresh_redis: RedisServer) -> None:
    """MISCONF, provoked for real: a BGSAVE whose rename onto dump.rdb fails (a
    directory holds the name), with a save point and stop-writes-on-bgsave-error."""
    rds = Redis.from_url(fresh_redis.url)
    blocker = fresh_redis.dir / "dump.rdb"
    try:
        await rds.config_set("stop-writes-on-bgsave-error", "yes")
        await rds.config_set("save", "3600 1")
        blocker.mkdir()
        await rds.bgsave()

        async def failed() -> bool:
            info = await rds.info("persistence")
            done = info["rdb_bgsave_in_progress"] == 0
            return bool(done and info["rdb_last_bgsave_status"] == "err")

        await until(failed)
        with pytest.raises(RedisError) as probe:
            await probe_write(rds, "dedup")
        assert unwritable_reason(probe.value) == "misconf"
        with pytest.raises(RedisError) as claim:
            await claims(rds).claim(keys_of("new"))
        assert unwritable_reason(claim.value) == "misconf"
        blocker.rmdir()
        await rds.bgsave()

        async def writable() -> bool:
            try:
                await probe_write(rds, "dedup")
            except ResponseError:
                return False
            return True

        await until(writable)
    finally:
        await rds.aclose()


async def test_redis_clients_pack_commands_the_fast_way(redis_url: str) -> None:
    client = connect_redis(redis_url, max_connections=4, timeout_s=5)
    assert isinstance(client, Redis)
    try:
        assert client.connection_pool.connection_class.__name__ == "FastPackConnection"
        assert await claims(client).claim(keys_of("fast")) == "W"
    finally:
        await client.aclose()


async def test_a_command_cancelled_while_it_sends_is_cancelled(redis_url: str) -> None:
    """A task cancelled at any loop step of a command ends cancelled (redis-py's write,
    through Python 3.11's wait_for, returned instead when the cancel came between the
    write's end and the task's wakeup), and the client's next answers are its own."""
    client = connect_redis(redis_url, max_connections=4, timeout_s=5)
    assert isinstance(client, Redis)
    try:
        await client.set("cancel-probe", "v")
        cancelled = 0
        for steps in range(8):
            for _ in range(5):
                task = asyncio.ensure_future(client.get("cancel-probe"))
                for _ in range(steps):
                    await asyncio.sleep(0)
                if task.done():  # answered before the cancel: nothing to check
                    continue
                task.cancel()
                await asyncio.wait([task], timeout=30)
                assert task.cancelled(), (steps, task)
                cancelled += 1
        assert cancelled >= 5  # the cancels did land while the commands ran
        for i in range(20):
            await client.set(f"cancel-probe-{i}", i)
            assert await client.get(f"cancel-probe-{i}") == str(i).encode()
    finally:
        await client.aclose()


# ------------------------------------------------------------------ run_together

_SLOW = Script("""
-- Busy for ARGV[1] ms of the server's clock, then returns ARGV[2].
-- Valkey answers TIME with the script's start time for its whole run, so the clock is
-- os.clock() (the server's CPU time, which a busy loop spends as it goes) where the
-- sandbox has it (Valkey); Redis 6 and 7 have no os, and their TIME moves.
local has_os, clock = pcall(function() return os.clock end)
local function now_us()
  if has_os and clock then return clock() * 1000000 end
  local t = redis.call('TIME')
  return t[1] * 1000000 + t[2]
end
local until_us = now_us() + tonumber(ARGV[1]) * 1000
repeat until now_us() >= until_us
return ARGV[2]
""")
_ECHO = Script("return {KEYS[1], ARGV[1]}")
_FAIL = Script("return redis.error_reply('ERR deliberately failed')")


async def test_run_together_replies_in_order_and_keeps_the_stream_in_step(redis_url: str) -> None:
    """Several scripts in one round trip: replies in order; an error reply raises and the
    connection stays usable; a flushed script cache is reloaded; plain commands ride ahead
    of the scripts; a call cancelled while
    its replies are on their way, and one whose connection the server killed, leave no
    reply behind for the next caller of the pool."""
    client = connect_redis(redis_url, max_connections=2, timeout_s=2)
    assert isinstance(client, Redis)  # one server: run_together's kind
    admin = Redis.from_url(redis_url)
    try:
        results, trips = await run_together(
            client, [(_ECHO, [b"k1"], [b"a"]), (_ECHO, [b"k2"], [7])]
        )
        assert results == [[b"k1", b"a"], [b"k2", b"7"]]
        with pytest.raises(ResponseError, match="deliberately"):
            await run_together(client, [(_FAIL, [], []), (_ECHO, [b"k3"], [b"b"])])
        results, _ = await run_together(client, [(_ECHO, [b"k4"], [b"c"])])
        assert results == [[b"k4", b"c"]]
        await admin.script_flush()
        results, trips = await run_together(client, [(_ECHO, [b"k5"], [b"d"])])
        assert results == [[b"k5", b"d"]] and trips == 3  # the call, the load, the call
        # Plain commands ahead of the scripts, in the same round trip: their replies come
        # first, and a reload after NOSCRIPT sends them again with the scripts.
        listener = admin.pubsub()
        await listener.subscribe("dedup-test:before")
        await admin.script_flush()
        results, trips = await run_together(
            client, [(_ECHO, [b"k8"], [b"g"])], [("PUBLISH", "dedup-test:before", b"hi")]
        )
        assert results == [1, [b"k8", b"g"]] and trips == 3
        got: list[bytes] = []
        deadline = asyncio.get_running_loop().time() + 10
        while len(got) < 2 and asyncio.get_running_loop().time() < deadline:
            # (None also for the subscription's own confirmation, which is skipped)
            message = await listener.get_message(ignore_subscribe_messages=True, timeout=1)
            if message is not None:
                got.append(message["data"])
        assert got == [b"hi", b"hi"]  # once per attempt
        results, trips = await run_together(client, [], [("PUBLISH", "dedup-test:none", b"x")])
        assert results == [0] and trips == 1
        await listener.aclose()  # type: ignore[no-untyped-call]
        # Cancelled while the server still works on the first of two scripts: the second
        # reply must not reach the next caller.
        task = asyncio.create_task(
            run_together(client, [(_SLOW, [], [300, b"late"]), (_ECHO, [b"k6"], [b"e"])])
        )
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for n in range(4):  # every connection of the pool, more than once
            results, _ = await run_together(client, [(_ECHO, [b"next"], [n])])
            assert results == [[b"next", str(n).encode()]]
        # The server kills every other connection: the next call is retried on a fresh one.
        await admin.client_kill_filter(_type="normal", skipme=True)
        results, _ = await run_together(client, [(_ECHO, [b"k7"], [b"f"])])
        assert results == [[b"k7", b"f"]]
    finally:
        await admin.aclose()
        await client.aclose()
