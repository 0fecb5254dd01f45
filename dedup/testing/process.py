"""The processes of the throwaway servers (:mod:`dedup.testing.servers`): how they are
started, waited for, signalled with their children (by recorded PID, never by name,
found through /proc) and stopped at interpreter exit if a run ends abnormally."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from dedup._redis.embedded import is_running

__all__ = [
    "COMMAND_TIMEOUT",
    "HOST",
    "KILL_TIMEOUT",
    "START_TIMEOUT",
    "STOP_TIMEOUT",
    "ServerError",
    "free_port",
]

HOST = "127.0.0.1"
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
KILL_TIMEOUT = 10.0
COMMAND_TIMEOUT = 30.0
_LOG_TAIL_CHARS = 4000


class ServerError(RuntimeError):
    """A test server could not be found, started or controlled."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _log_tail(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    if len(text) > _LOG_TAIL_CHARS:
        text = "...\n" + text[-_LOG_TAIL_CHARS:]
    return text


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent PID) of a process from /proc, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Format: pid (comm) state ppid ...; comm may contain spaces and parentheses.
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[0], int(fields[1])


def _descendants(pid: int) -> list[int]:
    """PIDs of all live descendants of ``pid`` (Linux /proc; none elsewhere).

    PostgreSQL backends call setsid(), so they are not in the postmaster's process
    group: they have to be found by parent PID.
    """
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        stat = _proc_stat(int(entry.name))
        if stat is not None and stat[0] not in ("Z", "X"):
            children.setdefault(stat[1], []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _send(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _signal_tree(pid: int, sig: signal.Signals) -> list[int]:
    """Send ``sig`` to process ``pid`` and all its descendants; return the PIDs signalled.

    For SIGSTOP and SIGKILL the root is stopped first, so that it cannot fork a
    new child between listing its children and signalling them.
    """
    if sig in (signal.SIGSTOP, signal.SIGKILL):
        _send(pid, signal.SIGSTOP)
    targets = [pid, *_descendants(pid)]
    for target in targets:
        _send(target, sig)
    return targets


def _wait_gone(pids: Sequence[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if is_running(pid)]
        if not alive:
            return
        if time.monotonic() > deadline:
            raise ServerError(f"processes still alive {timeout}s after SIGKILL: {alive}")
        time.sleep(0.02)


class _Managed:
    """Common process bookkeeping: PID, signals, atexit cleanup, context manager."""

    _name = "server"

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._atexit_registered = False
        self._closed = False

    # -- to be provided by subclasses -------------------------------------------
    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def log_text(self) -> str:
        raise NotImplementedError

    # -- common -------------------------------------------------------------------
    @property
    def pid(self) -> int:
        """PID of the running (or last started) server process."""
        if self._proc is None:
            raise ServerError(f"{self._name} was never started")
        return self._proc.pid

    def is_alive(self) -> bool:
        """True while the server process exists (a paused one counts as alive)."""
        return self._proc is not None and self._proc.poll() is None

    def pause(self) -> None:
        """SIGSTOP the server (and its child processes): it stops answering."""
        self._require_alive()
        _signal_tree(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the server (and its child processes)."""
        self._require_alive()
        _signal_tree(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the server and its child processes and wait until they are gone."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        targets = _signal_tree(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=KILL_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            raise ServerError(f"{self._name} pid {proc.pid} survived SIGKILL") from exc
        # Its children (PostgreSQL backends) too: their shared memory must be released
        # before a restart can reuse the data folder.
        _wait_gone(targets[1:], KILL_TIMEOUT)

    def _require_alive(self) -> None:
        if not self.is_alive():
            raise ServerError(f"{self._name} is not running\n{self.log_text()}")

    def _terminate(self, sig: signal.Signals) -> None:
        """SIGCONT, then ``sig``, wait up to STOP_TIMEOUT, then SIGKILL."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        _signal_tree(proc.pid, signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_TIMEOUT)
        self.kill()

    def _register_atexit(self) -> None:
        if not self._atexit_registered:
            atexit.register(self._atexit_stop)
            self._atexit_registered = True

    def _unregister_atexit(self) -> None:
        if self._atexit_registered:
            atexit.unregister(self._atexit_stop)
            self._atexit_registered = False

    def _atexit_stop(self) -> None:
        try:
            self.stop()
        except Exception as exc:  # best effort at interpreter exit
            print(f"tests.servers: stopping {self._name} at exit failed: {exc}", file=sys.stderr)

    def __enter__(self) -> Self:
        if not self.is_alive():
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
