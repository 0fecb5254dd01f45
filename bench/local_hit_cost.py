"""CPU per repeat answered by the local tier: the Gateway against db-only (not a test).

    .venv/bin/python bench/local_hit_cost.py [--saves 300000]

Starts a throwaway redis-server and PostgreSQL, saves 1,000 values once through a Gateway
and through ``dedup bench``'s db-only strategy, then saves them again and again from one
coroutine, one at a time, and prints the process CPU per save: the cost of a repeat that
the local tier answers, without the bench's callers, latencies and event-loop wake-ups.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import asyncpg

from dedup import Gateway
from dedup.bench.strategies import _Counter, _DbOnly
from dedup.store.migrate import upgrade
from dedup.testing.servers import PostgresCluster, RedisServer


async def _measure(redis_url: str, pg_url: str, saves: int) -> None:
    values = [f"v{i}" for i in range(1000)]
    stream = values * (saves // len(values))
    async with Gateway(redis_url, pg_url, namespace="hit") as gw:
        for value in values:
            await gw.save("k", value)
        started = time.process_time()
        for value in stream:
            await gw.save("k", value)
        used = time.process_time() - started
        print(f"Gateway.save, local tier: {1e6 * used / len(stream):.2f} us per save")
    pool = await asyncpg.create_pool(pg_url)
    try:
        db_only = _DbOnly(pool, _Counter())
        for value in values:
            await db_only.save(value)
        started = time.process_time()
        for value in stream:
            await db_only.save(value)
        used = time.process_time() - started
        print(f"db-only, its LRU:         {1e6 * used / len(stream):.2f} us per save")
    finally:
        await pool.close()


def main() -> None:
    """Start the servers and measure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--saves", type=int, default=300_000)
    args = parser.parse_args()
    with RedisServer() as redis_server, PostgresCluster() as pg:
        url = pg.create_database("hit")
        upgrade(url)
        asyncio.run(_measure(redis_server.url, url, args.saves))


if __name__ == "__main__":
    main()
