"""The processes of ``dedup serve``: one worker in this process, or a supervisor of many.

With ``workers == 1`` the service runs in the calling process. With more, a
supervisor spawns that many workers, each binding the same port with
``SO_REUSEPORT`` (the kernel spreads connections over them), restarts one that
crashes, and forwards SIGTERM/SIGINT to them.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

from dedup.errors import ConfigError, DedupError
from dedup.gateway import Gateway
from dedup.loop import run as run_loop
from dedup.options import GatewayOptions
from dedup.service import serve, setup_logging
from dedup.settings import ServiceSettings

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
) -> None:
    """Entry point of one spawned worker: serve until signalled, exit 0 (2 on a startup error)."""
    setup_logging(settings.log_level)

    def on_ready(port: int) -> None:
        ready.send(port)
        ready.close()

    try:
        run_loop(serve(Gateway(**gateway_kwargs), settings, reuse_port=True, on_ready=on_ready))
    except DedupError as exc:
        print(f"dedup: worker {index}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:  # a Ctrl-C before the signal handlers were installed
        sys.exit(130)


# Exit statuses of a worker that was told to stop (a signal before its handlers were set
# kills it, a Ctrl-C during its imports exits 130): all clean.
_STOPPED = (0, -signal.SIGTERM, -signal.SIGINT, 130)


class Supervisor:
    """Spawns the workers, restarts one that crashes, forwards SIGTERM/SIGINT, reaps them."""

    MAX_RESTARTS = 5
    RESTART_WINDOW_S = 60.0
    START_TIMEOUT_S = 120.0

    def __init__(self, settings: ServiceSettings, gateway_kwargs: dict[str, Any]) -> None:
        self._settings = settings
        self._kwargs = gateway_kwargs
        # spawn, not fork: a worker starts clean (no inherited locks, threads or loop).
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: dict[int, Any] = {}
        self._ready: dict[int, multiprocessing.connection.Connection] = {}
        self._stopping = False
        self._restarts: list[float] = []

    def _start(self, index: int) -> None:
        reader, writer = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(
            target=_worker_main,
            args=(index, self._settings, self._kwargs, writer),
            name=f"dedup-worker-{index}",
        )
        proc.start()
        writer.close()  # the child holds its copy; EOF on ours then means it died
        self._workers[index] = proc
        self._ready[index] = reader

    def _signal(self, signum: int, _frame: object) -> None:
        self._stopping = True
        for proc in self._workers.values():
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)

    def run(self) -> int:
        signals = (signal.SIGTERM, signal.SIGINT)
        previous = {sig: signal.signal(sig, self._signal) for sig in signals}
        try:
            for index in range(self._settings.workers):
                self._start(index)
            status = self._wait_ready()
            if status == 0:
                log.info(
                    "%d workers serving on http://%s:%d (supervisor pid %d)",
                    self._settings.workers,
                    self._settings.host,
                    self._settings.port,
                    os.getpid(),
                )
                status = self._supervise()
            return self._stop_all(status)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for reader in self._ready.values():
                reader.close()

    def _wait_ready(self) -> int:
        """0 once every worker listens; a failed worker's status otherwise."""
        pending = dict(self._ready)
        deadline = time.monotonic() + self.START_TIMEOUT_S
        while pending and not self._stopping:
            if time.monotonic() > deadline:
                log.error("workers did not start within %.0f s", self.START_TIMEOUT_S)
                return 1
            readable = multiprocessing.connection.wait(list(pending.values()), timeout=0.5)
            for index, conn in list(pending.items()):
                if conn not in readable:
                    continue
                try:
                    conn.recv()
                except EOFError:  # the worker exited before listening
                    if self._stopping:
                        break  # we told it to
                    proc = self._workers[index]
                    proc.join(timeout=10)
                    return proc.exitcode or 1
                del pending[index]
        return 0

    def _supervise(self) -> int:
        while not self._stopping:
            ended = multiprocessing.connection.wait(
                [proc.sentinel for proc in self._workers.values()], timeout=0.5
            )
            for index, proc in list(self._workers.items()):
                if self._stopping:
                    break
                if proc.sentinel not in ended:
                    continue
                proc.join(timeout=1)
                log.error("worker %d (pid %s) exited with %s", index, proc.pid, proc.exitcode)
                now = time.monotonic()
                self._restarts = [t for t in self._restarts if now - t < self.RESTART_WINDOW_S]
                if len(self._restarts) >= self.MAX_RESTARTS:
                    log.error("%d restarts within %.0f s: giving up", len(self._restarts),
                              self.RESTART_WINDOW_S)  # fmt: skip
                    return 1
                self._restarts.append(now)
                self._ready[index].close()
                self._start(index)
        return 0

    def _stop_all(self, status: int) -> int:
        self._signal(signal.SIGTERM, None)
        # Each worker bounds its own drain; the margin covers closing its connections.
        deadline = time.monotonic() + self._settings.drain_timeout_s + 15
        for proc in self._workers.values():
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                log.error("worker pid %s did not stop in time: killing it", proc.pid)
                proc.kill()
                proc.join(timeout=10)
                status = status or 1
            elif proc.exitcode not in _STOPPED:
                status = status or proc.exitcode or 1
        return status
