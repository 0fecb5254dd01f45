"""Redis bytes per saved value: each marker layout through the real scripts, and the
gateway's own figures (``dedup bench`` and ``bench/memory_bench.py``).

:func:`measure_layout` starts a throwaway redis-server (:class:`dedup.testing.servers.RedisServer`)
for one layout, then claims and commits ``values`` distinct values in batches through
:class:`dedup._claims.protocol.Claims` (the claim and commit scripts the gateway runs). Its row:
``used_memory`` (INFO memory) after minus before, per saved value; the keys Redis
holds; claims+commits per second; duplicate claims per second (a sample of saved values
claimed again: all answer "saved"); the Redis CPU time in the scripts (INFO
commandstats) per saved value and per duplicate claim; and for the approximate mode
the false-positive rate measured on new values (claimed, then aborted).

Layouts (:data:`LAYOUTS`):

* ``compact``: the default, with ``hash-max-listpack-entries 512`` as in
  config/redis.conf;
* ``compact-128``: the default layout on a Redis left at its own default of 128, where
  buckets that outgrow it turn into hash tables;
* ``compact-retention``: the default layout with a one-day retention (buckets carry
  a generation in their name and an expiry);
* ``keys``: one key per value holding "1" (the layout before compact markers);
* ``approximate``: the Bloom filter sized for the values at ``fp_rate``.

:func:`gateway_memory` measures through the Gateway on the bench's own Redis: one
server, or a Redis Cluster with ``used_memory`` summed over its primaries.

Figures depend on the Redis version and allocator (jemalloc here): never asserted on.
"""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from dedup import Gateway
from dedup._claims.bloom import BloomSpec
from dedup._claims.keys import DEFAULT_MARKER_BUCKETS, KeySpace
from dedup._claims.protocol import Claims
from dedup._engine.local import SavedCache
from dedup._values import digest
from dedup.bench.procs import admin_client, reset
from dedup.bench.strategies import KIND
from dedup.metrics import Stats
from dedup.testing.servers import RedisServer, ServerError

__all__ = [
    "BENCH_LAYOUTS",
    "DUP_SAMPLE",
    "FP_PROBES",
    "LAYOUTS",
    "fill",
    "gateway_memory",
    "keys_for",
    "measure_layout",
    "measure_layouts",
    "scaled_buckets",
]

LAYOUTS: dict[str, tuple[dict[str, Any], list[str]]] = {
    # name: (Claims options, redis-server arguments)
    "compact": ({"layout": "compact"}, ["--hash-max-listpack-entries", "512"]),
    "compact-128": ({"layout": "compact"}, ["--hash-max-listpack-entries", "128"]),
    "compact-retention": (
        {"layout": "compact", "retention_ms": 86_400_000},
        ["--hash-max-listpack-entries", "512"],
    ),
    "keys": ({"layout": "keys"}, []),
    "approximate": ({"layout": "compact"}, []),  # plus approximate=BloomSpec(values, fp)
}
BENCH_LAYOUTS = ("compact", "keys", "approximate")
"""The layouts ``dedup bench`` measures: the default, the old one, the opt-in one."""
IN_FLIGHT = 4  # batches at once: enough to keep one redis-server busy
FP_PROBES = 100_000
"""New values claimed (then aborted) to measure the false-positive rate, at most."""
DUP_SAMPLE = 200_000
"""Saved values claimed again to time duplicate claims, at most."""
_REFERENCE_VALUES = 1_000_000


def scaled_buckets(values: int) -> int:
    """``marker_buckets`` for a run of ``values``: the default from 1M values up, fewer
    below, so that buckets are as full as the default's at 1M (~15 fields). With the
    default's 65,536 buckets a small run would measure mostly bucket keys of one field,
    which says nothing about the per-value cost of a real deployment."""
    return max(1, min(DEFAULT_MARKER_BUCKETS, values * DEFAULT_MARKER_BUCKETS // _REFERENCE_VALUES))


def keys_for(space: KeySpace, start: int, stop: int, tag: str = "v") -> list[bytes]:
    """The keys of values ``<tag><start>`` to ``<tag><stop - 1>`` (kind ``event``)."""
    return [space.key("event", digest(f"{tag}{i}")) for i in range(start, stop)]


async def fill(claims: Claims, space: KeySpace, values: int, batch: int) -> int:
    """Claim and commit ``values`` values; returns how many were committed."""
    committed = 0
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(start: int) -> None:
        nonlocal committed
        async with gate:
            keys = keys_for(space, start, min(start + batch, values))
            letters = await claims.claim(keys)
            won = [k for k, letter in zip(keys, letters, strict=True) if letter == "W"]
            held = await claims.commit(won)
            committed += held  # not "+= await": other batches add meanwhile

    step = batch * IN_FLIGHT * 8
    for chunk in range(0, values, step):
        await asyncio.gather(*(one(s) for s in range(chunk, min(chunk + step, values), batch)))
    return committed


async def _script_usec(client: Redis) -> float:
    """Microseconds Redis has spent in EVALSHA so far (INFO commandstats)."""
    stats = await client.info("commandstats")
    return float(stats.get("cmdstat_evalsha", {}).get("usec", 0))


async def measure_layout(
    name: str,
    values: int,
    *,
    batch: int = 512,
    buckets: int = DEFAULT_MARKER_BUCKETS,
    fp_rate: float = 0.01,
    fp_probes: int | None = None,
) -> dict[str, Any]:
    """The row of layout ``name`` (a key of :data:`LAYOUTS`) at ``values`` saved values,
    on a redis-server of its own. ``fp_probes`` defaults to ``values``, between 10,000
    and :data:`FP_PROBES`. Raises :class:`dedup.testing.servers.ServerError` if no
    redis-server can be started."""
    kwargs, server_args = LAYOUTS[name]
    with RedisServer(extra_args=server_args) as server:
        client = Redis.from_url(server.url)
        try:
            space = KeySpace("dedup")
            options: dict[str, Any] = dict(kwargs, marker_buckets=buckets)
            if name == "approximate":
                options["approximate"] = BloomSpec(values, fp_rate)
            options.setdefault("retention_ms", 0)
            claims = Claims(client, lease_ms=60_000, stats=Stats(), **options)
            await claims.claim(keys_for(space, 0, 1, "warm"))  # loads the script
            await claims.abort(keys_for(space, 0, 1, "warm"))
            before = (await client.info("memory"))["used_memory"]
            usec_before = await _script_usec(client)
            started = time.perf_counter()
            committed = await fill(claims, space, values, batch)
            took = time.perf_counter() - started
            after = (await client.info("memory"))["used_memory"]
            usec_fill = await _script_usec(client)
            sample = keys_for(space, 0, min(values, DUP_SAMPLE))
            started = time.perf_counter()
            answers = "".join(
                [await claims.claim(sample[i : i + batch]) for i in range(0, len(sample), batch)]
            )
            dup_rate = len(sample) / (time.perf_counter() - started)
            usec_dup = await _script_usec(client)
            row: dict[str, Any] = {
                "layout": name,
                "values": values,
                "marker_buckets": buckets if claims.layout == "compact" else None,
                "committed": committed,
                "bytes_per_value": (after - before) / values,
                "keys": await client.dbsize(),
                "saves_per_s": values / took,
                "dup_claims_per_s": dup_rate,
                "dup_answers_saved": answers.count("S") / len(sample),
                "redis_us_per_save": (usec_fill - usec_before) / values,
                "redis_us_per_dup": (usec_dup - usec_fill) / len(sample),
                "redis_version": (await client.info("server"))["redis_version"],
            }
            if name == "approximate":
                row.update(await _false_positives(client, claims, space, values, fp_probes))
                row["fp_configured"] = fp_rate
            return row
        finally:
            await client.aclose()


async def _false_positives(
    client: Redis, claims: Claims, space: KeySpace, values: int, probes: int | None
) -> dict[str, Any]:
    """New values claimed (then aborted): the share answered "saved", and the filter's size."""
    n = probes if probes is not None else min(FP_PROBES, max(10_000, values))
    keys = keys_for(space, 0, n, "new")
    seen = 0
    for i in range(0, n, 512):
        part = keys[i : i + 512]
        letters = await claims.claim(part)
        seen += letters.count("S")
        await claims.abort([k for k, c in zip(part, letters, strict=True) if c == "W"])
    assert claims.bloom is not None
    parts = [k async for k in client.scan_iter(match=b"dedup:b*")]
    usage = sum([await client.memory_usage(p) or 0 for p in parts])
    return {
        "fp_measured": seen / n,
        "fp_probes": n,
        "bloom_m_k": [claims.bloom.m, claims.bloom.k],
        "bloom_bytes_per_value": usage / values,
    }


async def measure_layouts(
    values: int,
    log: Callable[[str], None],
    names: Sequence[str] = BENCH_LAYOUTS,
    *,
    fp_rate: float = 0.01,
) -> dict[str, dict[str, Any]]:
    """The rows of ``names`` at ``values``, with :func:`scaled_buckets`; ``{}`` (and a
    line to ``log``) when no redis-server can be started here."""
    buckets = scaled_buckets(values)
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        log(f"memory   {name:<11} {values:,} values, each layout on a redis-server of its own ...")
        try:
            rows[name] = await measure_layout(name, values, buckets=buckets, fp_rate=fp_rate)
        except ServerError as exc:
            log(f"memory   layouts skipped: no redis-server to start ({exc})")
            return {}
    return rows


async def _used_memory(client: Redis | RedisCluster) -> int:
    """``used_memory`` of one Redis, or the sum over every primary of a cluster."""
    if isinstance(client, RedisCluster):
        await client.initialize()
        total = 0
        for node in client.get_primaries():
            total += int((await client.info("memory", target_nodes=node))["used_memory"])
        return total
    return int((await client.info("memory"))["used_memory"])


async def gateway_memory(
    redis_url: str, pg_url: str, n: int, *, local: bool = True
) -> dict[str, float]:
    """Redis bytes per value saved through the Gateway (on the bench's Redis, its
    settings; on a Redis Cluster, ``used_memory`` summed over the primaries) and, unless
    not ``local``, the local tier's bytes per entry."""
    await reset(redis_url, pg_url)
    r = admin_client(redis_url)
    try:
        before = await _used_memory(r)
        async with Gateway(redis_url, pg_url, namespace="mem", local_cache_size=0) as gw:
            step = 5000
            for start in range(0, n, step):
                await gw.save_many([(KIND, f"m{i}") for i in range(start, min(n, start + step))])
        after = await _used_memory(r)
    finally:
        await r.aclose()
    saved = {"redis_bytes_per_saved_value": (after - before) / n, "memory_values": n}
    if not local:
        return saved
    # The local tier: everything it allocates (its dict and its keys) per entry, once
    # filled, and again once as many new values went through it (each one evicting): the
    # dict has then been rebuilt under churn, which is the size a long-running gateway keeps.
    size = min(n, 200_000)
    digests = [digest(f"m{i}") for i in range(2 * size)]
    tracemalloc.start()
    cache = SavedCache(size)
    for d in digests[:size]:
        cache.add(KIND, d)
    filled, _ = tracemalloc.get_traced_memory()
    for d in digests[size:]:
        cache.add(KIND, d)
    churned, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(cache) <= size
    return {
        "redis_bytes_per_saved_value": saved["redis_bytes_per_saved_value"],
        "local_cache_bytes_per_entry": filled / size,
        "local_cache_bytes_per_entry_churned": churned / size,
        "memory_values": n,
    }
