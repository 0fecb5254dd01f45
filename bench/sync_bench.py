"""SyncGateway from 1, 8 and 32 threads next to the async Gateway, in one run.

    .venv/bin/python bench/sync_bench.py [--seconds 3] [--callers 1,8,32] [--seen 20000]

Starts its own redis-server and PostgreSQL (see dedup.testing.servers). For each number of
callers, a closed loop of saves for ``seconds``: that many threads each calling
``SyncGateway.save``, then that many coroutines each awaiting ``Gateway.save`` on
one event loop. Two workloads:

- ``new``: every save is a value never seen (claim, INSERT, commit: a row each);
- ``seen``: values saved beforehand (``--seen`` of them) with the local tier off
  (``local_cache_size=0``), so Redis answers each save: the cheapest answer that
  still leaves the process, where the facade's own cost shows most.

Printed per row: saves per second of each workload. One Python process offers the
load, and its one core (the loop thread and the callers share the GIL) is the
limit. Not a test: figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
import threading
import time
from typing import Any

from dedup import Gateway, SyncGateway
from dedup.loop import run as run_loop
from dedup.store.migrate import upgrade
from dedup.testing.servers import PostgresCluster, RedisServer

_runs = itertools.count()


def _values(kind: str, seen: int) -> list[str]:
    return [f"{kind}-seen-{i}" for i in range(seen)]


def sync_rate(
    redis_url: str, pg_url: str, workload: str, callers: int, args: argparse.Namespace
) -> float:
    """Saves per second of ``callers`` threads sharing one SyncGateway."""
    run = next(_runs)
    options: dict[str, Any] = {"namespace": f"sync-bench-{run}"}
    if workload == "seen":
        options["local_cache_size"] = 0
    kind = f"sync{run}"
    seen = _values(kind, args.seen)
    counts = [0] * callers
    with SyncGateway(redis_url, pg_url, **options) as gw:
        if workload == "seen":
            for start in range(0, len(seen), 1000):
                gw.save_many([(kind, v) for v in seen[start : start + 1000]])
        start_line = threading.Barrier(callers + 1)
        stop_at = [0.0]

        def worker(n: int) -> None:
            rng = random.Random(n)
            start_line.wait()
            i = 0
            while time.monotonic() < stop_at[0]:
                value = rng.choice(seen) if workload == "seen" else f"{kind}-{n}-{i}"
                gw.save(kind, value)
                i += 1
            counts[n] = i

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(callers)]
        for t in threads:
            t.start()
        began = time.monotonic()
        stop_at[0] = began + args.seconds
        start_line.wait()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - began
    return sum(counts) / elapsed


async def async_rate(
    redis_url: str, pg_url: str, workload: str, callers: int, args: argparse.Namespace
) -> float:
    """Saves per second of ``callers`` coroutines sharing one Gateway."""
    run = next(_runs)
    options: dict[str, Any] = {"namespace": f"async-bench-{run}"}
    if workload == "seen":
        options["local_cache_size"] = 0
    kind = f"async{run}"
    seen = _values(kind, args.seen)
    counts = [0] * callers
    async with Gateway(redis_url, pg_url, **options) as gw:
        if workload == "seen":
            for start in range(0, len(seen), 1000):
                await gw.save_many([(kind, v) for v in seen[start : start + 1000]])
        loop = asyncio.get_running_loop()
        stop_at = loop.time() + args.seconds

        async def worker(n: int) -> None:
            rng = random.Random(n)
            i = 0
            while loop.time() < stop_at:
                value = rng.choice(seen) if workload == "seen" else f"{kind}-{n}-{i}"
                await gw.save(kind, value)
                i += 1
            counts[n] = i

        began = loop.time()
        await asyncio.gather(*(worker(n) for n in range(callers)))
        elapsed = loop.time() - began
    return sum(counts) / elapsed


def main(args: argparse.Namespace) -> None:
    callers = [int(c) for c in args.callers.split(",")]
    with RedisServer() as redis, PostgresCluster() as pg:
        pg_url = pg.create_database("sync_bench")
        upgrade(pg_url)
        print(f"saves/s, {args.seconds} s per cell; seen: {args.seen:,} values, local tier off")
        print(f"{'facade':<12} {'callers':>7} {'new':>9} {'seen':>9}")
        for n in callers:
            new = sync_rate(redis.url, pg_url, "new", n, args)
            seen = sync_rate(redis.url, pg_url, "seen", n, args)
            print(f"{'SyncGateway':<12} {n:>7} {new:>9.0f} {seen:>9.0f}", flush=True)
        for n in callers:
            new = run_loop(async_rate(redis.url, pg_url, "new", n, args))
            seen = run_loop(async_rate(redis.url, pg_url, "seen", n, args))
            print(f"{'Gateway':<12} {n:>7} {new:>9.0f} {seen:>9.0f}", flush=True)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--callers", default="1,8,32", help="threads / coroutines per cell")
    parser.add_argument("--seen", type=int, default=20_000, help="values saved beforehand")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse(sys.argv[1:]))
