"""Gateway CPU per new value for each marker layout, in one process (not a test); or,
with ``--scripts``, Redis's script time per saved value for each Redis version and script
variant.

    .venv/bin/python bench/layout_cost.py [--requests 200000] [--callers 256] [--rounds 2]
    .venv/bin/python bench/layout_cost.py --scripts [--values 100000] [--batch 256] \
        [--redis-server PATH ...]

Default: starts a throwaway redis-server and PostgreSQL, then saves uniform new values
(over 10 million) from ``--callers`` coroutines through one Gateway per layout
(``compact`` and ``keys``, ``shared_writes="off"``), alternating, and prints requests/s
and the process's CPU per request.

``--scripts``: for each ``--redis-server`` binary (default: the one on PATH, and
``.venv/redis-6.2/redis-server`` when ``setup.sh --tests`` fetched it), a throwaway
server; on it, each script variant its version runs (:data:`dedup._redis.script.VARIANTS`) and
each layout claims then commits ``--values`` new values in batches of ``--batch``, and
the server's own count of the time its scripts ran (``INFO commandstats``: EVALSHA's
``usec``, reset before each run) is divided by the values saved. The variants alternate
within each round, so a ratio between them on one server is the figure to read; the box
may be shared.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import time
from typing import Any

from redis.asyncio import Redis

from dedup import Gateway
from dedup._claims.bloom import BloomSpec
from dedup._claims.keys import KeySpace
from dedup._claims.protocol import Claims
from dedup._redis.embedded import server_version
from dedup._redis.script import VARIANTS, ScriptVariant
from dedup._values import digest
from dedup.loop import run as run_loop
from dedup.metrics import Stats
from dedup.store.migrate import upgrade
from dedup.testing.servers import PostgresCluster, RedisServer

_REDIS6 = ".venv/redis-6.2/redis-server"
_SCRIPT_LAYOUTS: dict[str, dict[str, Any]] = {
    "compact": {},
    "keys": {"layout": "keys"},
    "approximate": {"approximate": BloomSpec(10_000_000)},
}


async def _one(redis_url: str, pg_url: str, layout: str, requests: int, callers: int) -> None:
    rng = random.Random()
    values = iter([f"u{rng.randrange(10_000_000)}" for _ in range(requests)])
    async with Gateway(
        redis_url, pg_url, namespace=f"cost-{layout}", shared_writes="off", marker_layout=layout
    ) as gw:

        async def caller() -> None:
            for value in values:
                await gw.save("cost", value)

        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(caller() for _ in range(callers)))
        elapsed = time.perf_counter() - started
        used = time.process_time() - cpu
    print(
        f"layout={layout:8s} req/s={requests / elapsed:9,.0f} "
        f"cpu_us/req={used / requests * 1e6:.1f}",
        flush=True,
    )


async def _script_us(
    url: str, variant: ScriptVariant, layout: str, values: int, batch: int, tag: str
) -> float:
    """Script time (µs, Redis's own count) per value claimed and committed."""
    client = Redis.from_url(url)
    try:
        claims = Claims(
            client, lease_ms=60_000, retention_ms=0, stats=Stats(), variant=variant,
            **_SCRIPT_LAYOUTS[layout],
        )  # fmt: skip
        space = KeySpace(f"cost-{tag}")
        warm = [space.key("cost", digest("warm-up"))]
        await claims.claim(warm)  # loads the scripts: not counted
        await claims.commit(warm)
        keys = [space.key("cost", digest(f"v{i}")) for i in range(values)]
        await client.config_resetstat()
        for start in range(0, values, batch):
            chunk = keys[start : start + batch]
            assert await claims.claim(chunk) == "W" * len(chunk)
            assert await claims.commit(chunk) == len(chunk)
        stats: Any = await client.info("commandstats")
        return float(stats["cmdstat_evalsha"]["usec"]) / values
    finally:
        await client.aclose()


def _scripts(args: argparse.Namespace) -> None:
    binaries = args.redis_server or [
        b for b in (shutil.which("redis-server"), _REDIS6) if b and os.access(b, os.X_OK)
    ]
    for binary in binaries:
        version = server_version(binary)
        runnable = [v for v in VARIANTS if version[:2] >= v.since]
        shown = ".".join(map(str, version))
        with RedisServer(binary=binary) as server:
            for n in range(args.rounds):
                for variant in runnable:
                    for layout in _SCRIPT_LAYOUTS:
                        tag = f"{n}-{variant.name}-{layout}"
                        us = run_loop(
                            _script_us(server.url, variant, layout, args.values, args.batch, tag)
                        )
                        print(
                            f"redis={shown:8s} variant={variant.name} layout={layout:11s} "
                            f"script_us/value={us:.2f}",
                            flush=True,
                        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--callers", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scripts", action="store_true", help="script time per saved value")
    parser.add_argument("--values", type=int, default=100_000, help="--scripts: values per run")
    parser.add_argument("--batch", type=int, default=256, help="--scripts: values per call")
    parser.add_argument(
        "--redis-server", action="append", help="--scripts: a redis-server binary (repeatable)"
    )
    args = parser.parse_args()
    if args.scripts:
        _scripts(args)
        return
    with RedisServer() as redis_server, PostgresCluster() as pg:
        pg_url = pg.create_database("cost")
        upgrade(pg_url)
        for _ in range(args.rounds):
            for layout in ("compact", "keys"):
                run_loop(_one(redis_server.url, pg_url, layout, args.requests, args.callers))


if __name__ == "__main__":
    main()
