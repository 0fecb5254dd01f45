"""Degraded mode at full offered load: what reaches PostgreSQL while Redis is stopped.

    .venv/bin/python bench/degraded_bench.py [--seconds 5] [--concurrency 4096]
                                             [--bounds 1,2,4] [--values 10000000]

Starts its own redis-server and PostgreSQL (see dedup.testing.servers) and, for each bound
in ``--bounds``, opens a Gateway with ``degraded_max_statements`` = that bound,
SIGSTOPs Redis, waits until the circuit is open, then lets ``concurrency``
coroutines save values (uniform over ``--values``, so nearly every save is a new
value that must reach the database) in a closed loop for ``seconds``. The default
concurrency exceeds ``max_batch`` (512) times the largest bound, so that full
batches wait and the bound, not the callers, limits the statements. Printed per
bound: saves acknowledged per second, ``Overloaded`` refusals, statements per second
as the gateway counted them and as PostgreSQL counted them (``pg_stat_database``
commits + rollbacks of the database, minus this script's own sampling queries: one
transaction per statement, since the sink's pool skips asyncpg's reset query),
rows per statement, and the most
statements seen running at once (``pg_stat_activity`` sampled every 5 ms). One
Python process offers the load; a single process saturates its own core first.
Not a test: figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from typing import Any

import asyncpg

from dedup import Gateway, Overloaded
from dedup.loop import run as run_loop
from dedup.store.migrate import upgrade_async
from dedup.testing.servers import PostgresCluster, RedisServer

XACTS = (
    "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
)
RUNNING_INSERTS = (
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
    "AND application_name = 'dedup' AND state = 'active' AND query LIKE '%INSERT INTO dedup_items%'"
)
STATS_FLUSH_S = 1.2  # time for exiting backends to publish their counters


async def xacts(conn: asyncpg.Connection) -> int:
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    return int(await conn.fetchval(XACTS))


async def run_bound(
    redis: RedisServer, pg_url: str, bound: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One measurement with ``degraded_max_statements=bound``."""
    rng = random.Random(bound)
    acked = refused = 0
    peak = samples = 0
    stop = asyncio.Event()
    monitor = await asyncpg.connect(pg_url)
    # Read around the Gateway's whole life: a backend publishes its counters when it
    # exits, but an idle one may sit on them for seconds. The few statements of
    # opening, warming up and tripping the circuit are counted too (under ten).
    before_x = await xacts(monitor)
    async with Gateway(
        redis.url,
        pg_url,
        namespace=f"degraded-bench-{bound}",
        redis_timeout_s=0.5,
        breaker_cooldown_s=3600.0,  # no probe during the run: it stays degraded
        degraded_max_statements=bound,
    ) as gw:
        await gw.save("warm", "up")
        redis.pause()
        try:
            with contextlib.suppress(Exception):
                await gw.save("warm", f"trip-{bound}")  # times out: the circuit opens
            assert gw.degraded, "the circuit did not open"

            async def worker() -> None:
                nonlocal acked, refused
                while not stop.is_set():
                    value = f"user-{rng.randrange(args.values):09d}@example.com"
                    try:
                        await gw.save("email", value)
                        acked += 1
                    except Overloaded:
                        refused += 1
                        await asyncio.sleep(0.001)

            async def sample() -> None:
                nonlocal peak, samples
                while not stop.is_set():
                    peak = max(peak, int(await monitor.fetchval(RUNNING_INSERTS)))
                    samples += 1
                    await asyncio.sleep(0.005)

            before = gw.stats()
            started = time.perf_counter()
            tasks = [asyncio.create_task(worker()) for _ in range(args.concurrency)]
            sampler = asyncio.create_task(sample())
            await asyncio.sleep(args.seconds)
            stop.set()
            await asyncio.gather(*tasks, sampler)
            elapsed = time.perf_counter() - started
            after = gw.stats()
        finally:
            redis.resume()
    await asyncio.sleep(STATS_FLUSH_S)
    after_x = await xacts(monitor)
    await monitor.close()
    statements = after.db_statements - before.db_statements
    rows = after.db_rows_sent - before.db_rows_sent
    return {
        "bound": bound,
        "saves_per_s": acked / elapsed,
        "overloaded": refused,
        "statements_per_s": statements / elapsed,
        # The sampler's own queries are transactions too: not the gateway's.
        "pg_xacts_per_s": (after_x - before_x - samples) / elapsed,
        "rows_per_statement": rows / statements if statements else 0.0,
        "rows_per_s": rows / elapsed,
        "peak_running": peak,
        "degraded_answers": after.degraded_answers - before.degraded_answers,
    }


async def main(args: argparse.Namespace) -> None:
    bounds = [int(b) for b in args.bounds.split(",")]
    with RedisServer() as redis, PostgresCluster() as pg:
        pg_url = pg.create_database("degraded_bench")
        await upgrade_async(pg_url)
        print(
            f"degraded mode, Redis SIGSTOPped: {args.concurrency} coroutines, {args.seconds} s "
            f"per bound, values uniform over {args.values:,}"
        )
        header = (
            f"{'bound':>5} {'saves/s':>9} {'overloaded':>10} {'stmts/s':>8} {'pg xacts/s':>10} "
            f"{'rows/stmt':>9} {'rows/s':>8} {'peak running':>12}"
        )
        print(header)
        for bound in bounds:
            r = await run_bound(redis, pg_url, bound, args)
            print(
                f"{r['bound']:>5} {r['saves_per_s']:>9.0f} {r['overloaded']:>10} "
                f"{r['statements_per_s']:>8.0f} {r['pg_xacts_per_s']:>10.0f} "
                f"{r['rows_per_statement']:>9.1f} {r['rows_per_s']:>8.0f} {r['peak_running']:>12}"
            )


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=4096)
    parser.add_argument("--bounds", default="1,2,4", help="degraded_max_statements values")
    parser.add_argument("--values", type=int, default=10_000_000)
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse(sys.argv[1:])
    run_loop(main(arguments))
