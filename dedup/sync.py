"""SyncGateway: the Gateway for blocking code (threads, Kafka consumers, Celery tasks).

One background thread runs one event loop with one :class:`~dedup.Gateway` on it;
each blocking call hands its coroutine to that loop
(:func:`asyncio.run_coroutine_threadsafe`) and waits for the answer, bounded by a
timeout. Calls from many threads at once share the Gateway's batching: saves made
by 32 threads in the same instant go to Redis as one claim batch.

A SyncGateway belongs to the process that opened it: after ``fork()`` the child
has no loop thread, so every call there raises :class:`~dedup.DedupError`; the
child opens its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Iterable
from types import TracebackType
from typing import Any, Generic, ParamSpec, TypeVar, Unpack

from dedup._engine.once import Lease, Saved, begin, value_of
from dedup._values import validate_kind
from dedup.errors import DedupError, InvalidInput, WaitTimeout
from dedup.gateway import Gateway
from dedup.loop import new_loop
from dedup.metrics import Stats
from dedup.options import GatewayOptionsKwargs
from dedup.types import Item, SaveResult

__all__ = ["SyncGateway"]

log = logging.getLogger("dedup")

_P = ParamSpec("_P")
_T = TypeVar("_T")

_CALL_MARGIN_S = 5.0
_OPEN_TIMEOUT_S = 120.0  # starting an embedded redis-server and migrating SQLite included

_PENDING: Any = object()  # a _Call's outcome before its coroutine returned


async def _give_back(result: object) -> None:
    """Give back what an abandoned call won: a :class:`Lease` is released without saving
    (its watchdog stopped, this process's run of the value ended), rather than left
    held, for nobody, until the process ends. Other results hold nothing."""
    if not isinstance(result, Lease):
        return
    try:
        await result.fail()
    except Exception as exc:  # nobody awaits this outcome: say it here
        log.warning("could not release the lease of an abandoned call: %r", exc)


class _Call(Generic[_T]):
    """One blocking call's coroutine, run on the loop by :meth:`run`.

    A caller that stops waiting (its timeout) cannot simply cancel the coroutine: the
    coroutine may have returned already, or return despite the cancellation, and what
    it returned then reaches nobody. For a :class:`Lease` (``begin``, the WSGI
    middleware's claim) that meant a value held for ever: its watchdog renews it and
    this process's run of it never ends. So the caller first marks the call
    abandoned (:meth:`abandon`, on the loop), and whichever of the two comes second,
    the coroutine's return or the mark, gives the result back. Every attribute is
    touched on the loop thread only, so the two cannot interleave.
    """

    __slots__ = ("_abandoned", "_coro", "_result", "_started")

    def __init__(self, coro: Coroutine[Any, Any, _T]) -> None:
        self._coro = coro
        self._abandoned = False
        self._started = False
        self._result: _T = _PENDING

    async def run(self) -> _T:
        """Run the coroutine; if the caller abandoned the call meanwhile, give back its result."""
        self._started = True
        if self._abandoned:  # the caller left before this call started (see abandon)
            raise asyncio.CancelledError
        result = await self._coro
        if self._abandoned:
            # The caller left while the coroutine ran and it returned anyway (it
            # swallowed the cancellation): nobody will take the result.
            await _give_back(result)
        else:
            self._result = result
        return result

    def abandon(self, loop: asyncio.AbstractEventLoop) -> None:
        """The caller stopped waiting (called on the loop, before the cancellation arrives)."""
        if self._abandoned:
            return
        self._abandoned = True
        if not self._started:
            # It never ran and never will (run() sees the mark): closed here, so no
            # "coroutine was never awaited" warning when the task is cancelled first.
            self._coro.close()
        elif self._result is not _PENDING:
            # It returned before the mark arrived (the loop was busy past the caller's
            # timeout): its result was set on a future the caller no longer reads.
            result, self._result = self._result, _PENDING
            _keep(loop.create_task(_give_back(result), name="dedup-sync-give-back"))


_background: set[asyncio.Task[None]] = set()


def _keep(task: asyncio.Task[None]) -> None:
    """Hold a strong reference to ``task`` until it ends (the loop keeps weak ones only)."""
    _background.add(task)
    task.add_done_callback(_background.discard)


class SyncGateway:
    """A blocking, thread-safe :class:`~dedup.Gateway`.

    Takes the Gateway's arguments (``redis_url``, ``database_url`` and every option)
    plus ``call_timeout_s``: the bound on each blocking call (default
    ``wait_timeout_s`` + ``lease_ms`` + 5 s, so a call that waits for another writer
    still gets its own answer first). A call that passes it raises
    :class:`~dedup.WaitTimeout` and is cancelled. The Gateway is opened by the
    constructor and closed by :meth:`close` (or the ``with`` block).

    After :meth:`close`, and in a child process after ``fork()``, every call raises
    :class:`~dedup.DedupError`.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        database_url: str | None = None,
        *,
        call_timeout_s: float | None = None,
        **options: Unpack[GatewayOptionsKwargs],
    ) -> None:
        if call_timeout_s is not None and not call_timeout_s > 0:
            raise InvalidInput("call_timeout_s must be > 0", field="call_timeout_s")
        # Built here, so that a wrong option raises in the caller's thread at once.
        self._gateway = Gateway(redis_url, database_url, **options)
        self._pid = os.getpid()
        self._state_lock = threading.Lock()
        self._closed = False
        self._loop = new_loop()
        self._thread = threading.Thread(
            target=self._run_loop, name="dedup-sync-gateway", daemon=True
        )
        self._thread.start()
        try:
            self._submit(self._gateway.open()).result(timeout=_OPEN_TIMEOUT_S)
        except BaseException:
            self._stop_loop()
            self._closed = True
            raise
        parts = self._gateway._parts()
        self._timeout_s = (
            call_timeout_s
            if call_timeout_s is not None
            else parts.wait_timeout_s + parts.lease_ms / 1000 + _CALL_MARGIN_S
        )

    # ------------------------------------------------------------------ the loop

    def _run_loop(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            # As asyncio.run does: whatever is still running is cancelled, so that a
            # caller blocked on it gets an answer instead of its timeout.
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _stop_loop(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(self._loop.stop)
        except RuntimeError:  # closed meanwhile
            return
        self._thread.join(timeout=_OPEN_TIMEOUT_S)

    def _check(self) -> None:
        if os.getpid() != self._pid:
            raise DedupError(
                f"this SyncGateway was opened in process {self._pid}; a child after fork() "
                "cannot use it: open a new SyncGateway in the child"
            )
        if self._closed:
            raise DedupError("the SyncGateway is closed")

    def _call(self, coro: Coroutine[Any, Any, _T], timeout_s: float | None = None) -> _T:
        """Run ``coro`` on the loop and wait for it, at most ``timeout_s``."""
        try:
            self._check()
        except BaseException:
            coro.close()  # never awaited: no "coroutine was never awaited" warning
            raise
        if threading.current_thread() is self._thread:
            coro.close()
            raise DedupError("a SyncGateway cannot be called from its own loop thread")
        limit = self._timeout_s if timeout_s is None else timeout_s
        call = _Call(coro)
        future = self._submit(call.run())
        try:
            return future.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            self._abandon(call, future)
            raise WaitTimeout(f"the call did not finish within {limit} s") from None
        except concurrent.futures.CancelledError:
            raise DedupError("the SyncGateway was closed while this call was running") from None
        except BaseException:
            # The coroutine's own error (then this is a no-op on the loop), or the
            # caller's wait was interrupted (KeyboardInterrupt): give back what it won.
            self._abandon(call, future)
            raise

    def _abandon(self, call: _Call[Any], future: concurrent.futures.Future[Any]) -> None:
        """Stop a call the caller no longer waits for, giving back what it won."""
        # Queued before the cancellation (which future.cancel() also queues on the loop),
        # so the call is marked abandoned before it can be cancelled. A closed loop
        # (RuntimeError) runs nothing any more: nothing to give back there.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(call.abandon, self._loop)
        future.cancel()

    # ------------------------------------------------------------------ public API

    @property
    def gateway(self) -> Gateway:
        """The Gateway on the loop thread (for code that runs on that loop only)."""
        return self._gateway

    @property
    def degraded(self) -> bool:
        """True while Redis is skipped (see :attr:`Gateway.degraded`)."""
        return self._gateway.degraded

    def save(
        self, kind: str, value: str, payload: Any = None, *, timeout_s: float | None = None
    ) -> SaveResult:
        """Save ``value`` of ``kind`` once; blocks until its row is committed.

        As :meth:`Gateway.save`, plus :class:`~dedup.WaitTimeout` when the call
        takes longer than ``timeout_s`` (default: the SyncGateway's ``call_timeout_s``).
        """
        return self._call(self._gateway.save(kind, value, payload), timeout_s)

    def save_many(
        self, items: Iterable[Item], *, timeout_s: float | None = None
    ) -> list[SaveResult]:
        """Save a batch; one result per item, in order (as :meth:`Gateway.save_many`)."""
        if isinstance(items, Iterable) and not isinstance(items, str | bytes | dict | list | tuple):
            items = list(items)  # in the caller's thread: a generator must not run on the loop
        return self._call(self._gateway.save_many(items), timeout_s)

    def forget(self, kind: str, value: str, *, timeout_s: float | None = None) -> bool:
        """Forget ``value`` of ``kind`` everywhere; True if a row was deleted (as
        :meth:`Gateway.forget`, which takes about a second)."""
        return self._call(self._gateway.forget(kind, value), self._forget_bound(timeout_s))

    def forget_many(
        self, items: Iterable[tuple[str, str]], *, timeout_s: float | None = None
    ) -> list[bool]:
        """Forget many values at once; one bool per item (as :meth:`Gateway.forget_many`)."""
        if isinstance(items, Iterable) and not isinstance(items, str | bytes | dict | list | tuple):
            items = list(items)  # in the caller's thread: a generator must not run on the loop
        return self._call(self._gateway.forget_many(items), self._forget_bound(timeout_s))

    def prune(
        self,
        kind: str,
        older_than_s: float,
        *,
        batch_size: int = 1000,
        progress: Callable[[int, int], None] | None = None,
        timeout_s: float | None = None,
    ) -> int:
        """Forget the rows of ``kind`` older than ``older_than_s`` seconds (as
        :meth:`Gateway.prune`; ``progress`` is called on the loop thread). Unbounded in
        time unless ``timeout_s`` is given."""
        return self._call(
            self._gateway.prune(kind, older_than_s, batch_size=batch_size, progress=progress),
            threading.TIMEOUT_MAX if timeout_s is None else timeout_s,
        )

    def _forget_bound(self, timeout_s: float | None) -> float:
        """A forget waits about a second for every gateway by design: the call's bound is
        at least that plus the Gateway's own waits."""
        if timeout_s is not None:
            return timeout_s
        return max(self._timeout_s, self._gateway.options.wait_timeout_s + 5.0)

    def get(self, kind: str, value: str, *, timeout_s: float | None = None) -> Any:
        """The payload saved with ``value`` of ``kind``, or None (as :meth:`Gateway.get`)."""
        return self._call(self._gateway.get(kind, value), timeout_s)

    def stats(self) -> Stats:
        """A snapshot of the Gateway's counters."""
        return self._call(self._stats())

    async def _stats(self) -> Stats:
        return self._gateway.stats()

    def ping(self, timeout_s: float = 1.0) -> dict[str, bool]:
        """Whether Redis and the database answer right now (as :meth:`Gateway.ping`)."""
        return self._call(self._gateway.ping(timeout_s), timeout_s + _CALL_MARGIN_S)

    def once(
        self, kind: str, *, key: Callable[..., str] | None = None
    ) -> Callable[[Callable[_P, Any]], Callable[_P, Any]]:
        """Decorate a plain function so that it runs at most once per value of ``kind``
        across every process (the blocking form of :meth:`Gateway.once`).

        The function runs in the calling thread; the value's lease is claimed, renewed
        while the function runs, and committed on the loop thread. Its JSON return
        value is stored as the row's payload and every caller gets it (decoded from
        JSON). If the function raises, nothing is saved and the next call runs it
        again. Claiming and waiting are bounded by ``call_timeout_s``; the function's
        own run is not.
        """
        validate_kind(kind)
        if key is not None and not callable(key):
            raise InvalidInput(
                "key must be a callable mapping the arguments to the value", field="key"
            )

        def decorate(fn: Callable[_P, Any]) -> Callable[_P, Any]:
            if inspect.iscoroutinefunction(fn):
                raise InvalidInput(
                    "SyncGateway.once decorates a plain function (Gateway.once takes async ones)",
                    field="function",
                )

            @functools.wraps(fn)
            def run(*args: _P.args, **kwargs: _P.kwargs) -> Any:
                value = value_of(key, args, kwargs)
                claimed = self._call(begin(self._gateway, kind, value))
                if isinstance(claimed, Saved):
                    return claimed.payload
                try:
                    result = fn(*args, **kwargs)
                except BaseException:
                    self._call(claimed.fail())
                    raise
                return self._call(claimed.finish(result))

            return run

        return decorate

    def close(self, *, drain_timeout_s: float | None = None) -> None:
        """Close the Gateway and stop the loop thread; safe to call twice.

        In a child after ``fork()`` it only marks this object closed: the parent's
        Gateway is the parent's to close.
        """
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        if os.getpid() != self._pid:
            return
        try:
            self._submit(self._gateway.aclose(drain_timeout_s=drain_timeout_s)).result(
                timeout=self._timeout_s + _CALL_MARGIN_S
            )
        finally:
            self._stop_loop()

    def __enter__(self) -> SyncGateway:
        self._check()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
