"""Forgetting at scale: the rate of ``forget_many``, and saves while a prune runs.

    .venv/bin/python bench/forget_bench.py [--forget 100000] [--prune 1000000] [--seconds 8]

Starts its own redis-server and PostgreSQL (durable defaults; see dedup.testing.servers).

1. ``forget_many``: saves ``--forget`` values, then forgets them all in one
   ``forget_many`` call; prints values forgotten a second (rows deleted, markers cleared,
   every tier told, the one-second wait included).
2. saves while a prune runs: ``--prune`` rows are inserted with SQL and dated 40 days
   back; then a saver process (one Gateway, 64 saves in flight, a pool of 20,000 values
   of which a tenth are new each pass) saves for ``--seconds`` alone, and again while
   ``dedup prune --older-than 30d`` runs in a process of its own; prints saves a second
   in each, their ratio, and the prune's rows a second.

Not a test: figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg

from dedup import Gateway
from dedup.store.migrate import upgrade
from dedup.testing.servers import PostgresCluster, RedisServer

ROOT = Path(__file__).resolve().parent.parent


async def _forget_rate(redis_url: str, pg_url: str, n: int) -> float:
    values = [("email", f"f{i}@example.com") for i in range(n)]
    async with Gateway(redis_url, pg_url) as gw:
        for i in range(0, n, 10_000):
            await gw.save_many(values[i : i + 10_000])
        started = time.perf_counter()
        results = await gw.forget_many(values)
        elapsed = time.perf_counter() - started
    assert sum(results) == n, sum(results)
    return n / elapsed


def _saver(redis_url: str, pg_url: str, seconds: float, tag: str, out: Any) -> None:
    out.send(asyncio.run(_saves(redis_url, pg_url, seconds, tag)))


async def _saves(redis_url: str, pg_url: str, seconds: float, tag: str) -> float:
    pool = [f"hot{i}@example.com" for i in range(18_000)]
    count = 0
    fresh = iter(range(10**9))
    async with Gateway(redis_url, pg_url) as gw:
        deadline = time.perf_counter() + seconds
        started = time.perf_counter()

        async def worker(seed: int) -> None:
            nonlocal count
            i = seed
            while time.perf_counter() < deadline:
                i = (i * 1103515245 + 12345) % 2**31
                if i % 10 == 0:
                    value = f"{tag}-new{next(fresh)}@example.com"
                else:
                    value = pool[i % len(pool)]
                await gw.save("email", value)
                count += 1

        await asyncio.gather(*(worker(s) for s in range(64)))
        return count / (time.perf_counter() - started)


def _measure_saves(redis_url: str, pg_url: str, seconds: float, tag: str) -> float:
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_saver, args=(redis_url, pg_url, seconds, tag, there))
    proc.start()
    rate: float = here.recv()
    proc.join()
    return rate


async def _old_rows(pg_url: str, n: int) -> None:
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(
            """
            INSERT INTO dedup_items (kind, digest, value, payload, created_at)
            SELECT 'email', decode(md5('old' || i) || md5('x' || i), 'hex')::bytea,
                   'old' || i || '@example.com', NULL, now() - interval '40 days'
            FROM generate_series(1, $1) AS i
            """,
            n,
        )
    finally:
        await conn.close()


def main() -> None:
    """Run both measurements and print them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--forget", type=int, default=100_000)
    parser.add_argument("--prune", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    with RedisServer() as redis_server, PostgresCluster() as pg:
        pg_url = pg.create_database("forget_bench")
        upgrade(pg_url)
        rate = asyncio.run(_forget_rate(redis_server.url, pg_url, args.forget))
        print(f"forget_many of {args.forget:,} values: {rate:,.0f} values/s")

        asyncio.run(_old_rows(pg_url, args.prune))
        alone = _measure_saves(redis_server.url, pg_url, args.seconds, "a")
        env = dict(os.environ, DEDUP_LOG_LEVEL="warning")
        prune = subprocess.Popen(
            [sys.executable, "-m", "dedup", "prune", "--kind", "email", "--older-than", "30d",
             "--redis-url", redis_server.url, "--database-url", pg_url],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        started = time.perf_counter()
        time.sleep(1.0)  # past the prune's count of the old rows: into its batches
        during = _measure_saves(redis_server.url, pg_url, args.seconds, "b")
        out, _ = prune.communicate(timeout=3600)
        prune_s = time.perf_counter() - started
        print(out.strip())
        print(f"saves alone:         {alone:,.0f}/s")
        print(f"saves during prune:  {during:,.0f}/s  ({during / alone:.2f}x)")
        print(f"prune: {args.prune:,} rows in {prune_s:.1f} s ({args.prune / prune_s:,.0f} rows/s)")


if __name__ == "__main__":
    main()
