"""Gateway CPU per new value for each marker layout, in one process (not a test).

    .venv/bin/python bench/layout_cost.py [--requests 200000] [--callers 256] [--rounds 2]

Starts a throwaway redis-server and PostgreSQL, then saves uniform new values (over 10
million) from ``--callers`` coroutines through one Gateway per layout (``compact`` and
``keys``, ``shared_writes="off"``), alternating, and prints requests/s and the process's
CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from dedup import Gateway
from dedup.loop import run as run_loop
from dedup.migrate import upgrade
from dedup.servers import PostgresCluster, RedisServer


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--callers", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with RedisServer() as redis_server, PostgresCluster() as pg:
        pg_url = pg.create_database("cost")
        upgrade(pg_url)
        for _ in range(args.rounds):
            for layout in ("compact", "keys"):
                run_loop(_one(redis_server.url, pg_url, layout, args.requests, args.callers))


if __name__ == "__main__":
    main()
