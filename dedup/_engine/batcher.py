"""Steps 3 and 4 of a save: a queue of flights sent in batches, for claims and for writes.

Everything queued during one event-loop tick goes out together: ``max_batch``
flights a batch, at most ``max_running`` batches at once. While a batch is in
flight the next one starts only once ``min_fill`` flights wait (like Nagle): an
idle pipeline sends at once, a busy one lets the batch grow. A ``divert`` hook
takes the whole queue instead (degraded mode, when Redis is skipped).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from dedup._engine.flights import Flight

__all__ = ["Batcher"]

Send = Callable[[list[Flight]], Awaitable[None]]


class Batcher:
    """One queue of flights and the batches in flight from it.

    ``send`` runs one batch; ``spawn`` starts it as a task; ``divert`` (optional)
    may take the whole queue at a flush (it returns True when it did); ``on_error``
    learns a batch whose ``send`` raised; ``after`` runs when a batch ends.
    """

    __slots__ = ("_after", "_divert", "_loop", "_max_running", "_min_fill", "_on_error",
                 "_scheduled", "_send", "_size", "_spawn", "queue", "running")  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        size: int,
        max_running: int,
        min_fill: int,
        send: Send,
        spawn: Callable[[Awaitable[None]], None],
        on_error: Callable[[list[Flight], BaseException], None],
        divert: Callable[[list[Flight]], bool] | None = None,
        after: Callable[[], None] | None = None,
    ) -> None:
        self._loop = loop
        self._size = size
        self._max_running = max_running
        self._min_fill = min_fill
        self._send = send
        self._spawn = spawn
        self._on_error = on_error
        self._divert = divert
        self._after = after
        self._scheduled = False
        self.queue: list[Flight] = []
        self.running = 0

    def add(self, flight: Flight) -> None:
        """Queue one flight for the next batch."""
        self.queue.append(flight)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._flush)

    def extend(self, flights: list[Flight]) -> None:
        """Queue several flights for the next batch."""
        if flights:
            self.queue.extend(flights)
            self.schedule()

    def schedule(self) -> None:
        """Flush at the end of this loop iteration (once, however often asked)."""
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._flush)

    def clear(self) -> list[Flight]:
        """Take every queued flight out (at close)."""
        taken, self.queue = self.queue, []
        return taken

    def _flush(self) -> None:
        self._scheduled = False
        queue, size = self.queue, self._size
        if self._divert is not None and queue and self._divert(queue):
            queue.clear()
            return
        while queue and self.running < self._max_running:
            if self.running and len(queue) < self._min_fill:
                break  # a batch in flight flushes us when it ends: let this one grow
            batch = queue[:size]
            del queue[:size]
            self.running += 1
            self._spawn(self._run(batch))

    async def _run(self, batch: list[Flight]) -> None:
        try:
            await self._send(batch)
        except BaseException as exc:
            self._on_error(batch, exc)
            raise
        finally:
            self.running -= 1
            if self.queue:
                self.schedule()
            if self._after is not None:
                self._after()
