"""Redis bytes per saved value for each marker layout, through the real scripts.

    .venv/bin/python bench/memory_bench.py [--values 1000000] [--batch 512]
        [--layouts compact,compact-128,compact-retention,keys,bloom]
        [--buckets 65536] [--fp-rate 0.01]

For each layout a throwaway redis-server (dedup.servers.RedisServer) is started, and
``--values`` distinct values are claimed and committed in batches of ``--batch`` by
:class:`dedup.claims.Claims` (the claim and commit scripts the gateway runs). Printed
per layout: ``used_memory`` (INFO memory) after minus before, per saved value; the
keys Redis holds; claims+commits per second; duplicate claims per second (a sample of
saved values claimed again: all answer "saved"); and the Redis CPU time in the scripts
(INFO commandstats) per saved value (claim + commit) and per duplicate claim.

Layouts:

* ``compact``: the default, with ``hash-max-listpack-entries 512`` as in
  config/redis.conf;
* ``compact-128``: the default layout on a Redis left at its own default of 128, where
  buckets that outgrow it turn into hash tables;
* ``compact-retention``: the default layout with a one-day retention (buckets carry
  a generation in their name and an expiry);
* ``keys``: one key per value holding "1" (the layout before issue 12);
* ``bloom``: the approximate mode sized for ``--values`` at ``--fp-rate``; its
  false-positive rate is then measured on 100,000 new values (claimed, then aborted).

Not a test: figures depend on the Redis version and allocator (jemalloc here).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from redis.asyncio import Redis

from dedup.bloom import BloomSpec
from dedup.claims import Claims
from dedup.keys import KeySpace, digest
from dedup.loop import run as run_loop
from dedup.metrics import Stats
from dedup.servers import RedisServer

LAYOUTS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "compact": ({"layout": "compact"}, ["--hash-max-listpack-entries", "512"]),
    "compact-128": ({"layout": "compact"}, ["--hash-max-listpack-entries", "128"]),
    "compact-retention": (
        {"layout": "compact", "retention_ms": 86_400_000},
        ["--hash-max-listpack-entries", "512"],
    ),
    "keys": ({"layout": "keys"}, []),
    "bloom": ({"layout": "compact"}, []),
}
IN_FLIGHT = 4  # batches at once: enough to keep one redis-server busy
FP_PROBES = 100_000
DUP_SAMPLE = 200_000


def keys_for(space: KeySpace, start: int, stop: int, tag: str = "v") -> list[bytes]:
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


async def script_usec(client: Redis) -> float:
    """Microseconds Redis has spent in EVALSHA so far (INFO commandstats)."""
    stats = await client.info("commandstats")
    return float(stats.get("cmdstat_evalsha", {}).get("usec", 0))


async def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    kwargs, server_args = LAYOUTS[name]
    with RedisServer(extra_args=server_args) as server:
        client = Redis.from_url(server.url)
        try:
            space = KeySpace("dedup")
            options: dict[str, Any] = dict(kwargs, marker_buckets=args.buckets)
            if name == "bloom":
                options["approximate"] = BloomSpec(args.values, args.fp_rate)
            options.setdefault("retention_ms", 0)
            claims = Claims(client, lease_ms=60_000, stats=Stats(), **options)
            await claims.claim(keys_for(space, 0, 1, "warm"))  # loads the script
            await claims.abort(keys_for(space, 0, 1, "warm"))
            before = (await client.info("memory"))["used_memory"]
            usec_before = await script_usec(client)
            started = time.perf_counter()
            committed = await fill(claims, space, args.values, args.batch)
            took = time.perf_counter() - started
            info = await client.info("memory")
            after = info["used_memory"]
            usec_fill = await script_usec(client)
            sample = keys_for(space, 0, min(args.values, DUP_SAMPLE))
            started = time.perf_counter()
            answers = "".join(
                [
                    await claims.claim(sample[i : i + args.batch])
                    for i in range(0, len(sample), args.batch)
                ]
            )
            dup_rate = len(sample) / (time.perf_counter() - started)
            usec_dup = await script_usec(client)
            row: dict[str, Any] = {
                "layout": name,
                "values": args.values,
                "committed": committed,
                "bytes_per_value": (after - before) / args.values,
                "keys": await client.dbsize(),
                "saves_per_s": args.values / took,
                "dup_claims_per_s": dup_rate,
                "dup_answers_saved": answers.count("S") / len(sample),
                "redis_us_per_save": (usec_fill - usec_before) / args.values,
                "redis_us_per_dup": (usec_dup - usec_fill) / len(sample),
            }
            if name == "bloom":
                probes = keys_for(space, 0, FP_PROBES, "new")
                seen = 0
                for i in range(0, FP_PROBES, args.batch):
                    part = probes[i : i + args.batch]
                    letters = await claims.claim(part)
                    seen += letters.count("S")
                    await claims.abort([k for k, c in zip(part, letters, strict=True) if c == "W"])
                row["fp_measured"] = seen / FP_PROBES
                row["fp_configured"] = args.fp_rate
                assert claims.bloom is not None
                row["bloom_m_k"] = (claims.bloom.m, claims.bloom.k)
                parts = [k async for k in client.scan_iter(match=b"dedup:b*")]
                usage = sum([await client.memory_usage(p) or 0 for p in parts])
                row["bloom_bytes_per_value"] = usage / args.values
            return row
        finally:
            await client.aclose()


async def main(args: argparse.Namespace) -> None:
    print(
        f"{'layout':<12} {'values':>10} {'bytes/value':>11} {'keys':>9} {'saves/s':>9} "
        f"{'dup claims/s':>12} {'Redis us/save':>13} {'Redis us/dup':>12}  notes",
        flush=True,
    )
    for name in args.layouts.split(","):
        row = await measure(name, args)
        notes = ""
        if name == "bloom":
            notes = (
                f"fp measured {row['fp_measured']:.4f} vs configured {row['fp_configured']} "
                f"(m={row['bloom_m_k'][0]}, k={row['bloom_m_k'][1]}; the bitmaps alone: "
                f"{row['bloom_bytes_per_value']:.2f} bytes/value (MEMORY USAGE); "
                f"{row['values'] - row['committed']} false positives while filling)"
            )
        elif row["dup_answers_saved"] != 1.0:
            notes = f"only {row['dup_answers_saved']:.4f} of saved values answered saved!"
        print(
            f"{row['layout']:<12} {row['values']:>10} {row['bytes_per_value']:>11.2f} "
            f"{row['keys']:>9} {row['saves_per_s']:>9.0f} {row['dup_claims_per_s']:>12.0f} "
            f"{row['redis_us_per_save']:>13.2f} {row['redis_us_per_dup']:>12.2f}  "
            f"{notes}",
            flush=True,
        )


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--layouts", default="compact,compact-128,compact-retention,keys,bloom")
    parser.add_argument("--buckets", type=int, default=65536, help="marker_buckets")
    parser.add_argument("--fp-rate", type=float, default=0.01)
    args = parser.parse_args(argv)
    unknown = set(args.layouts.split(",")) - set(LAYOUTS)
    if unknown:
        parser.error(f"unknown layouts: {', '.join(sorted(unknown))}")
    return args


if __name__ == "__main__":
    run_loop(main(parse(sys.argv[1:])))
