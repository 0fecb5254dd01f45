"""CPU per acquisition of dedup.lock.Lock against redis-py's Lock, in one process.

    .venv/bin/python bench/lock_cost.py [--acquisitions 20000] [--tasks 4] [--names 1000]
                                        [--rounds 2]

Starts its own redis-server (see dedup.testing.servers). In one process, ``tasks``
asyncio tasks loop acquire + release on names drawn at random from ``names``, until
``acquisitions`` in all; printed per lock and round: the client's CPU time per
acquisition (``time.process_time``), the redis-server's (INFO ``used_cpu_user`` +
``used_cpu_sys``) and the rate. Where lock_bench.py's rates are noisy, this says what
each acquisition costs the client and the server. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.asyncio.lock import Lock as RedisLock

from dedup.lock import Lock
from dedup.testing.servers import RedisServer


def _server_cpu(url: str) -> float:
    client = SyncRedis.from_url(url)
    try:
        info: dict[str, Any] = client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    finally:
        client.close()


async def _run(url: str, cls: Any, args: argparse.Namespace) -> tuple[float, float, float]:
    client = Redis.from_url(url)
    done = 0

    async def worker() -> None:
        nonlocal done
        locks: dict[str, Any] = {}
        while done < args.acquisitions:
            name = f"cost:{random.randrange(args.names)}"
            lock = locks.get(name)
            if lock is None:
                lock = locks[name] = cls(client, name)
            await lock.acquire()
            done += 1
            await lock.release()

    server_before = _server_cpu(url)
    cpu_before, wall_before = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.tasks)))
    cpu, wall = time.process_time() - cpu_before, time.perf_counter() - wall_before
    server = _server_cpu(url) - server_before
    await client.aclose()
    return cpu / done * 1e6, server / done * 1e6, done / wall


def main() -> None:
    """Parse the arguments; measure each lock ``rounds`` times, alternating; print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--acquisitions", type=int, default=20000)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--names", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"{'lock':<10} {'client CPU us/acq':>18} {'Redis CPU us/acq':>17} {'acq/s':>8}")
    with RedisServer() as server:
        for _ in range(args.rounds):
            for label, cls in (("redis-py", RedisLock), ("dedup", Lock)):
                client_us, server_us, rate = asyncio.run(_run(server.url, cls, args))
                print(f"{label:<10} {client_us:>18.1f} {server_us:>17.1f} {rate:>8,.0f}")


if __name__ == "__main__":
    main()
