"""Redis Cluster: a claim batch is split by hash slot, and the script calls of one node
go in one pipeline (a round trip per node per batch); slots that move are followed."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import RedisError

from dedup import Gateway
from dedup._claims.bloom import BloomSpec
from dedup._claims.keys import KeySpace
from dedup._claims.protocol import Claims
from dedup._redis.connect import connect_redis, unlink_matching
from dedup._values import digest
from dedup.metrics import Stats
from tests.servers import RedisClusterServers, RedisServer


@pytest.fixture
def own_cluster() -> Iterator[RedisClusterServers]:
    """Three primaries, no replicas, for this test alone (it moves slots)."""
    with RedisClusterServers(3, 0, node_timeout_ms=2000) as servers:
        yield servers


@pytest.fixture
def cluster(cluster_servers: RedisClusterServers) -> list[RedisServer]:
    """The three primaries' servers of the session's cluster (the form
    tests/test_claims.py imports)."""
    return cluster_servers.nodes


def evalsha_calls(servers: RedisClusterServers) -> dict[int, int]:
    """EVALSHA commands each node ran (INFO commandstats), by port."""
    out = {}
    for node in servers.nodes:
        stats = servers.command(node, "INFO", "commandstats")
        out[node.port] = int(stats.get("cmdstat_evalsha", {}).get("calls", 0))
    return out


def claims_on(client: RedisCluster, **kwargs: Any) -> Claims:
    return Claims(client, lease_ms=10_000, retention_ms=60_000, stats=Stats(), **kwargs)


async def test_one_round_trip_per_node_per_batch(cluster_servers: RedisClusterServers) -> None:
    """A batch over 64 slots costs one script call per primary (3), not 64, and each key
    gets its own answer back in order."""
    rc = RedisCluster(host="127.0.0.1", port=cluster_servers.nodes[0].port)
    try:
        space = KeySpace("dedup", cluster_shards=64)
        keys = [space.key("email", digest(f"p{i}")) for i in range(3000)]
        slots = {key_slot(k) for k in keys}
        assert len(slots) == 64
        one, two = claims_on(rc, cluster_shards=64), claims_on(rc, cluster_shards=64)
        assert await one.claim(keys) == "W" * len(keys)
        # The first batch reads the servers' versions (INFO server: the script variant)
        # and loads the script on each node (NOSCRIPT: +2 round trips each).
        assert one._stats.redis_round_trips <= 1 + 3 * 3
        rng = random.Random(3)
        fate = [rng.choice("CAH") for _ in keys]  # committed, aborted, still held
        committed = [k for k, f in zip(keys, fate, strict=True) if f == "C"]
        aborted = [k for k, f in zip(keys, fate, strict=True) if f == "A"]
        assert await one.commit(committed) == len(committed)
        assert await one.abort(aborted) == len(aborted)
        await two.claim(keys[:1])  # loads the claim script's compact form everywhere
        before, trips = evalsha_calls(cluster_servers), two._stats.redis_round_trips
        answer = await two.claim(keys)
        expected = "".join({"C": "S", "A": "W", "H": "B"}[f] for f in fate)
        assert answer == expected
        assert two._stats.redis_round_trips - trips == 3  # one per primary
        after = evalsha_calls(cluster_servers)
        per_node = {port: after[port] - before[port] for port in after}
        assert per_node == dict.fromkeys(per_node, 1)  # ONE call per node, all its slots
        owners = Counter(
            cluster_servers.node_of_key(k).port for k in {key_slot(k): k for k in keys}.values()
        )
        assert set(owners) == set(per_node) and min(owners.values()) > 1
        assert await two.states(keys) == answer.replace("W", "L").replace("B", "L")
    finally:
        await rc.aclose()


async def test_untagged_keys_layout_one_trip_per_node(cluster_servers: RedisClusterServers) -> None:
    """layout="keys" without hash tags: 1,000 keys in ~1,000 slots, still 3 round trips."""
    rc = RedisCluster(host="127.0.0.1", port=cluster_servers.nodes[1].port)
    try:
        space = KeySpace("dedup")
        keys = [space.key("email", digest(f"u{i}")) for i in range(1000)]
        one = claims_on(rc, layout="keys")
        warm = [space.key("email", digest(f"w{i}")) for i in range(100)]  # every node
        assert await one.commit(warm) == 0
        assert await one.claim(warm) == "S" * 100  # both scripts now loaded everywhere
        trips = one._stats.redis_round_trips
        assert await one.claim(keys) == "W" * 1000
        assert await one.commit(keys[:500]) == 500
        assert one._stats.redis_round_trips - trips == 6
        assert await claims_on(rc, layout="keys").claim(keys) == "S" * 500 + "B" * 500
    finally:
        await rc.aclose()


def migrate(servers: RedisClusterServers, slot: int, source: RedisServer, *, finish: bool) -> None:
    """Move ``slot``'s keys from ``source`` to another primary (what redis-cli --cluster
    reshard does), and hand the slot over if ``finish``."""
    target = next(n for n in servers.nodes if n is not source)
    src_id, dst_id = servers.ids[source.port], servers.ids[target.port]
    servers.command(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    servers.command(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    while names := servers.command(source, "CLUSTER", "GETKEYSINSLOT", slot, 1000, decode=False):
        servers.command(source, "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *names)
    if finish:
        for node in servers.nodes:
            servers.command(node, "CLUSTER", "SETSLOT", slot, "NODE", dst_id)


async def test_slots_moved_under_a_stale_map(own_cluster: RedisClusterServers) -> None:
    """Resharding after the client read the slot map. A slot handed over: the node's one
    call fails (a key it no longer serves), its slots go one by one, MOVED patches the
    map, the batch is retried, the answers stay right. A slot still migrating: a
    multi-key script there answers TRYAGAIN (Redis refuses it while the slot's keys are
    split), retried once, then raised as a RedisError (the engine goes degraded); once
    the slot is handed over the same batch succeeds."""
    servers = own_cluster
    rc = RedisCluster(host="127.0.0.1", port=servers.nodes[0].port)
    try:
        space = KeySpace("dedup", cluster_shards=8)
        keys = [space.key("email", digest(f"m{i}")) for i in range(400)]
        one, two = claims_on(rc, cluster_shards=8), claims_on(rc, cluster_shards=8)
        assert await one.claim(keys) == "W" * 400
        assert await one.commit(keys[:200]) == 200
        assert await two.claim(keys[:1]) == "S"  # the map read, the script loaded
        slots = sorted({key_slot(k) for k in keys})
        moved, moving = slots[0], slots[-1]
        owner = {s: servers.node_of_key(next(k for k in keys if key_slot(k) == s)) for s in slots}
        migrate(servers, moved, owner[moved], finish=True)
        trips = two._stats.redis_round_trips
        assert await two.claim(keys) == "S" * 200 + "B" * 200
        # One call per node; the stale node's slots again one by one (one pipeline per
        # node, + a load of the per-slot form), the MOVED slot once more on its new owner.
        assert two._stats.redis_round_trips - trips <= 3 + 2 * 3 + 3
        migrate(servers, moving, owner[moving], finish=False)
        with pytest.raises(RedisError, match=r"TRYAGAIN|rehashing"):
            await two.claim(keys)
        target = next(n for n in servers.nodes if n is not owner[moving])
        for node in servers.nodes:
            servers.command(node, "CLUSTER", "SETSLOT", moving, "NODE", servers.ids[target.port])
        assert await one.commit(keys[200:]) == 200
        assert await two.claim(keys) == "S" * 400
    finally:
        await rc.aclose()


async def test_gateway_on_a_cluster(cluster: list[RedisServer], tmp_path: Path) -> None:
    url = f"redis+cluster://127.0.0.1:{cluster[0].port}"
    db = f"sqlite:///{tmp_path}/c.db"
    values = [f"c{i}" for i in range(600)]
    async with (
        Gateway(url, db, migrate=True, cluster_shards=16) as one,
        Gateway(url, db, cluster_shards=16, local_cache_size=0) as two,
    ):
        rs = await one.save_many([("email", v) for v in values])
        assert all(r.created for r in rs)
        stats = one.stats()
        # One batch of 600 keys in 16 hash tags: one pipeline per node (3 trips where a
        # node loads the script), claim and commit.
        assert stats.claim_batches >= 1
        assert stats.redis_round_trips <= 1 + 3 * 3 * 2 * stats.claim_batches
        again = await two.save_many([("email", v) for v in values])
        assert {r.source for r in again} == {"redis"}
        await one.purge(["email"])
        assert await one.count_rows(["email"]) == 0
        third = await two.save("email", "c1")
        assert (third.created, third.source) == (True, "write")


async def test_cluster_defaults_to_64_hash_tags(cluster: list[RedisServer], tmp_path: Path) -> None:
    url = f"redis+cluster://127.0.0.1:{cluster[1].port}"
    async with Gateway(url, f"sqlite:///{tmp_path}/d.db", migrate=True, max_batch=1000) as gw:
        rs = await gw.save_many([("email", f"n{i}") for i in range(1000)])
        assert sum(r.created for r in rs) == 1000
        # 1,000 keys in 64 hash tags: a claim or a commit is one pipeline per node.
        stats = gw.stats()
        assert stats.redis_round_trips <= 1 + 3 * 3 * 2 * stats.claim_batches


async def test_unlink_matching_reaches_every_primary_from_a_new_client(
    cluster_servers: RedisClusterServers,
) -> None:
    # The bench's reset and the demo use a fresh client: it must not see zero nodes.
    writer = RedisCluster.from_url(cluster_servers.url.replace("+cluster", ""))
    try:
        for i in range(300):
            await writer.set(f"wipe:{{{i % 30}}}k{i}", "1")
        await writer.set("keep:{1}k", "1")
    finally:
        await writer.aclose()
    fresh = RedisCluster.from_url(cluster_servers.url.replace("+cluster", ""))
    try:
        assert await unlink_matching(fresh, "wipe:*") == 300
        sizes = [await fresh.dbsize(target_nodes=node) for node in fresh.get_primaries()]
        assert sum(sizes) == 1  # only the key outside the pattern
    finally:
        await fresh.aclose()


async def test_approximate_mode_one_call_per_node(cluster_servers: RedisClusterServers) -> None:
    """The Bloom scripts' cluster form: claim, commit and re-claim over 16 tags."""
    rc = RedisCluster(host="127.0.0.1", port=cluster_servers.nodes[2].port)
    try:
        space = KeySpace("dedup", cluster_shards=16)
        keys = [space.key("email", digest(f"b{i}")) for i in range(500)]
        one = claims_on(rc, cluster_shards=16, approximate=BloomSpec(10_000))
        two = claims_on(rc, cluster_shards=16, approximate=BloomSpec(10_000))
        assert await one.claim(keys) == "W" * 500
        assert await two.claim(keys) == "B" * 500
        assert await one.commit(keys[:300]) == 300
        assert await two.claim(keys) == "S" * 300 + "B" * 200
        assert await one.abort(keys[:300]) == 0  # saved, not held; loads the script
        before = evalsha_calls(cluster_servers)
        assert await one.abort(keys[300:]) == 200
        after = evalsha_calls(cluster_servers)
        assert {port: after[port] - before[port] for port in after} == dict.fromkeys(after, 1)
    finally:
        await rc.aclose()


async def test_cluster_clients_pack_commands_the_fast_way(
    cluster_servers: RedisClusterServers,
) -> None:
    client = connect_redis(cluster_servers.url, max_connections=8, timeout_s=5)
    assert isinstance(client, RedisCluster)
    try:
        await client.set("{a}k", "v")
        assert await client.get("{a}k") == b"v"
        classes = {type(node.acquire_connection()).__name__ for node in client.get_nodes()}
        assert classes == {"FastPackConnection"}
    finally:
        await client.aclose()
