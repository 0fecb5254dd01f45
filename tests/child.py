"""A child process of ``tests/test_processes.py``: ``python -m tests.child JOB_FILE``.

The job is a JSON file (thousands of items are too long for one argument) holding
an object with ``mode``, ``redis_url`` and ``options`` (keyword arguments of
:class:`dedup.Gateway`, e.g. ``namespace``, ``lease_ms``, ``local_cache_size``),
plus per mode:

- ``save``: ``database_url``, ``items`` (``[kind, value]`` pairs, duplicates and all,
  in the order to save them), ``concurrency`` and ``out`` (a file). Opens the
  Gateway, prints ``READY``, waits for a line on stdin (so that every child starts
  at once), saves every item from ``concurrency`` coroutines and writes one JSON
  line per call to ``out``: ``{"kind", "value", "created", "source"}`` or
  ``{"kind", "value", "error"}``; then prints ``{"stats": ...}`` and ``DONE``. With
  ``"stream": true`` each line is written (and flushed) as soon as the call returns, so
  a parent that SIGKILLs the child still knows every answer it gave.
- ``hold``: ``items`` (distinct pairs). The Gateway's ``sink`` prints ``HOLDING <rows>``
  and then never returns, even when the Gateway's write timeout cancels it (a hung
  writer), so the leases of its claim batch stay taken until they expire. The
  parent SIGKILLs the child. ``identity`` (optional) is the sink's declared identity,
  so that it shares writes with gateways whose sinks declare the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Sequence
from typing import Any

from dedup import DedupError, Gateway, Row


async def _save(job: dict[str, Any]) -> None:
    items: list[tuple[str, str]] = [(k, v) for k, v in job["items"]]
    options: dict[str, Any] = job.get("options", {})
    lines: list[str] = []
    stream = open(job["out"], "w") if job.get("stream") else None  # noqa: SIM115
    async with Gateway(job["redis_url"], job["database_url"], **options) as gw:
        print("READY", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # the parent's "go"
        queue = iter(items)

        async def worker() -> None:
            for kind, value in queue:
                line: dict[str, Any]
                try:
                    r = await gw.save(kind, value, {"pid": job["name"]})
                except DedupError as exc:
                    line = {"kind": kind, "value": value, "error": repr(exc)}
                else:
                    line = {"kind": kind, "value": value, "created": r.created, "source": r.source}
                lines.append(json.dumps(line))
                if stream is not None:
                    stream.write(lines[-1] + "\n")
                    stream.flush()

        await asyncio.gather(*(worker() for _ in range(job["concurrency"])))
        stats = gw.stats()
    if stream is not None:
        stream.close()
    else:
        with open(job["out"], "w") as out:
            out.write("".join(line + "\n" for line in lines))
    print(json.dumps({"stats": stats.as_dict()}), flush=True)
    print("DONE", flush=True)


async def _hold(job: dict[str, Any]) -> None:
    async def hung_writer(rows: Sequence[Row]) -> list[tuple[str, bytes]]:
        print(f"HOLDING {len(rows)}", flush=True)
        while True:  # a writer stuck for good: it does not even honour cancellation
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    # The identity of the database the others write: shared writes pair only gateways
    # whose sinks say they write the same table.
    hung_writer.identity = job.get("identity")  # type: ignore[attr-defined]
    options: dict[str, Any] = job.get("options", {})
    async with Gateway(job["redis_url"], sink=hung_writer, **options) as gw:
        await gw.save_many([(k, v) for k, v in job["items"]])
    print("UNREACHABLE", flush=True)


def main() -> None:
    with open(sys.argv[1]) as f:
        job: dict[str, Any] = json.load(f)
    asyncio.run(_save(job) if job["mode"] == "save" else _hold(job))


if __name__ == "__main__":
    main()
