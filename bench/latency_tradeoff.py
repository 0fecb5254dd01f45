"""p99 latency against the database's statement budget, in one process (not a test).

    .venv/bin/python bench/latency_tradeoff.py [--requests 400000] [--callers 256]

Starts a throwaway redis-server and PostgreSQL, then replays ``dedup bench``'s Zipf(1.1)
stream through one Gateway per setting of the write batching (``max_batch``, which also
sets the minimum fill of a batch while another is in flight, ``max_batch / 8``, and
``max_write_batches``), and db-only for reference, and prints requests/s, p50/p99 and
PostgreSQL's transactions per unique value (``pg_stat_database``) for each: smaller and
more parallel batches answer sooner and cost more transactions.
"""

from __future__ import annotations

import argparse
from typing import Any

from dedup import bench
from dedup.bench.procs import _server_xacts, reset
from dedup.loop import run as run_loop
from dedup.store.migrate import upgrade
from dedup.testing.servers import PostgresCluster, RedisServer

SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("defaults (max_batch 512, 4 writes)", {}),
    ("max_batch 128", {"max_batch": 128}),
    ("max_batch 32", {"max_batch": 32}),
    ("max_batch 32, 8 writes", {"max_batch": 32, "max_write_batches": 8}),
    ("max_batch 256", {"max_batch": 256}),
]


def main() -> None:
    """Run every setting once on the same stream and servers; print one line each."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400_000)
    parser.add_argument("--callers", type=int, default=256)
    args = parser.parse_args()
    values = bench.workload_values("zipf", bench.BenchConfig(requests=args.requests))
    unique = len(set(values))
    with RedisServer() as redis_server, PostgresCluster() as pg:
        url = pg.create_database("tradeoff")
        upgrade(url)
        runs: list[tuple[str, str, dict[str, Any]]] = [("db-only", "db-only", {})]
        runs += [(name, "dedup", options) for name, options in SETTINGS]
        print(f"Zipf(1.1), {args.requests:,} requests, {unique:,} unique, {args.callers} callers")
        for name, strategy, options in runs:
            run_loop(reset(redis_server.url, url))
            before = run_loop(_server_xacts(url))
            result = run_loop(
                bench.run_one(
                    strategy, values, args.callers, redis_server.url, url, options=options
                )
            )
            xacts = run_loop(_server_xacts(url)) - before - 1  # -1: the first read's own
            print(
                f"{name:38s} {args.requests / result['seconds']:9,.0f} req/s  "
                f"p50 {result['p50_ms']:6.2f} ms  p99 {result['p99_ms']:6.2f} ms  "
                f"xact/uniq {xacts / unique:.4f}  created {result['created']:,}",
                flush=True,
            )


if __name__ == "__main__":
    main()
