"""Redis Cluster: a claim batch is split by hash slot, one script call per slot."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dedup import Gateway
from tests.servers import RedisServer, find_redis_server


@pytest.fixture
def cluster() -> Iterator[list[RedisServer]]:
    """Three masters, no replicas, slots spread by redis-cli --cluster create."""
    nodes = [
        RedisServer(extra_args=["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
        for _ in range(3)
    ]
    try:
        for node in nodes:
            node.start()
        cli = str(Path(find_redis_server()).with_name("redis-cli"))
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        for node in nodes:  # wait (bounded) until every node sees all slots assigned
            for _ in range(300):
                out = subprocess.run(
                    [cli, "-p", str(node.port), "cluster", "info"],
                    capture_output=True, text=True, timeout=10,
                ).stdout  # fmt: skip
                if "cluster_state:ok" in out:
                    break
                subprocess.run(["sleep", "0.1"], check=True)
            else:
                raise AssertionError(f"cluster did not become ok: {out}")
        yield nodes
    finally:
        for node in nodes:
            node.stop()


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
        # One batch of 600 keys in 16 hash tags: at most 16 calls per claim, not 600.
        assert stats.claim_batches >= 1
        assert stats.redis_round_trips <= 1 + 3 * 16 * 2  # 3 when a node loads the script
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
        # 1,000 keys would span ~1,000 slots untagged; tagged, each call covers <= 64 slots.
        stats = gw.stats()
        assert stats.redis_round_trips <= 1 + 3 * 64 * 2 * stats.claim_batches
