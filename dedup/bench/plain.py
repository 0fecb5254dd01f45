"""``db-plain``: the database alone written the plain way, a check on ``db-only``.

``db-only`` is the baseline dedup is measured against, so it must be as fast as the
database alone can honestly be made. This is the same work written from scratch and
sharing no code with it (a slow piece shared by both would hide from the check): an LRU
of values, a singleflight of futures, and per event-loop tick one key-sorted multi-row
``INSERT ... ON CONFLICT DO NOTHING RETURNING``, at most four in flight; every call
answers whether it created the row. ``dedup bench --strategies db-only,db-plain`` runs
both in the same driver and prints db-only's rate as a share of this one's.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import asyncpg

from dedup._values import digest

__all__ = ["PlainDbOnly"]

_INSERT = """
INSERT INTO dedup_items (kind, digest, value)
SELECT * FROM unnest($1::text[], $2::bytea[], $3::text[])
ON CONFLICT (kind, digest) DO NOTHING
RETURNING digest
"""


class PlainDbOnly:
    """Saves values of ``kind`` through ``pool``, remembering ``size`` saved values."""

    def __init__(self, pool: asyncpg.Pool, kind: str, size: int, max_batch: int = 512) -> None:
        self.pool, self.kind, self.size, self.max_batch = pool, kind, size, max_batch
        self.saved: OrderedDict[str, None] = OrderedDict()
        self.flights: dict[str, asyncio.Future[bool]] = {}
        self.queue: list[str] = []
        self.scheduled = False
        self.running = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.statements = self.rows_sent = 0

    async def save(self, value: str) -> bool:
        """True if this call inserted the row of ``value``."""
        if value in self.saved:
            self.saved.move_to_end(value)
            return False
        flight = self.flights.get(value)
        if flight is not None:
            await flight
            return False
        flight = self.flights[value] = asyncio.get_running_loop().create_future()
        self.queue.append(value)
        self._schedule()
        return await flight

    def _schedule(self) -> None:
        if self.queue and not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self.scheduled = False
        while self.queue and self.running < 4:
            batch, self.queue = self.queue[: self.max_batch], self.queue[self.max_batch :]
            self.running += 1
            task = asyncio.get_running_loop().create_task(self._write(batch))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _write(self, batch: list[str]) -> None:
        rows = sorted((digest(v), v) for v in batch)  # one lock order: no deadlocks
        self.statements += 1
        self.rows_sent += len(rows)
        try:
            kinds, digests, values = (
                [self.kind] * len(rows),
                [d for d, _ in rows],
                [v for _, v in rows],
            )
            new = {bytes(r[0]) for r in await self.pool.fetch(_INSERT, kinds, digests, values)}
        except Exception as exc:
            for v in batch:
                self.flights.pop(v).set_exception(exc)
        else:
            for d, v in rows:
                self.saved[v] = None
                if len(self.saved) > self.size:
                    self.saved.popitem(last=False)
                self.flights.pop(v).set_result(d in new)
        finally:
            self.running -= 1
            self._schedule()
