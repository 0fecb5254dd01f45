"""Where one gateway process spends its time: one bench strategy under py-spy.

    .venv/bin/pip install py-spy
    .venv/bin/py-spy record -r 1000 -f raw -o /tmp/dedup.prof -- \\
        .venv/bin/python bench/profile_gateway.py dedup --requests 600000
    .venv/bin/python bench/profile_gateway.py --summary /tmp/dedup.prof

The first form starts a throwaway redis-server and PostgreSQL (dedup.testing.servers),
then runs one strategy of ``dedup bench`` (``dedup`` or ``db-only``...) on its
Zipf(1.1) or uniform stream (``--workload``, ``--callers``) in this process, and
prints requests/s. ``--summary`` reads py-spy's raw output and prints the
functions with the most samples, counting only samples taken while the stream ran
(not the servers' start or the stream's generation). Not a test.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

from dedup import bench
from dedup.bench.procs import reset
from dedup.loop import run as run_loop
from dedup.store.migrate import upgrade
from dedup.testing.servers import PostgresCluster, RedisServer

# Frames that mark a sample as taken while the stream ran.
_IN_RUN = ("run_one", "Gateway.", "_DbOnly", "uvloop")
_SETUP = ("_values", "make_stream", "PostgresCluster", "_Managed", "upgrade")


async def _run(
    strategy: str, workload: str, callers: int, requests: int, redis_url: str, pg_url: str
) -> None:
    values = bench.workload_values(workload, bench.BenchConfig(requests=requests))
    await reset(redis_url, pg_url)
    result = await bench.run_one(strategy, values, callers, redis_url, pg_url)
    rate = len(values) / result["seconds"]
    print(f"{strategy}: {rate:,.0f} requests/s, p99 {result['p99_ms']:.1f} ms", flush=True)


def summary(path: Path, top: int = 25) -> None:
    """Print the functions with the most samples (self and inclusive) from a raw profile."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not any(m in f for f in frames for m in _IN_RUN):
            continue
        if any(m in f for f in frames for m in _SETUP):
            continue
        n = int(count)
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    print(f"{total} samples while the stream ran")
    for title, counter in (("self", own), ("inclusive", inclusive)):
        print(f"\n{title}:")
        for frame, n in counter.most_common(top):
            print(f"  {100 * n / total:5.1f}%  {frame[:110]}")


def main() -> None:
    """Run a strategy (to be sampled by py-spy), or summarise a raw profile."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("strategy", nargs="?", default="dedup")
    parser.add_argument("--requests", type=int, default=600_000)
    parser.add_argument("--workload", choices=bench.WORKLOADS, default="zipf")
    parser.add_argument("--callers", type=int, default=256)
    parser.add_argument("--summary", type=Path, help="summarise a py-spy raw profile instead")
    args = parser.parse_args()
    if args.summary is not None:
        summary(args.summary)
        return
    with RedisServer() as redis_server, PostgresCluster() as pg:
        url = pg.create_database("profile")
        upgrade(url)
        run_loop(
            _run(args.strategy, args.workload, args.callers, args.requests, redis_server.url, url)
        )


if __name__ == "__main__":
    main()
