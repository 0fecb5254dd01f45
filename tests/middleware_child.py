"""A server process for the middleware tests:
``python -m tests.middleware_child FRAMEWORK REDIS_URL PG_URL RUNS OPTIONS_JSON``.

Serves :func:`tests.middleware_apps.serve` (its own Gateway or SyncGateway), prints
``URL <base>`` when it listens, and stops when stdin closes (the parent's end).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import orjson

from tests.middleware_apps import serve


async def main(argv: list[str]) -> None:
    framework, redis_url, pg_url, runs, options = argv
    base, close = await serve(framework, redis_url, pg_url, Path(runs), orjson.loads(options))
    print(f"URL {base}", flush=True)
    try:
        await asyncio.to_thread(sys.stdin.read)  # until the parent closes our stdin
    finally:
        await close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
