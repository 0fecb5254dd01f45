"""Shared writes against per-process writes: the same fleet, side by side (not a test).

    .venv/bin/python bench/shared_writes_bench.py --requests 400000 --processes 4,8,16 \\
        --modes auto,off [--layout compact]

Starts a throwaway redis-server and PostgreSQL (durable defaults), then for each
process count and ``shared_writes`` mode runs that many gateway processes with 256
callers in all on one Zipf(1.1) stream over 1,000,000 values (split round-robin),
and prints requests/s, PostgreSQL's transactions per unique value (``pg_stat_database``
around the run), the gateways' statements per unique value and their CPU per request.
Each process waits for the fleet's heartbeat before the stream starts, so ``auto``
already knows the fleet's size.

``--race``: every process saves the whole stream, in the same order, so that each new
value is raced by every process at once (the busy path: all but one of them find
another's lease); requests/s count the saves of all processes, and the line adds the
busy answers, the claim batches and the saves' mean and 99th-percentile latency.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Any

import asyncpg

from dedup import Gateway
from dedup._redis.connect import unlink_matching
from dedup.cli.demo import make_stream
from dedup.loop import run as run_loop
from dedup.store.migrate import upgrade
from dedup.testing.servers import PostgresCluster, RedisServer

CALLERS = 256
XACTS = (
    "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
)


def _child(
    index: int,
    n: int,
    values: list[str],
    urls: tuple[str, str],
    options: dict[str, Any],
    out: Queue[dict[str, Any]],
    go: Event,
    race: bool,
) -> None:
    async def main() -> None:
        async with Gateway(*urls, namespace="fleet", **options) as gw:
            await asyncio.sleep(2.5)  # two heartbeats: the fleet's size is known
            await asyncio.to_thread(go.wait)
            mine = iter(values if race else values[index::n])
            started, cpu = time.perf_counter(), time.process_time()
            latencies: list[float] = []
            created = 0

            async def caller() -> None:
                nonlocal created
                clock = time.perf_counter
                for value in mine:
                    t0 = clock()
                    result = await gw.save("z", value)  # before the +=, which reads first
                    created += result.created
                    latencies.append(clock() - t0)

            await asyncio.gather(*(caller() for _ in range(max(1, CALLERS // n))))
            elapsed = time.perf_counter() - started
        stats = gw.stats()  # after close: a writer's last statements are counted too
        out.put(
            {
                "elapsed": elapsed,
                "cpu": time.process_time() - cpu,
                "statements": stats.db_statements,
                "degraded": stats.degraded_answers,
                "busy": stats.busy,
                "claims": stats.claim_batches,
                "created": created,
                "latencies": latencies,
            }
        )

    run_loop(main())


async def _xacts(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return int(await conn.fetchval(XACTS))
    finally:
        await conn.close()


async def _reset(redis_url: str, pg_url: str) -> None:
    from redis.asyncio import Redis

    client = Redis.from_url(redis_url)
    try:
        await unlink_matching(client, "fleet:*")
    finally:
        await client.aclose()
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("DELETE FROM dedup_items WHERE kind = 'z'")
    finally:
        await conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400_000)
    parser.add_argument("--processes", default="4,8,16")
    parser.add_argument("--modes", default="auto,off")
    parser.add_argument("--layout", default="compact")
    parser.add_argument("--race", action="store_true", help="every process saves every value")
    args = parser.parse_args()
    ranks = make_stream(args.requests, 1_000_000, 1.1, 1)
    values = [f"v{r}" for r in ranks]
    unique = len(set(values))
    ctx = mp.get_context("spawn")
    with RedisServer() as redis_server, PostgresCluster() as pg:
        pg_url = pg.create_database("fleet")
        upgrade(pg_url)
        for n in (int(x) for x in args.processes.split(",")):
            for mode in args.modes.split(","):
                options = {"shared_writes": mode, "marker_layout": args.layout}
                asyncio.run(_reset(redis_server.url, pg_url))
                out: Queue[dict[str, Any]] = ctx.Queue()
                go = ctx.Event()
                urls = (redis_server.url, pg_url)
                procs = [
                    ctx.Process(
                        target=_child, args=(i, n, values, urls, options, out, go, args.race)
                    )
                    for i in range(n)
                ]
                for proc in procs:
                    proc.start()
                time.sleep(3 + n * 0.3)
                before = asyncio.run(_xacts(pg_url))
                go.set()
                results = [out.get(timeout=600) for _ in procs]
                for proc in procs:
                    proc.join()
                xacts = asyncio.run(_xacts(pg_url)) - before
                wall = max(r["elapsed"] for r in results)
                statements = sum(r["statements"] for r in results)
                cpu = sum(r["cpu"] for r in results)
                degraded = sum(r["degraded"] for r in results)
                requests = args.requests * (n if args.race else 1)
                line = (
                    f"processes={n:2d} shared_writes={mode:4s} req/s={requests / wall:9,.0f} "
                    f"xact/uniq={xacts / unique:.4f} stmt/uniq={statements / unique:.4f} "
                    f"cpu_us/req={cpu / requests * 1e6:.1f} degraded_answers={degraded:.0f}"
                )
                if args.race:
                    lat = sorted(x for r in results for x in r["latencies"])
                    line += (
                        f" created={sum(r['created'] for r in results)}/{unique}"
                        f" busy={sum(r['busy'] for r in results)}"
                        f" claims={sum(r['claims'] for r in results)}"
                        f" mean_ms={statistics.fmean(lat) * 1000:.2f}"
                        f" p99_ms={lat[int(len(lat) * 0.99)] * 1000:.2f}"
                    )
                print(line, flush=True)


if __name__ == "__main__":
    main()
