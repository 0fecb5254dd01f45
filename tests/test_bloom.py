"""The opt-in approximate mode: sizing, partitions, and its answers on a real redis-server."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot

from dedup._claims.bloom import BloomLayout, BloomSpec, bloom_size
from dedup._claims.keys import KeySpace
from dedup._claims.protocol import Claims
from dedup._values import digest
from dedup.metrics import Stats

SPACE = KeySpace("dedup")


def keys_of(prefix: str, n: int, kind: str = "event") -> list[bytes]:
    return [SPACE.key(kind, digest(f"{prefix}{i}")) for i in range(n)]


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Redis]:
    rds = Redis.from_url(redis_url)
    yield rds
    await rds.aclose()


def test_sizing_math() -> None:
    m, k = bloom_size(1_000_000, 0.01)
    assert (m, k) == (9_585_059, 7)  # 9.6 bits, 1.2 bytes per value
    m, k = bloom_size(1000, 0.001)
    assert k == 10 and math.isclose(m / 1000, 14.38, rel_tol=0.01)
    # The textbook rate of that size: (1 - e^(-kn/m))^k, close to the one asked for.
    m, k = bloom_size(50_000, 0.02)
    assert math.isclose((1 - math.exp(-k * 50_000 / m)) ** k, 0.02, rel_tol=0.1)
    for expected, rate in ((0, 0.01), (10, 0.0), (10, 1.0), (10, -1.0)):
        with pytest.raises(ValueError):
            bloom_size(expected, rate)
    with pytest.raises(ValueError):
        BloomSpec(expected=0)


def test_partitions_split_a_large_filter_and_follow_hash_tags() -> None:
    spec = BloomSpec(expected=1_000_000, fp_rate=0.01)
    single = BloomLayout(spec)
    assert (single.parts_per_tag, single.partition_bits) == (1, 9_585_064)  # whole bytes
    split = BloomLayout(spec, max_partition_bits=1 << 20)
    assert split.parts_per_tag == 10 and split.partition_bits * 10 >= split.m
    tagged = BloomLayout(spec, cluster_shards=16)
    assert tagged.parts_per_tag * 16 * tagged.partition_bits >= tagged.m
    space = KeySpace("ns", cluster_shards=16)
    parts = set()
    for i in range(3000):
        key = space.key("k", digest(str(i)))
        names, bits = split.locate(key, [b"3", b"2"])
        assert len(bits) == split.k and all(0 <= b < split.partition_bits for b in bits)
        assert names[0].startswith(key[: key.index(b"}") + 1] + b"b3:")
        assert all(key_slot(name) == key_slot(key) for name in names)
        parts.add(names[0])
    assert len(parts) == 16 * 10  # every tag, every partition used


async def test_a_saved_value_answers_saved_and_a_failed_one_does_not(client: Redis) -> None:
    gw = Claims(client, lease_ms=10_000, retention_ms=0, stats=Stats(), approximate=BloomSpec(1000))
    other = Claims(
        client, lease_ms=10_000, retention_ms=0, stats=Stats(), approximate=BloomSpec(1000)
    )
    assert gw.layout == "approximate"
    keys = keys_of("v", 4)
    assert await gw.claim(keys) == "WWWW"
    assert await other.claim(keys) == "BBBB"  # leases are exact, as in the other layouts
    assert await gw.commit(keys[:2]) == 2
    assert await gw.abort(keys[2:3]) == 1  # a failed write leaves no bit behind
    assert await other.claim(keys) == "SSWB"
    assert await other.states(keys) == "SSLL"
    assert await client.exists(*keys[:2]) == 0  # "probably saved" holds no key per value
    # An old-layout marker still counts.
    await client.set(keys[3], "1")
    assert await other.claim(keys[3:]) == "S"


async def test_false_positive_rate_is_near_the_configured_one(client: Redis) -> None:
    n, rate = 3000, 0.02
    gw = Claims(
        client, lease_ms=10_000, retention_ms=0, stats=Stats(), approximate=BloomSpec(n, rate)
    )
    saved = keys_of("s", n)
    won = []
    for i in range(0, n, 500):
        batch = saved[i : i + 500]
        letters = await gw.claim(batch)
        assert letters.count("S") < 25  # a filling filter: a few false positives already
        won += [key for key, letter in zip(batch, letters, strict=True) if letter == "W"]
    assert await gw.commit(won) == len(won)
    assert await gw.claim(won) == "S" * len(won)  # no false negatives
    probes = keys_of("new", 10_000)
    answers = "".join([await gw.claim(probes[i : i + 1000]) for i in range(0, 10_000, 1000)])
    measured = answers.count("S") / len(probes)
    # Binomial(10,000, 2 %): 200 +- 14; the bound is generous, not a coin flip.
    assert 0.01 < measured < 0.03, measured
    m, _ = bloom_size(n, rate)
    assert await client.strlen("dedup:b:0") <= m // 8 + 1  # about 1 byte per value here


async def test_bloom_generations_expire(client: Redis) -> None:
    gw = Claims(
        client, lease_ms=10_000, retention_ms=300, stats=Stats(), approximate=BloomSpec(100)
    )
    keys = keys_of("g", 5)
    assert await gw.claim(keys) == "WWWWW"
    assert await gw.commit(keys) == 5
    assert await gw.claim(keys) == "SSSSS"
    for _ in range(300):  # within 15 s
        if await gw.claim(keys) == "WWWWW":
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the generation did not expire")
