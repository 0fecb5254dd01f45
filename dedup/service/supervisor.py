"""The processes of ``dedup serve``: one worker in this process, or a supervisor of many.

With ``workers == 1`` the service runs in the calling process. With more, a
supervisor spawns that many workers, each binding the same port with
``SO_REUSEPORT`` (the kernel spreads connections over them), and keeps them serving:

- a worker that exits is replaced after a delay that doubles per consecutive
  failure (0.5 s to 30 s, jittered), while the others go on serving;
- each worker's event loop beats every second into shared memory; one silent for
  ``worker_timeout_s`` (hung, or stopped) is killed and replaced;
- workers end with the supervisor: Linux's parent-death signal (``prctl``), and a
  parent check on every beat elsewhere;
- SIGTERM/SIGINT are forwarded, and every worker drains (see :func:`dedup.service.serve`).

Kept rather than gunicorn's arbiter: gunicorn halts the whole server when a worker
fails to boot (``HaltServer``, exit 3), which would stop healthy workers because
another cannot start; the rest (spawned workers, backoff, shared metrics folder) is
about as much code either way.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

from prometheus_client.multiprocess import mark_process_dead

from dedup.errors import ConfigError, DedupError
from dedup.gateway import Gateway
from dedup.loop import run as run_loop
from dedup.options import GatewayOptions
from dedup.service import serve, setup_logging
from dedup.service.metrics import MULTIPROC_ENV
from dedup.service.settings import ServiceSettings

__all__ = ["Supervisor", "run"]

log = logging.getLogger("dedup.service")


def run(settings: ServiceSettings, gateway_kwargs: Mapping[str, Any]) -> int:
    """Run the service until SIGTERM/SIGINT; returns the exit status.

    One worker runs here; more are spawned and supervised. A configuration or
    connection problem at startup raises :class:`DedupError` (one worker) or
    ends the run with the failing worker's status (several).
    """
    embedded = not gateway_kwargs.get("redis_url") or not (
        gateway_kwargs.get("database_url") or gateway_kwargs.get("sink")
    )
    if settings.workers > 1 and embedded:
        raise ConfigError(
            "workers > 1 needs redis_url and database_url (DEDUP_REDIS_URL, DEDUP_DATABASE_URL): "
            "the embedded default belongs to one process"
        )
    if settings.workers == 1:
        gateway = Gateway(**gateway_kwargs)  # checks the options before anything starts
        run_loop(serve(gateway, settings))
        return 0
    GatewayOptions(**gateway_kwargs)  # the same early check, before any worker is spawned
    return Supervisor(settings, dict(gateway_kwargs)).run()


def _worker_main(
    index: int,
    settings: ServiceSettings,
    gateway_kwargs: dict[str, Any],
    ready: multiprocessing.connection.Connection,
    beat: Any,
    parent_pid: int,
) -> None:
    """Entry point of one spawned worker: serve until signalled, exit 0 (2 on a startup error).

    ``beat`` (a shared double) gets the monotonic time every second from the event
    loop; ``parent_pid`` is the supervisor, whose death ends this worker.
    """
    setup_logging(settings.log_level, settings.log_format)
    _die_with_parent(parent_pid)
    orphaned = False

    def on_ready(port: int) -> None:
        ready.send(port)
        ready.close()

    def heartbeat() -> None:
        nonlocal orphaned
        beat.value = time.monotonic()
        # The fallback of the parent-death signal (not Linux, or a lost race): a worker
        # re-parented to init drains and exits instead of serving as an orphan.
        if not orphaned and os.getppid() != parent_pid:
            orphaned = True
            log.error("supervisor pid %d is gone: worker %d stops", parent_pid, index)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        gateway = Gateway(**gateway_kwargs)
        run_loop(serve(gateway, settings, reuse_port=True, on_ready=on_ready, heartbeat=heartbeat))
    except DedupError as exc:
        log.error("worker %d cannot serve: %s", index, exc)
        sys.exit(2)
    except KeyboardInterrupt:  # a Ctrl-C before the signal handlers were installed
        sys.exit(130)
    except Exception:
        log.exception("worker %d failed", index)
        sys.exit(1)


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to send SIGTERM (a graceful drain) to this process when its parent
    dies; exit at once if that already happened. Elsewhere the heartbeat's parent
    check stands in."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
                log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        except (OSError, AttributeError) as exc:
            log.warning("prctl(PR_SET_PDEATHSIG) is not available: %s", exc)
    if os.getppid() != parent_pid:  # the supervisor died before the request above
        sys.exit(0)


# Exit statuses of a worker that was told to stop (a signal before its handlers were set
# kills it, a Ctrl-C during its imports exits 130): all clean.
_STOPPED = (0, -signal.SIGTERM, -signal.SIGINT, 130)


@dataclass(eq=False)
class _Slot:
    """One worker position: the process filling it now (if any) and its history."""

    index: int
    proc: BaseProcess | None = None
    conn: multiprocessing.connection.Connection | None = None
    beat: Any = None
    started_at: float = 0.0
    ready_at: float | None = None
    failures: int = 0  # consecutive: starts that failed, or crashes soon after starting
    start_failures: int = 0
    last_status: int = 1
    restart_at: float | None = None
    killed_for: str | None = None


class Supervisor:
    """Spawns the workers and keeps them serving: replaces one that exits or stops
    beating, with backoff, forwards SIGTERM/SIGINT, reaps them.

    A worker that cannot start is retried after a growing, jittered delay while the
    others go on serving; the run gives up only when no worker ever served and every
    one of them failed to start (a configuration or connection error: exit status 2).
    Each run gets a fresh ``PROMETHEUS_MULTIPROC_DIR`` (removed at exit), shared by its
    workers so that any of them answers ``/metrics`` for the whole service.
    """

    START_TIMEOUT_S = 120.0
    """Longest a worker may take from spawn to listening."""
    BACKOFF_BASE_S = 0.5
    """First restart delay; doubled per consecutive failure of the same worker."""
    BACKOFF_MAX_S = 30.0
    """Longest restart delay (before jitter)."""
    STABLE_S = 10.0
    """A worker that served this long before exiting starts its failure count afresh."""
    TICK_S = 0.5

    def __init__(self, settings: ServiceSettings, gateway_kwargs: dict[str, Any]) -> None:
        self._settings = settings
        self._kwargs = gateway_kwargs
        # spawn, not fork: a worker starts clean (no inherited locks, threads or loop).
        self._ctx = multiprocessing.get_context("spawn")
        self._slots = [_Slot(index) for index in range(settings.workers)]
        self._stopping = False
        self._served = False
        self._metrics_dir = ""

    # ------------------------------------------------------------------ workers
    def _start(self, slot: _Slot) -> None:
        reader, writer = self._ctx.Pipe(duplex=False)
        beat = self._ctx.RawValue("d", time.monotonic())
        proc = self._ctx.Process(
            target=_worker_main,
            args=(slot.index, self._settings, self._kwargs, writer, beat, os.getpid()),
            name=f"dedup-worker-{slot.index}",
        )
        proc.start()
        writer.close()  # the child holds its copy; EOF on ours then means it died
        slot.proc, slot.conn, slot.beat = proc, reader, beat
        slot.started_at = time.monotonic()
        slot.ready_at = slot.restart_at = slot.killed_for = None

    def _kill(self, slot: _Slot, why: str) -> None:
        assert slot.proc is not None and slot.proc.pid is not None
        log.error("worker %d (pid %d) %s: killing it", slot.index, slot.proc.pid, why)
        slot.killed_for = why
        with contextlib.suppress(ProcessLookupError):
            os.kill(slot.proc.pid, signal.SIGKILL)  # also ends a stopped (SIGSTOP) process

    def _exited(self, slot: _Slot, now: float) -> None:
        """Reap the worker of ``slot`` and schedule its replacement."""
        proc = slot.proc
        assert proc is not None
        proc.join(timeout=1)
        status = proc.exitcode if proc.exitcode is not None else 1
        log.error("worker %d (pid %s) exited with %s", slot.index, proc.pid, status)
        if proc.pid is not None:
            # Its counters stay in the totals; its live gauges (pending, degraded) go.
            mark_process_dead(proc.pid, self._metrics_dir)  # type: ignore[no-untyped-call]
        if slot.conn is not None:
            slot.conn.close()
        slot.proc = slot.conn = None
        if slot.ready_at is None:
            slot.failures += 1
            slot.start_failures += 1
            slot.last_status = status or 1
        elif now - slot.ready_at >= self.STABLE_S:
            slot.failures = 1
        else:
            slot.failures += 1
        delay = min(self.BACKOFF_MAX_S, self.BACKOFF_BASE_S * 2 ** (slot.failures - 1))
        delay *= random.uniform(0.5, 1.5)  # workers failing together do not retry together
        slot.restart_at = now + delay
        if not self._given_up():
            log.warning(
                "worker %d: restarting in %.1f s (consecutive failures: %d)",
                slot.index,
                delay,
                slot.failures,
            )

    def _given_up(self) -> bool:
        """True when no worker ever served and every one failed to start: a problem
        of the configuration or the servers that retrying here would only hide."""
        return not self._served and all(s.start_failures > 0 for s in self._slots)

    def _signal(self, signum: int, _frame: object) -> None:
        self._stopping = True
        for slot in self._slots:
            if slot.proc is not None and slot.proc.pid is not None and slot.proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.proc.pid, signal.SIGTERM)
                    os.kill(slot.proc.pid, signal.SIGCONT)  # a stopped worker must see it

    # --------------------------------------------------------------------- run
    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (0), or until no worker can start (its status)."""
        signals = (signal.SIGTERM, signal.SIGINT)
        previous = {sig: signal.signal(sig, self._signal) for sig in signals}
        previous_dir = os.environ.get(MULTIPROC_ENV)
        self._metrics_dir = tempfile.mkdtemp(prefix="dedup-metrics-")
        # Read by prometheus_client when a spawned worker imports it.
        os.environ[MULTIPROC_ENV] = self._metrics_dir
        try:
            try:
                for slot in self._slots:
                    self._start(slot)
                status = self._supervise()
            except BaseException:
                # A failure here (no file descriptor left to start a worker, say) must
                # still stop the workers: left serving, they would keep this process
                # waiting for them at exit, with their metrics folder gone.
                log.exception("the supervisor failed: stopping the workers")
                self._stop_all(1)
                raise
            return self._stop_all(status)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for slot in self._slots:
                if slot.conn is not None:
                    slot.conn.close()
            if previous_dir is None:
                os.environ.pop(MULTIPROC_ENV, None)
            else:
                os.environ[MULTIPROC_ENV] = previous_dir
            shutil.rmtree(self._metrics_dir, ignore_errors=True)

    def _supervise(self) -> int:
        announced = False
        timeout_s = self._settings.worker_timeout_s
        while not self._stopping:
            now = time.monotonic()
            pending = [s.restart_at - now for s in self._slots if s.restart_at is not None]
            wait_s = max(0.0, min([self.TICK_S, *pending]))
            waitables: list[Any] = []
            for slot in self._slots:
                if slot.proc is not None:
                    waitables.append(slot.proc.sentinel)
                    if slot.ready_at is None and slot.conn is not None:
                        waitables.append(slot.conn)
            if waitables:
                ended = multiprocessing.connection.wait(waitables, timeout=wait_s)
            else:
                time.sleep(wait_s)
                ended = []
            now = time.monotonic()
            for slot in self._slots:
                if self._stopping:
                    break
                proc = slot.proc
                if proc is None:
                    if slot.restart_at is not None and slot.restart_at <= now:
                        self._start(slot)
                    continue
                if slot.conn is not None and slot.conn in ended and slot.ready_at is None:
                    try:
                        slot.conn.recv()
                    except EOFError:  # it exited before listening: its sentinel says so
                        pass
                    else:
                        slot.ready_at = now
                        self._served = True
                        if announced:
                            log.info("worker %d (pid %s) is serving", slot.index, proc.pid)
                if proc.sentinel in ended or not proc.is_alive():
                    self._exited(slot, now)
                    if self._given_up():
                        log.error("no worker could start: stopping")
                        return slot.last_status
                elif slot.killed_for is not None:
                    continue  # killed; its exit is seen on a later round
                elif slot.ready_at is None and now - slot.started_at > self.START_TIMEOUT_S:
                    self._kill(slot, f"did not start within {self.START_TIMEOUT_S:.0f} s")
                elif slot.ready_at is not None and now - slot.beat.value > timeout_s:
                    silent = now - slot.beat.value
                    self._kill(slot, f"sent no heartbeat for {silent:.1f} s (hung or stopped)")
            if not announced and all(s.ready_at is not None for s in self._slots):
                announced = True
                log.info(
                    "%d workers serving on http://%s:%d (supervisor pid %d)",
                    self._settings.workers,
                    self._settings.host,
                    self._settings.port,
                    os.getpid(),
                )
        return 0

    def _stop_all(self, status: int) -> int:
        self._signal(signal.SIGTERM, None)
        # Each worker bounds its own drain; the margin covers closing its connections.
        deadline = time.monotonic() + self._settings.drain_timeout_s + 15
        for slot in self._slots:
            proc = slot.proc
            if proc is None:
                continue
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                log.error("worker pid %s did not stop in time: killing it", proc.pid)
                proc.kill()
                proc.join(timeout=10)
                status = status or 1
            elif proc.exitcode not in _STOPPED and slot.killed_for is None:
                status = status or proc.exitcode or 1
        return status
