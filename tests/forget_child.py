"""A gateway in a process of its own, for the forget tests: ``python -m tests.forget_child JOB``.

It opens a Gateway (``redis_url``, ``database_url``, ``options`` of the job), prints
``READY``, then runs the commands it reads, one JSON object a line, printing one JSON
line for each:

- ``{"op": "save", "values": [...]}``: saves them at once; prints a list of
  ``[value, created, source]``;
- ``{"op": "stream", "values": [...], "seconds": s, "concurrency": n, "seed": k}``: saves
  values picked at random from ``values`` for ``s`` seconds from ``n`` coroutines;
  prints a list of ``[value, start, end, created, source]`` (``time.monotonic()``, the
  system-wide clock that the test process reads too; ``created`` None on an error, whose
  repr is then the source);
- ``{"op": "quit"}``: closes the Gateway and exits.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from typing import Any

from dedup import DedupError, Gateway


async def _stream(gw: Gateway, command: dict[str, Any]) -> list[list[Any]]:
    values: list[str] = command["values"]
    rng = random.Random(command.get("seed", 0))
    deadline = time.monotonic() + command["seconds"]
    records: list[list[Any]] = []

    async def worker() -> None:
        while time.monotonic() < deadline:
            value = rng.choice(values)
            start = time.monotonic()
            try:
                r = await gw.save("email", value)
            except DedupError as exc:
                records.append([value, start, time.monotonic(), None, repr(exc)])
            else:
                records.append([value, start, time.monotonic(), r.created, r.source])

    await asyncio.gather(*(worker() for _ in range(command.get("concurrency", 8))))
    return records


async def _main(job: dict[str, Any]) -> None:
    async with Gateway(job["redis_url"], job["database_url"], **job.get("options", {})) as gw:
        print("READY", flush=True)
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                return
            command = json.loads(line)
            if command["op"] == "quit":
                return
            if command["op"] == "save":
                results = await gw.save_many([("email", v) for v in command["values"]])
                out: Any = [
                    [v, r.created, r.source]
                    for v, r in zip(command["values"], results, strict=True)
                ]
            else:
                out = await _stream(gw, command)
            print(json.dumps(out), flush=True)


def main() -> None:
    """Run the job given as JSON in argv[1]."""
    asyncio.run(_main(json.loads(sys.argv[1])))


if __name__ == "__main__":
    main()
