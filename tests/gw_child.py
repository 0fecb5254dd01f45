"""A child process for the multi-process tests: ``python -m tests.gw_child JOB_JSON``.

Modes:
- ``save``: save every value of ``values`` from ``concurrency`` coroutines and print
  one JSON line per answer: ``{"value", "created", "source"}`` or ``{"value", "error"}``;
- ``hold``: claim ``values`` with a sink that never returns: prints ``HOLDING`` once
  the leases are held, then waits to be killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

from dedup import DedupError, Gateway, Row


async def _save(job: dict[str, Any]) -> None:
    values: list[str] = job["values"]
    async with Gateway(job["redis_url"], job["database_url"], **job.get("options", {})) as gw:
        print("READY", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # start together
        it = iter(values)
        lines: list[str] = []

        async def worker() -> None:
            for value in it:
                try:
                    r = await gw.save("email", value)
                except DedupError as exc:
                    lines.append(json.dumps({"value": value, "error": repr(exc)}))
                else:
                    lines.append(
                        json.dumps({"value": value, "created": r.created, "source": r.source})
                    )

        await asyncio.gather(*(worker() for _ in range(job.get("concurrency", 32))))
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


async def _hold(job: dict[str, Any]) -> None:
    async def never(rows: Sequence[Row]) -> list[tuple[str, bytes]]:
        print("HOLDING", flush=True)
        await asyncio.Event().wait()
        return []

    async with Gateway(job["redis_url"], sink=never, **job.get("options", {})) as gw:
        await gw.save_many([("email", v) for v in job["values"]])


def main() -> None:
    job = json.loads(sys.argv[1])
    asyncio.run(_save(job) if job["mode"] == "save" else _hold(job))


if __name__ == "__main__":
    main()
