"""A child process for the lock tests: ``python -m tests.lock_child JOB_JSON``.

Modes:
- ``contend``: print ``READY``, wait for a line on stdin, then from ``tasks``
  coroutines take the lock ``iterations`` times each. Inside, INCR a shared
  ``inside`` counter (it must read 1: nobody else inside), append
  ``[fence, pid, inside]`` to the list ``log`` (RPUSH order is entry order), DECR.
  Print ``{"max_inside": n, "count": n}``.
- ``hold``: take the lock, print ``{"fence": n}``, then wait for a line on stdin.
  On ``write``: write ``child`` to the fenced resources with that fence, without
  asking whether the lock is still held (as a process waking from a pause would),
  and print ``{"sql": ..., "redis": ..., "owned": bool}`` where each write is
  ``"written"`` or ``"rejected"``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import asyncpg
from redis.asyncio import Redis

from dedup.errors import StaleFence
from dedup.lock import Lock, check_fence, fenced_set

# The protected resource of the fencing tests (the application's own table).
LEDGER_UPSERT_SQL = """
INSERT INTO ledger (resource, writer, fence) VALUES ($1, $2, $3)
ON CONFLICT (resource) DO UPDATE SET writer = EXCLUDED.writer, fence = EXCLUDED.fence
"""


async def write_fenced(
    redis: Redis, database_url: str, resource: str, writer: str, fence: int
) -> dict[str, str]:
    """Write ``writer`` to the SQL ledger and to the Redis hash ``resource``, each
    guarded by ``fence``; what became of each write."""
    out: dict[str, str] = {}
    conn = await asyncpg.connect(database_url)
    try:
        async with conn.transaction():
            await check_fence(conn, resource, fence)
            await conn.execute(LEDGER_UPSERT_SQL, resource, writer, fence)
        out["sql"] = "written"
    except StaleFence:
        out["sql"] = "rejected"
    finally:
        await conn.close()
    try:
        await fenced_set(redis, resource, writer, fence)
        out["redis"] = "written"
    except StaleFence:
        out["redis"] = "rejected"
    return out


async def _contend(job: dict[str, Any], redis: Redis) -> None:
    print("READY", flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # start together
    pid = os.getpid()
    max_inside = 0
    count = 0

    async def worker() -> None:
        nonlocal max_inside, count
        for _ in range(job["iterations"]):
            lock = Lock(redis, job["name"], blocking_timeout=30, **job.get("options", {}))
            async with lock:
                inside = int(await redis.incr("inside"))
                max_inside = max(max_inside, inside)
                await redis.rpush("log", json.dumps([lock.fence, pid, inside]))
                await asyncio.sleep(0.001)
                await redis.decr("inside")
            count += 1

    await asyncio.gather(*(worker() for _ in range(job.get("tasks", 1))))
    print(json.dumps({"max_inside": max_inside, "count": count}), flush=True)


async def _hold(job: dict[str, Any], redis: Redis) -> None:
    lock = Lock(redis, job["name"], **job.get("options", {}))
    assert await lock.acquire(blocking_timeout=30)
    print(json.dumps({"fence": lock.fence}), flush=True)
    line = await asyncio.to_thread(sys.stdin.readline)
    if line.strip() != "write":
        return
    assert lock.fence is not None
    out: dict[str, Any] = dict(
        await write_fenced(redis, job["database_url"], job["resource"], "child", lock.fence)
    )
    out["owned"] = await lock.owned()
    print(json.dumps(out), flush=True)


async def _main(job: dict[str, Any]) -> None:
    redis = Redis.from_url(job["redis_url"], socket_timeout=30, socket_connect_timeout=30)
    try:
        await (_contend(job, redis) if job["mode"] == "contend" else _hold(job, redis))
    finally:
        await redis.aclose()


def main() -> None:
    """Run the job given as JSON in argv[1]."""
    asyncio.run(_main(json.loads(sys.argv[1])))


if __name__ == "__main__":
    main()
