"""A gateway in a process of its own, for the forget tests: ``python -m tests.forget_child JOB``.

It opens a Gateway (``redis_url``, ``database_url``, ``options`` of the job), prints
``READY``, then runs the commands it reads, one JSON object a line, printing one JSON
line for each:

- ``{"op": "save", "values": [...]}``: saves them at once; prints a list of
  ``[value, created, source]``;
- ``{"op": "stream", "values": [...], "seconds": s, "concurrency": n, "seed": k,
  "keep": "all"}``: saves values picked at random from ``values`` from ``n`` coroutines
  for ``s`` seconds, or until a ``{"op": "stop", "then": m}`` line comes and ``m``
  (default 0) saves started after it succeeded; prints a list of
  ``[value, start, end, created, source]`` (``time.monotonic()``, the system-wide clock
  that the test process reads too; ``created`` None on an error, whose repr is then the
  source). With ``"keep": "decisive"`` the list holds only the saves that decide the
  forget tests' checks: every error, every ``created=True`` answer, and the save of each
  value that started last (a stream answers hundreds of thousands of saves from the
  local tier, and printing and parsing them all would cost more than the stream);
- ``{"op": "stop"}`` outside a stream (it ended by its ``seconds``): ignored;
- ``{"op": "quit"}``: closes the Gateway and exits.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import sys
import threading
import time
from typing import Any

from dedup import DedupError, Gateway


class _Commands:
    """The commands on stdin, read by a thread of its own so that a ``stop`` can arrive
    while a stream runs."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._held: collections.deque[dict[str, Any] | None] = collections.deque()
        self._loop = loop
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, json.loads(line))
        self._loop.call_soon_threadsafe(self._queue.put_nowait, None)  # stdin closed

    async def next(self) -> dict[str, Any] | None:
        """The next command; None once stdin is closed."""
        return self._held.popleft() if self._held else await self._queue.get()

    async def stop(self) -> dict[str, Any]:
        """The next ``stop`` command; any other command before it waits for :meth:`next`."""
        while True:
            command = await self._queue.get()
            if command is not None and command["op"] == "stop":
                return command
            self._held.append(command)


async def _stream(gw: Gateway, command: dict[str, Any], commands: _Commands) -> list[list[Any]]:
    values: list[str] = command["values"]
    rng = random.Random(command.get("seed", 0))
    deadline = time.monotonic() + command["seconds"]
    records: list[list[Any]] = []
    done = asyncio.Event()
    stop_at: float | None = None  # when the stop command came
    then = 0  # successes still wanted after it

    async def worker() -> None:
        nonlocal then
        while not done.is_set() and time.monotonic() < deadline:
            value = rng.choice(values)
            start = time.monotonic()
            try:
                r = await gw.save("email", value)
            except DedupError as exc:
                records.append([value, start, time.monotonic(), None, repr(exc)])
                continue
            records.append([value, start, time.monotonic(), r.created, r.source])
            if stop_at is not None and start > stop_at:
                then -= 1
                if then <= 0:
                    done.set()

    async def watch() -> None:
        nonlocal stop_at, then
        order = await commands.stop()
        then = order.get("then", 0)
        stop_at = time.monotonic()
        if then <= 0:
            done.set()

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.gather(*(worker() for _ in range(command.get("concurrency", 8))))
    finally:
        watcher.cancel()
    if command.get("keep", "all") == "decisive":
        last: dict[str, list[Any]] = {}
        for record in records:
            if record[3] is not None and record[1] >= last.get(record[0], record)[1]:
                last[record[0]] = record
        kept = [r for r in records if r[3] is None or r[3] is True]
        records = kept + [r for r in last.values() if r[3] is not True]
    return records


async def _main(job: dict[str, Any]) -> None:
    commands = _Commands(asyncio.get_running_loop())
    async with Gateway(job["redis_url"], job["database_url"], **job.get("options", {})) as gw:
        print("READY", flush=True)
        while True:
            command = await commands.next()
            if command is None or command["op"] == "quit":
                return
            if command["op"] == "stop":
                continue  # its stream had ended by its seconds already
            if command["op"] == "save":
                results = await gw.save_many([("email", v) for v in command["values"]])
                out: Any = [
                    [v, r.created, r.source]
                    for v, r in zip(command["values"], results, strict=True)
                ]
            else:
                out = await _stream(gw, command, commands)
            print(json.dumps(out), flush=True)


def main() -> None:
    """Run the job given as JSON in argv[1]."""
    asyncio.run(_main(json.loads(sys.argv[1])))


if __name__ == "__main__":
    main()
