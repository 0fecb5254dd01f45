"""Locust users for the library: one dedup ``Gateway`` per locust process, no HTTP.

    DEDUP_REDIS_URL=redis://127.0.0.1:6379/0 \\
    DEDUP_DATABASE_URL=postgresql://postgres@127.0.0.1:5432/dedup \\
    locust -f loadtest/locustfile_lib.py --headless -u 256 -r 256 -t 30s

Users are greenlets; the Gateway is asyncio. Each locust process runs ONE Gateway on ONE
event loop in ONE real OS thread, and every user hands its saves to that loop:

- ``LibrarySaveUser``: ``await gw.save(kind, value)``, one request event per call
  (request_type ``save``, name = the kind);
- ``LibraryBatchUser``: ``await gw.save_many(...)`` of ``DEDUP_LOAD_BATCH`` items
  (request_type ``save_many``; its "response length" is the number of items, so locust's
  average content size reads as items per call).

The response time is from the hand-over to the answer's arrival back in the user's greenlet;
an exception (``Overloaded``, ``Unavailable``, ``WaitTimeout``...) is a failure named by its
class. Values, weights and the record of answers: see ``workload.py``. The Gateway reads
no environment; this file passes it ``DEDUP_REDIS_URL`` and ``DEDUP_DATABASE_URL`` (both
required: the embedded default belongs to one process, and locust may run several).

Why a thread from gevent's ThreadPool: locust monkey-patches the standard library with
gevent before this file is imported, so ``threading.Thread`` makes a greenlet, not a thread,
and a blocking event loop in it would stop every user. ``gevent.threadpool.ThreadPool``
starts its workers with the *original* ``_thread.start_new_thread`` that gevent keeps
aside, so its worker is a real OS thread whatever was patched; the pool of our own (size
1) keeps that thread out of gevent's hub pool, which gevent's DNS resolver uses. The loop
in it is uvloop's: libuv does its own polling and sockets, while asyncio's default loop
would pick up ``selectors.DefaultSelector``, which gevent replaced with its own selector.

The two directions cross threads with each side's thread-safe wake-up: a user calls
``loop.call_soon_threadsafe`` (wakes the asyncio loop), and the loop answers through
``hub.loop.run_callback_threadsafe`` (wakes gevent's hub), which sets a gevent
``AsyncResult`` in the hub's own thread. Nothing here uses ``concurrent.futures`` or a
patched ``threading`` lock across the two threads: those would be gevent locks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

import gevent
import gevent.lock
from gevent.event import AsyncResult
from gevent.threadpool import ThreadPool
from locust import User, constant, events, task
from locust.env import Environment
from workload import (
    BATCH,
    BATCH_WEIGHT,
    KIND,
    SINGLE_WEIGHT,
    GracefulStop,
    ZipfValues,
    recorder,
)

from dedup import Gateway, SaveResult

__all__ = ["GatewayThread", "LibraryBatchUser", "LibrarySaveUser"]

log = logging.getLogger("dedup.locust")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # works, through gevent's selector: slower
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class GatewayThread:
    """One Gateway running on an asyncio loop in a real OS thread; greenlets call into it."""

    def __init__(self, redis_url: str, database_url: str) -> None:
        self._urls = (redis_url, database_url)
        self._hub_loop = gevent.get_hub().loop
        self._pool = ThreadPool(1)
        self._ready: AsyncResult = AsyncResult()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gateway: Gateway | None = None
        self._stop: asyncio.Event | None = None
        self._done: AsyncResult | None = None

    # -- the native thread ---------------------------------------------------------------
    def _thread_main(self) -> None:
        loop = _new_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
        finally:
            loop.close()

    async def _serve(self) -> None:
        try:
            redis_url, database_url = self._urls
            async with Gateway(redis_url, database_url) as gw:
                self._loop = asyncio.get_running_loop()
                self._gateway = gw
                self._stop = asyncio.Event()
                self._hub_loop.run_callback_threadsafe(self._ready.set, None)
                await self._stop.wait()
        except BaseException as exc:
            self._hub_loop.run_callback_threadsafe(self._ready.set_exception, exc)
            raise

    def _call(self, make: Callable[[], Coroutine[Any, Any, Any]], result: AsyncResult) -> None:
        """In the loop's thread: run one call, send its outcome to the hub's thread."""
        assert self._loop is not None

        def deliver(t: asyncio.Future[Any]) -> None:
            if t.cancelled():
                self._hub_loop.run_callback_threadsafe(
                    result.set_exception, asyncio.CancelledError()
                )
            elif (exc := t.exception()) is not None:
                self._hub_loop.run_callback_threadsafe(result.set_exception, exc)
            else:
                self._hub_loop.run_callback_threadsafe(result.set, t.result())

        self._loop.create_task(make()).add_done_callback(deliver)

    # -- the greenlets ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread and open the Gateway; raise what opening it raised."""
        self._done = self._pool.spawn(self._thread_main)
        try:
            self._ready.get(timeout=START_TIMEOUT_S)
        except BaseException:
            self._pool.kill()  # the thread has ended (or will): let its worker go
            raise

    def run(self, make: Callable[[Gateway], Coroutine[Any, Any, Any]]) -> Any:
        """Run ``make(gateway)`` on the loop; block this greenlet (only) until it answers."""
        loop, gw = self._loop, self._gateway
        if loop is None or gw is None:
            raise RuntimeError("the Gateway thread is not running")
        result: AsyncResult = AsyncResult()
        loop.call_soon_threadsafe(self._call, lambda: make(gw), result)
        return result.get()

    def stop(self) -> None:
        """Close the Gateway (it waits for the saves in flight) and end the thread."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._done is not None:
            self._done.get(timeout=STOP_TIMEOUT_S)
        self._pool.kill()


_engine: GatewayThread | None = None
_engine_lock = gevent.lock.BoundedSemaphore()


def gateway_thread() -> GatewayThread:
    """This process's GatewayThread, started by the first user that needs it."""
    global _engine
    with _engine_lock:
        if _engine is None:
            redis_url = os.environ.get("DEDUP_REDIS_URL", "")
            database_url = os.environ.get("DEDUP_DATABASE_URL", "")
            if not redis_url or not database_url:
                raise RuntimeError("set DEDUP_REDIS_URL and DEDUP_DATABASE_URL")
            engine = GatewayThread(redis_url, database_url)
            engine.start()
            _engine = engine
        return _engine


class _LibraryUser(GracefulStop, User):
    abstract = True
    wait_time = constant(0)

    def on_start(self) -> None:
        self.values = ZipfValues()
        self.engine = gateway_thread()

    def _timed(
        self, request_type: str, items: int, make: Callable[[Gateway], Coroutine[Any, Any, Any]]
    ) -> Any:
        start = time.perf_counter()
        answer: Any = None
        error: BaseException | None = None
        try:
            answer = self.engine.run(make)
        except Exception as exc:
            error = exc
        self.environment.events.request.fire(
            request_type=request_type,
            name=KIND,
            response_time=(time.perf_counter() - start) * 1000.0,
            response_length=items,
            exception=error,
            context={},
        )
        return answer


class LibrarySaveUser(_LibraryUser):
    """``Gateway.save`` of one Zipf-drawn value per call."""

    weight = SINGLE_WEIGHT

    @task
    def save(self) -> None:
        value = self.values.one()
        answer: SaveResult | None = self._timed("save", 1, lambda gw: gw.save(KIND, value))
        if answer is not None:
            recorder.add(value, answer.created)


class LibraryBatchUser(_LibraryUser):
    """``Gateway.save_many`` of ``DEDUP_LOAD_BATCH`` Zipf-drawn values per call."""

    weight = BATCH_WEIGHT

    @task
    def save_many(self) -> None:
        values = self.values.draw(BATCH)
        items = [(KIND, v) for v in values]
        answers: list[SaveResult] | None = self._timed(
            "save_many", len(items), lambda gw: gw.save_many(items)
        )
        if answers is not None:
            for value, answer in zip(values, answers, strict=True):
                recorder.add(value, answer.created)


def _close(environment: Environment, **_: Any) -> None:
    # Users are stopped by now: close the Gateway (no lease stays held), then the record.
    if _engine is not None:
        try:
            _engine.stop()
        except Exception:
            log.exception("closing the Gateway failed")
            environment.process_exit_code = 1
    recorder.flush()


events.quitting.add_listener(_close)  # type: ignore[no-untyped-call]
