"""Tests of dedup.store.migrate: the packaged Alembic migrations on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import importlib.resources
import importlib.util
import shutil
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path

import asyncpg
import pytest
from alembic import command

from dedup.store import migrate
from dedup.store.migrate import current, to_sqlalchemy_url, upgrade, upgrade_async

HEAD = "0002"
PROJECT_ROOT = Path(__file__).resolve().parent.parent
WHEEL_FILES = (
    "dedup/store/migrations/env.py",
    "dedup/store/migrations/script.py.mako",
    "dedup/store/migrations/versions/0001_create_dedup_items.py",
    "dedup/store/migrations/versions/0002_tombstones.py",
)


def _sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}"


def _sqlite_rows(path: Path, sql: str) -> list[tuple[object, ...]]:
    # closing(): sqlite3's context manager only ends the transaction; an unclosed
    # connection is a ResourceWarning, which this suite turns into an error.
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return conn.execute(sql).fetchall()


# --- to_sqlalchemy_url -------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgresql://u:p@h:5432/db", "postgresql+asyncpg://u:p@h:5432/db"),
        ("postgres://u@h/db", "postgresql+asyncpg://u@h/db"),
        (
            "postgresql://u@h/db?sslmode=require&application_name=x",
            "postgresql+asyncpg://u@h/db?sslmode=require&application_name=x",
        ),
        ("postgresql://u:p%40ss@h/db", "postgresql+asyncpg://u:p%40ss@h/db"),
        ("postgresql+asyncpg://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("postgres+asyncpg://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("sqlite:///data/dedup.db", "sqlite+aiosqlite:///data/dedup.db"),
        ("sqlite:////abs/dedup.db?timeout=5", "sqlite+aiosqlite:////abs/dedup.db?timeout=5"),
        ("sqlite://", "sqlite+aiosqlite://"),
        ("sqlite+aiosqlite:///x.db", "sqlite+aiosqlite:///x.db"),
        ("PostgreSQL://u@h/db", "postgresql+asyncpg://u@h/db"),
    ],
)
def test_to_sqlalchemy_url(given: str, expected: str) -> None:
    assert to_sqlalchemy_url(given) == expected


@pytest.mark.parametrize(
    "bad",
    ["mysql://u@h/db", "redis://localhost:6379/0", "postgresql", "/tmp/x.db", "", "sqlite+://x"],
)
def test_to_sqlalchemy_url_rejects_other_schemes(bad: str) -> None:
    with pytest.raises(ValueError, match="unsupported database URL scheme"):
        to_sqlalchemy_url(bad)


# --- SQLite ------------------------------------------------------------------


def test_sqlite_upgrade_creates_table(tmp_path: Path) -> None:
    # A directory that does not exist yet: upgrade() must create it.
    db = tmp_path / "nested" / "dir" / "dedup.db"
    url = _sqlite_url(db)

    upgrade(url)

    assert db.is_file()
    columns = {
        row[1]: row for row in _sqlite_rows(db, "PRAGMA table_info(dedup_items)")
    }  # row: (cid, name, type, notnull, dflt_value, pk)
    assert set(columns) == {"kind", "digest", "value", "payload", "created_at"}
    assert columns["kind"][2:4] == ("TEXT", 1)
    assert columns["digest"][2:4] == ("BLOB", 1)
    assert columns["value"][2:4] == ("TEXT", 1)
    assert columns["payload"][2:4] == ("JSON", 0)
    assert columns["created_at"][2:4] == ("DATETIME", 1)
    assert str(columns["created_at"][4]).upper() == "CURRENT_TIMESTAMP"
    primary_key = sorted((row[5], name) for name, row in columns.items() if row[5])
    assert [name for _, name in primary_key] == ["kind", "digest"]

    assert current(url) == HEAD


def test_sqlite_second_upgrade_is_noop(tmp_path: Path) -> None:
    db = tmp_path / "dedup.db"
    url = _sqlite_url(db)
    upgrade(url)
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("INSERT INTO dedup_items (kind, digest, value) VALUES ('k', x'01', 'v')")

    upgrade(url)

    assert _sqlite_rows(db, "SELECT version_num FROM alembic_version") == [(HEAD,)]
    assert _sqlite_rows(db, "SELECT kind, value FROM dedup_items") == [("k", "v")]
    assert current(url) == HEAD


def test_sqlite_primary_key_and_default(tmp_path: Path) -> None:
    db = tmp_path / "dedup.db"
    upgrade(_sqlite_url(db))
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        insert = "INSERT INTO dedup_items (kind, digest, value) VALUES (?, ?, ?)"
        conn.execute(insert, ("k", b"\x01", "v"))
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute(insert, ("k", b"\x01", "other"))
        conn.execute(insert, ("other-kind", b"\x01", "v"))
    rows = _sqlite_rows(db, "SELECT kind, created_at FROM dedup_items ORDER BY kind")
    assert [kind for kind, _ in rows] == ["k", "other-kind"]
    assert all(created_at for _, created_at in rows)


def test_current_is_none_before_upgrade(tmp_path: Path) -> None:
    assert current(_sqlite_url(tmp_path / "fresh.db")) is None


def test_sqlite_downgrade_drops_table(tmp_path: Path) -> None:
    db = tmp_path / "dedup.db"
    url = _sqlite_url(db)
    upgrade(url)
    command.downgrade(migrate._config(url), "base")
    tables = _sqlite_rows(db, "SELECT name FROM sqlite_master WHERE type = 'table'")
    assert ("dedup_items",) not in tables
    assert current(url) is None


async def test_upgrade_async_inside_running_loop(tmp_path: Path) -> None:
    url = _sqlite_url(tmp_path / "dedup.db")
    await upgrade_async(url)
    assert await asyncio.to_thread(current, url) == HEAD


async def test_sync_upgrade_inside_running_loop_still_works(tmp_path: Path) -> None:
    # Blocks the loop, but must not fail with "asyncio.run() cannot be called
    # from a running event loop".
    url = _sqlite_url(tmp_path / "dedup.db")
    upgrade(url)
    assert current(url) == HEAD


# --- PostgreSQL --------------------------------------------------------------


async def test_postgres_upgrade(pg_empty_url: str) -> None:
    assert await asyncio.to_thread(current, pg_empty_url) is None

    await upgrade_async(pg_empty_url)
    await upgrade_async(pg_empty_url)  # already at head: a no-op

    assert await asyncio.to_thread(current, pg_empty_url) == HEAD
    conn = await asyncpg.connect(pg_empty_url)
    try:
        rows = await conn.fetch(
            """
            SELECT column_name, data_type, udt_name, is_nullable, column_default
            FROM information_schema.columns
            WHERE table_schema = 'public' AND table_name = 'dedup_items'
            """
        )
        columns = {row["column_name"]: row for row in rows}
        assert set(columns) == {"kind", "digest", "value", "payload", "created_at"}
        assert (columns["kind"]["data_type"], columns["kind"]["is_nullable"]) == ("text", "NO")
        assert (columns["digest"]["data_type"], columns["digest"]["is_nullable"]) == (
            "bytea",
            "NO",
        )
        assert (columns["value"]["data_type"], columns["value"]["is_nullable"]) == ("text", "NO")
        assert (columns["payload"]["udt_name"], columns["payload"]["is_nullable"]) == (
            "jsonb",
            "YES",
        )
        created_at = columns["created_at"]
        assert created_at["data_type"] == "timestamp with time zone"
        assert created_at["is_nullable"] == "NO"
        assert created_at["column_default"] == "now()"

        primary_key = await conn.fetch(
            """
            SELECT a.attname
            FROM pg_index i
            JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, pos) ON true
            JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
            WHERE i.indrelid = 'dedup_items'::regclass AND i.indisprimary
            ORDER BY k.pos
            """
        )
        assert [row["attname"] for row in primary_key] == ["kind", "digest"]

        insert = """
            INSERT INTO dedup_items (kind, digest, value, payload)
            VALUES ($1, $2, $3, $4::jsonb)
            ON CONFLICT (kind, digest) DO NOTHING
        """
        first = await conn.execute(insert, "k", b"\x01\x02", "v", '{"a": [1, 2]}')
        second = await conn.execute(insert, "k", b"\x01\x02", "v", '{"a": "other"}')
        assert (first, second) == ("INSERT 0 1", "INSERT 0 0")

        row = await conn.fetchrow(
            """
            SELECT count(*) OVER () AS n, pg_typeof(payload)::text AS payload_type,
                   payload ->> 'a' AS a, created_at, now() - created_at AS age
            FROM dedup_items
            """
        )
        assert row is not None
        assert row["n"] == 1
        assert row["payload_type"] == "jsonb"
        assert row["a"] == "[1, 2]"  # the first write won
        assert row["created_at"] is not None
        assert row["created_at"].tzinfo is not None
        assert row["age"].total_seconds() >= 0
    finally:
        await conn.close()


# --- packaging ---------------------------------------------------------------


def test_migrations_are_package_data() -> None:
    migrations = importlib.resources.files("dedup.store") / "migrations"
    assert (migrations / "env.py").is_file()
    assert (migrations / "script.py.mako").is_file()
    assert (migrations / "versions" / "0001_create_dedup_items.py").is_file()
    assert (migrations / "versions" / "0002_tombstones.py").is_file()


def _can_build_wheel_offline() -> bool:
    # --no-build-isolation builds with this environment's setuptools, which has
    # bdist_wheel built in only from 70.1; before that it comes from "wheel".
    if importlib.util.find_spec("wheel") is not None:
        return True
    major, minor = (int(part) for part in importlib.metadata.version("setuptools").split(".")[:2])
    return (major, minor) >= (70, 1)


@pytest.mark.slow
def test_wheel_contains_migrations(tmp_path: Path) -> None:
    # Build from a copy: an in-tree --no-build-isolation build leaves build/ and
    # *.egg-info behind in the checkout, and would race with a parallel run.
    source = tmp_path / "src"
    shutil.copytree(
        PROJECT_ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"
        ),
    )
    out = tmp_path / "out"
    if _can_build_wheel_offline():
        command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        command += ["--no-index", "--quiet", "-w", str(out), str(source)]
    else:
        # No bdist_wheel here: run build_py, the step that decides which files
        # of the package (modules and package data) go into the wheel.
        command = [sys.executable, "-c", "import setuptools; setuptools.setup()"]
        command += ["--quiet", "build_py", "--build-lib", str(out)]
    result = subprocess.run(
        command, cwd=source, capture_output=True, text=True, timeout=170, check=False
    )
    assert result.returncode == 0, result.stderr

    wheels = list(out.glob("dedup-*.whl"))
    if wheels:
        (wheel,) = wheels
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
    else:
        names = {path.relative_to(out).as_posix() for path in out.rglob("*")}
    missing = [name for name in WHEEL_FILES if name not in names]
    assert not missing, f"missing from the build: {missing}"
