"""Fixtures with real redis-server and PostgreSQL processes, and the "nothing hidden" rule.

Fixtures:

* ``redis_server`` (session): one :class:`RedisServer` for the whole run.
* ``redis_url`` (function): that server's URL, FLUSHALLed before the test.
* ``fresh_redis`` (function): a private redis-server per test (kill/pause/restart it freely).
* ``cluster_servers`` (function): a Redis Cluster (three primaries) shared by the session,
  emptied before each test; kill nothing in it.
* ``pg_cluster`` (session): one :class:`PostgresCluster` for the whole run.
* ``pg_empty_url`` (function): URL of a new, empty database, dropped after the test.
* ``pg_url`` (function): like ``pg_empty_url`` with ``dedup.store.migrate.upgrade(url)`` applied
  (a copy of a database migrated once per session).
* ``fresh_pg`` (function): a private PostgreSQL cluster per test (kill/restart it freely).
* ``spawn`` (function): gateway child processes (:class:`tests.test_processes.Child`).

With ``CI=true`` in the environment, a run in which any test was skipped, deselected,
xfailed or xpassed exits with status 1.

Several servers: ``DEDUP_TEST_REDIS_SERVER=/path/to/redis-server`` makes that binary the
``redis-server`` of the whole run (first on PATH, so fixtures, embedded servers and child
processes all start it); with ``-m redis6`` the deselected tests do not count as hidden.
``DEDUP_TEST_ALSO_ON=/path/a:/path/b`` runs each test marked ``redis6``
(:data:`REDIS6_FILES`, by file) once more on each of those binaries, in the same run: the
test gets a parameter named after the server (``[valkey-9.1.2]``; PATH's own server too,
``[redis-7.0.15]``) that puts the binary first
on PATH for that test alone. ``make test`` runs the suite on the system's Redis 7 and the
``redis6`` tests again on Redis 6.2 and Valkey 9.1 this way, in one run, so that the
parallel workers share all of the work.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import importlib
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from dedup._redis.embedded import server_name, server_version
from tests.servers import PostgresCluster, RedisClusterServers, RedisServer, find_redis_server
from tests.test_processes import Child

MIGRATE_TIMEOUT = 30.0
REDIS_SERVER_ENV = "DEDUP_TEST_REDIS_SERVER"
ALSO_ON_ENV = "DEDUP_TEST_ALSO_ON"
REDIS6_MARK = "redis6"
REDIS6_FILES = frozenset(
    {
        # The claim protocol, layouts, Bloom mode, the embedded server and `dedup check`.
        "test_claims.py",
        "test_layout.py",
        "test_bloom.py",
        "test_embedded.py",
        # Shared writes, the lock library and Redlock, Cluster and the fault tests.
        "test_shared.py",
        "test_lock.py",
        "test_redlock.py",
        "test_cluster.py",
        "test_cluster_failover.py",
        "test_faults.py",
        # The shared connection the save path and the lock send their scripts on.
        "test_mux.py",
    }
)
"""The test files that run again on Redis 6 (marked ``redis6`` at collection): the
Redis-facing features whose commands differ between versions. A test elsewhere can
carry the mark itself."""

_db_counter = itertools.count(1)


# ------------------------------------------------------------------------------- redis


@pytest.fixture(scope="session")
def _redis_servers() -> Iterator[dict[str, RedisServer]]:
    """The session's redis-servers, one per binary (the runs on other servers), stopped
    at the end."""
    servers: dict[str, RedisServer] = {}
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture
def redis_server(_redis_servers: dict[str, RedisServer], _server_binary: str) -> RedisServer:
    """One redis-server of this test's binary for the whole session (use ``fresh_redis``
    to kill or pause one)."""
    binary = find_redis_server()  # what PATH gives this test
    server = _redis_servers.get(binary)
    if server is None:
        server = _redis_servers[binary] = RedisServer(binary=binary).start()
    return server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the session redis-server, emptied (FLUSHALL) before the test."""
    if not redis_server.is_alive():  # a test killed it by mistake: keep the rest going
        redis_server.restart()
    client = redis.Redis.from_url(redis_server.url, socket_timeout=10, socket_connect_timeout=10)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


@pytest.fixture
def fresh_redis(_server_binary: str) -> Iterator[RedisServer]:
    """A private redis-server for this test only; stopped (SIGCONT, SIGTERM...) after it."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def _redis_clusters() -> Iterator[dict[str, RedisClusterServers]]:
    """The session's Redis Clusters, one per binary, stopped at the end."""
    clusters: dict[str, RedisClusterServers] = {}
    try:
        yield clusters
    finally:
        for cluster in clusters.values():
            cluster.stop()


@pytest.fixture
def cluster_servers(
    _redis_clusters: dict[str, RedisClusterServers], _server_binary: str
) -> RedisClusterServers:
    """A Redis Cluster of three primaries, no replicas, of this test's binary: one per
    session, emptied before each test (FLUSHALL and SCRIPT FLUSH on every node, as a new
    one would be). Tests that kill nodes or move slots start clusters of their own."""
    cluster = _redis_clusters.get(_server_binary)
    if cluster is not None and not (
        all(node.is_alive() for node in cluster.nodes) and cluster.cluster_ok()
    ):  # a test broke it by mistake: keep the rest going
        cluster.stop()
        cluster = None
    if cluster is None:
        cluster = RedisClusterServers(3, 0, node_timeout_ms=2000).start()
        _redis_clusters[_server_binary] = cluster
    for node in cluster.nodes:
        cluster.command(node, "FLUSHALL")
        cluster.command(node, "SCRIPT", "FLUSH")
    return cluster


# -------------------------------------------------------------------------- postgresql


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PostgresCluster]:
    """One PostgreSQL cluster for the whole session (use ``fresh_pg`` to kill one)."""
    with PostgresCluster() as cluster:
        yield cluster


@contextlib.contextmanager
def _database(pg_cluster: PostgresCluster, template: str | None = None) -> Iterator[str]:
    """A new database on the session cluster (a copy of ``template`` if given), dropped
    (WITH FORCE) after; its URL."""
    if not pg_cluster.is_alive():  # a test killed it by mistake: keep the rest going
        pg_cluster.restart()
    name = f"t_{next(_db_counter)}_{os.getpid()}"
    url = pg_cluster.create_database(name, template=template)
    try:
        yield url
    finally:
        if pg_cluster.is_alive():
            pg_cluster.drop_database(name)


def _migrate(url: str) -> None:
    """``dedup.store.migrate.upgrade(url)``, in a thread of its own: upgrade() may run its
    own event loop (asyncio.run), which must not disturb the test's loop."""
    # Imported here so that the fixtures work before/without dedup.store.migrate.
    module = importlib.import_module("dedup.store.migrate")
    upgrade = cast(Callable[[str], None], module.upgrade)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="migrate") as pool:
        pool.submit(upgrade, url).result(timeout=MIGRATE_TIMEOUT)


@pytest.fixture
def pg_empty_url(pg_cluster: PostgresCluster) -> Iterator[str]:
    """URL of a new empty database on the session cluster; dropped (WITH FORCE) after."""
    with _database(pg_cluster) as url:
        yield url


@pytest.fixture(scope="session")
def _migrated_template(pg_cluster: PostgresCluster) -> str:
    """A database of the session cluster with ``dedup.store.migrate.upgrade`` applied, once:
    each ``pg_url`` is a copy of it (CREATE DATABASE ... TEMPLATE), the same tables, rows
    and triggers as a migration of its own gives, without running one per test."""
    name = f"t_migrated_{os.getpid()}"
    _migrate(pg_cluster.create_database(name))  # its connections end with the migration
    return name


@pytest.fixture
def pg_url(pg_cluster: PostgresCluster, _migrated_template: str) -> Iterator[str]:
    """URL of a new database with the dedup schema (``dedup.store.migrate.upgrade``)
    applied: a copy of a database migrated once per session; dropped after the test."""
    with _database(pg_cluster, _migrated_template) as url:
        yield url


@pytest.fixture
def fresh_pg() -> Iterator[PostgresCluster]:
    """A private PostgreSQL cluster for this test only; stopped and removed after it."""
    with PostgresCluster() as cluster:
        yield cluster


# ------------------------------------------------------------------ gateway children


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    """Child processes a test starts (append them): each is SIGCONTed (a stopped process
    cannot die), SIGKILLed if still running, reaped and its pipes closed at the end."""
    procs: list[subprocess.Popen[str]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait(timeout=30)
            for stream in (p.stdin, p.stdout):
                if stream is not None:
                    stream.close()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[[dict[str, Any]], Child]]:
    """``spawn(job) -> Child`` (``python -m tests.child``); after the test every child
    is SIGCONTed (a test may have stopped it), SIGKILLed by its PID and reaped."""
    children: list[Child] = []

    def start(job: dict[str, Any]) -> Child:
        child = Child(job, tmp_path / f"child-{len(children)}")
        children.append(child)
        return child

    try:
        yield start
    finally:
        for child in children:
            child.kill()


# ------------------------------------------------------------------- redis versions


def _use_redis_server(config: pytest.Config) -> None:
    """With ``DEDUP_TEST_REDIS_SERVER`` set, put that binary first on PATH as
    ``redis-server`` (a folder of its own holding a link to it) for this run and every
    process it starts; refuse a path that is no runnable redis-server."""
    binary = os.environ.get(REDIS_SERVER_ENV, "")
    if binary:
        folder = _linked(config, REDIS_SERVER_ENV, binary)
        os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")


@dataclass(frozen=True)
class _Server:
    """A redis-server binary that the ``redis6`` tests run on again: its folder holds it
    as ``redis-server``, to put first on PATH."""

    label: str
    folder: str


_servers_key = pytest.StashKey[list[_Server]]()


def _other_servers(config: pytest.Config) -> list[_Server]:
    """The binaries of ``DEDUP_TEST_ALSO_ON``, each linked as ``redis-server`` in a folder
    of its own."""
    if _servers_key not in config.stash:
        config.stash[_servers_key] = [
            _Server(_label(binary), _linked(config, ALSO_ON_ENV, binary))
            for binary in filter(None, os.environ.get(ALSO_ON_ENV, "").split(os.pathsep))
        ]
    return config.stash[_servers_key]


def _label(binary: str) -> str:
    """``redis-7.0.15``, ``valkey-9.1.2``: a binary's name in test ids."""
    return f"{server_name(binary).lower()}-{'.'.join(map(str, server_version(binary)))}"


def _linked(config: pytest.Config, env: str, binary: str) -> str:
    """A folder of its own holding ``binary`` as ``redis-server`` (removed at the end of
    the run); refuse a path that is no runnable redis-server."""
    path = os.path.abspath(binary)
    if not os.access(path, os.X_OK) or server_version(path) == (0, 0, 0):
        raise pytest.UsageError(f"{env}={binary}: not a runnable redis-server")
    folder = tempfile.mkdtemp(prefix="dedup-redis-bin-")
    os.symlink(path, os.path.join(folder, "redis-server"))
    config.add_cleanup(functools.partial(shutil.rmtree, folder, ignore_errors=True))
    return folder


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    definition = metafunc.definition
    if (
        definition.path.name not in REDIS6_FILES
        and definition.get_closest_marker(REDIS6_MARK) is None
    ):
        return
    others = _other_servers(metafunc.config)
    if others:  # the first: PATH's own redis-server, as for every other test
        params = [None, *others]
        ids = [_label(find_redis_server()), *(server.label for server in others)]
        metafunc.parametrize("_server_binary", params, indirect=True, ids=ids)


@pytest.fixture(autouse=True)
def _server_binary(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The redis-server this test runs on: PATH's, or for a ``redis6`` test's run on another
    server (``DEDUP_TEST_ALSO_ON``) that one, first on PATH for the test and every process
    it starts. Autouse, so it comes before the fixtures that start servers."""
    server = cast(_Server | None, getattr(request, "param", None))
    if server is not None:
        monkeypatch.setenv("PATH", server.folder + os.pathsep + os.environ.get("PATH", ""))
    return find_redis_server()


def _second_pass(config: pytest.Config) -> bool:
    """True for the pass that runs the ``redis6`` tests on another redis-server."""
    return bool(os.environ.get(REDIS_SERVER_ENV)) and config.option.markexpr == REDIS6_MARK


def pytest_report_header(config: pytest.Config) -> str:
    found = shutil.which("redis-server")
    if found is None:
        return "redis-server: none on PATH"
    version = ".".join(map(str, server_version(found)))
    chosen = os.environ.get(REDIS_SERVER_ENV)
    others = ", ".join(server.label for server in _other_servers(config))
    return (
        f"redis-server: {found} (version {version})"
        + (f", {REDIS_SERVER_ENV}={chosen}" if chosen else "")
        + (f"; the redis6 tests also on {others}" if others else "")
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in REDIS6_FILES:
            item.add_marker(REDIS6_MARK)


# ---------------------------------------------------------------- nothing hidden in CI


@dataclass
class _Hidden:
    skipped: int = 0
    deselected: int = 0
    xfailed: int = 0
    xpassed: int = 0

    def total(self) -> int:
        return self.skipped + self.deselected + self.xfailed + self.xpassed

    def describe(self) -> str:
        parts = [
            f"{count} {what}"
            for what, count in (
                ("skipped", self.skipped),
                ("deselected", self.deselected),
                ("xfailed", self.xfailed),
                ("xpassed", self.xpassed),
            )
            if count
        ]
        return ", ".join(parts)


_hidden_key = pytest.StashKey[_Hidden]()
_message_key = pytest.StashKey[str]()


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def _hidden(config: pytest.Config) -> _Hidden:
    return config.stash.setdefault(_hidden_key, _Hidden())


def pytest_deselected(items: list[pytest.Item]) -> None:
    if items and not _second_pass(items[0].config):
        _hidden(items[0].config).deselected += len(items)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Reports carry no config; the counting lives on the module-level session config.
    config = _current_config
    if config is None:
        return
    hidden = _hidden(config)
    if report.skipped:
        if hasattr(report, "wasxfail"):
            hidden.xfailed += 1
        else:
            hidden.skipped += 1
    elif report.passed and report.when == "call" and hasattr(report, "wasxfail"):
        hidden.xpassed += 1


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped and _current_config is not None:  # e.g. a module-level skip
        _hidden(_current_config).skipped += 1


_current_config: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _current_config
    _current_config = config
    _private_tmp(config)
    _use_redis_server(config)


def _private_tmp(config: pytest.Config) -> None:
    """Every temporary file of the run (pytest's own folders, the servers' data, the
    services' metrics folders, in this process and in every process it starts) goes in
    one folder, removed at the end: a run leaves nothing in /tmp, not even what a process
    that a test SIGKILLs would have removed itself."""
    if hasattr(config, "workerinput"):
        return  # a pytest-xdist worker: the controller's folder, inherited through TMPDIR
    folder = tempfile.mkdtemp(prefix="dedup-tests-")
    # PostgreSQL runs as another user (postgres, when root) and keeps its data in here.
    os.chmod(folder, 0o755)
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = folder
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


def pytest_unconfigure(config: pytest.Config) -> None:
    global _current_config
    if _current_config is config:
        _current_config = None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _in_ci():
        return
    hidden = _hidden(session.config)
    # The terminal reporter's own counts, in case a plugin bypassed the hooks above.
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        stats = cast(pytest.TerminalReporter, reporter).stats
        if not _second_pass(session.config):
            hidden.deselected = max(hidden.deselected, len(stats.get("deselected", [])))
        hidden.xfailed = max(hidden.xfailed, len(stats.get("xfailed", [])))
        hidden.xpassed = max(hidden.xpassed, len(stats.get("xpassed", [])))
        skipped = len(stats.get("skipped", []))
        hidden.skipped = max(hidden.skipped, skipped)
    if hidden.total() == 0:
        return
    message = (
        f"CI=true and this run hid tests ({hidden.describe()}): nothing may be skipped, "
        "deselected or xfailed in CI, so the run fails."
    )
    session.config.stash[_message_key] = message
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    message = terminalreporter.config.stash.get(_message_key, None)
    if message:
        terminalreporter.section("nothing hidden", sep="=", red=True, bold=True)
        terminalreporter.write_line(f"FAILED: {message}", red=True, bold=True)
