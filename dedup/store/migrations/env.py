"""Alembic environment of dedup's schema migrations.

Alembic runs this file for every command. It is shipped inside the package, so
``dedup migrate`` works from an installed wheel without an ``alembic.ini``:
:mod:`dedup.store.migrate` builds the :class:`alembic.config.Config` in code and puts
the database URL under ``sqlalchemy.url``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from alembic import context
from sqlalchemy import pool
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

config = context.config

# No fileConfig(): the gateway owns the process's logging, and a library must not
# reconfigure the root logger. Alembic's INFO lines stay below logging's default
# WARNING threshold, so migrations are quiet unless the application asks otherwise.

# The schema is written by hand in versions/; there is no autogenerate.
target_metadata = None


def _url() -> str:
    # The URL comes only from the Config, never from the environment, so the
    # database migrated is always the one the caller named.
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError(
            "sqlalchemy.url is not set in the Alembic config; "
            "run migrations via dedup.store.migrate"
        )
    return url


def run_migrations_offline() -> None:
    """Emit the migrations as SQL text instead of running them (``alembic upgrade --sql``)."""
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def do_run_migrations(connection: Connection) -> None:
    """Run the migrations on one (sync-adapted) connection of the async engine."""
    context.configure(connection=connection, target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()


async def run_async_migrations() -> None:
    """Open an async engine on the configured URL and run the migrations through it."""
    # NullPool: the engine lives for one command, so pooling would only keep a
    # connection open past dispose() for nothing.
    engine = create_async_engine(_url(), poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(do_run_migrations)
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    """Run the migrations against the database, on an event loop of their own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        # The usual case: a plain thread (CLI, worker thread of upgrade_async).
        asyncio.run(run_async_migrations())
        return
    # Called synchronously from inside a running loop: asyncio.run() would refuse,
    # so run the migration's own loop in a helper thread and wait for it. This
    # blocks the caller's loop; dedup.store.migrate.upgrade_async avoids that.
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="dedup-migrate"
    ) as executor:
        executor.submit(asyncio.run, run_async_migrations()).result()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
