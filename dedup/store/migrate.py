"""Schema migrations of dedup's database, run with Alembic from inside the package.

The migration scripts ship as package data in ``dedup/store/migrations``; the Alembic
config is built here in code, so an installed wheel needs no ``alembic.ini`` and
no working directory of any kind. Users pass the same plain ``postgresql://`` or
``sqlite:///`` URL they give the gateway; :func:`to_sqlalchemy_url` picks the
async driver.
"""

from __future__ import annotations

import asyncio
import importlib.resources
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.environment import EnvironmentContext
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import make_url

__all__ = [
    "current",
    "head_revision",
    "migrations_dir",
    "to_sqlalchemy_url",
    "upgrade",
    "upgrade_async",
]

# Plain schemes users write, mapped to the async driver dedup runs on.
_DRIVERS = {
    "postgresql": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
    "sqlite": "sqlite+aiosqlite",
}


def to_sqlalchemy_url(database_url: str) -> str:
    """Return ``database_url`` with the async SQLAlchemy driver dedup uses.

    ``postgresql://`` and ``postgres://`` become ``postgresql+asyncpg://``;
    ``sqlite:///path`` becomes ``sqlite+aiosqlite:///path``. The rest of the URL,
    query string included, is kept as written. A URL that already names a driver
    (``postgresql+asyncpg://``) is returned unchanged, except that the ``postgres``
    alias is spelled ``postgresql``, since SQLAlchemy only knows that name.

    Raises:
        ValueError: the URL has no ``scheme://`` or a scheme other than PostgreSQL
            or SQLite.
    """
    scheme, sep, rest = database_url.partition("://")
    dialect, plus, driver = scheme.lower().partition("+")
    if not sep or dialect not in _DRIVERS or (plus and not driver):
        raise ValueError(
            f"unsupported database URL scheme {scheme!r}: expected postgresql://, "
            "postgres:// or sqlite:/// (optionally with a +driver)"
        )
    if plus:
        if dialect == "postgres":
            return f"postgresql+{driver}://{rest}"
        return database_url
    return f"{_DRIVERS[dialect]}://{rest}"


def migrations_dir() -> Path:
    """The folder of dedup's migration scripts (package data), for Alembic.

    Raises:
        RuntimeError: the folder has no ``env.py`` (a broken install).
    """
    # importlib.resources rather than __file__, so the folder is found the way
    # package data is meant to be; Alembic needs a real directory, which a
    # regular (unzipped) install gives.
    path = Path(str(importlib.resources.files("dedup.store") / "migrations"))
    if not (path / "env.py").is_file():
        raise RuntimeError(f"dedup's migrations are missing: no env.py in {path}")
    return path


def head_revision() -> str | None:
    """The newest revision of the migration scripts: what the code needs."""
    return ScriptDirectory(str(migrations_dir())).get_current_head()


def _config(database_url: str) -> Config:
    url = to_sqlalchemy_url(database_url)
    config = Config()
    # Config values go through configparser interpolation: a literal % (as in a
    # percent-encoded password) must be written %%.
    config.set_main_option("script_location", str(migrations_dir()).replace("%", "%%"))
    config.set_main_option("path_separator", "os")
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def _ensure_sqlite_dir(url: str) -> None:
    # SQLite creates the database file but not its directory; a fresh deployment
    # pointing at data/dedup.db should not fail on that.
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return
    database = parsed.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)


def upgrade(database_url: str, revision: str = "head") -> None:
    """Migrate the database at ``database_url`` up to ``revision`` (default: the newest).

    Revisions already applied are skipped, so calling this on an up-to-date
    database does nothing. The URL is a plain ``postgresql://`` or ``sqlite:///``
    URL (see :func:`to_sqlalchemy_url`); for SQLite the file's directory is created
    if missing.

    This blocks until done. It runs its own event loop, so it is meant for code
    without one; called from inside a running loop it still works but blocks that
    loop for the whole migration: use :func:`upgrade_async` there.
    """
    config = _config(database_url)
    _ensure_sqlite_dir(to_sqlalchemy_url(database_url))
    command.upgrade(config, revision)


async def upgrade_async(database_url: str, revision: str = "head") -> None:
    """Like :func:`upgrade`, but awaitable: the migration runs in a worker thread.

    Use this from async code; the caller's event loop keeps serving while the
    migration runs on an event loop of its own in that thread.
    """
    await asyncio.to_thread(upgrade, database_url, revision)


def current(database_url: str) -> str | None:
    """Return the revision the database at ``database_url`` is at, or ``None`` if unmigrated.

    Raises:
        alembic.util.CommandError: the database is on several heads at once,
            which dedup's linear history never produces.
    """
    config = _config(database_url)
    script = ScriptDirectory.from_config(config)
    found: list[str | None] = []

    # Go through env.py, like Alembic's own "current" command, so the revision is
    # read over the same driver and connection setup the migrations use; the
    # callback records instead of printing.
    def read_revision(_rev: object, context: MigrationContext) -> list[object]:
        found.append(context.get_current_revision())
        return []

    with EnvironmentContext(config, script, fn=read_revision, dont_mutate=True):
        script.run_env()
    return found[0] if found else None
