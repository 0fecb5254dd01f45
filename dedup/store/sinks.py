"""Database sinks: the write step, one statement per batch.

The default sinks write ``dedup_items`` (schema in the migrations):
PostgreSQL through asyncpg, SQLite through SQLAlchemy Core and aiosqlite. Both
insert a batch with ONE ``INSERT ... ON CONFLICT DO NOTHING RETURNING``; rows
arrive deduplicated and sorted by key, because concurrent multi-row upserts that
lock keys in different orders deadlock.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import asyncpg

from dedup.errors import ConfigError
from dedup.types import Row
from dedup.urls import DATABASE_SCHEMES, database_identity

if TYPE_CHECKING:  # SQLAlchemy is imported by the SQLite sink only, when it is used
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = [
    "DATABASE_SCHEMES",
    "TABLE",
    "DefaultSink",
    "PostgresSink",
    "SqliteSink",
    "Tombstone",
    "default_identity",
    "keep_session",
    "open_sink",
    "pg_insert",
    "sink_identity",
]

log = logging.getLogger("dedup")

TABLE = "dedup_items"
"""The default sinks' table (created by the migrations)."""


PG_INSERT = """
INSERT INTO dedup_items (kind, digest, value, payload)
SELECT * FROM unnest($1::text[], $2::bytea[], $3::text[], $4::jsonb[])
ON CONFLICT (kind, digest) DO NOTHING
RETURNING kind, digest
"""
PG_COUNT = "SELECT count(*) FROM dedup_items WHERE kind = ANY($1::text[])"
PG_DELETE = "DELETE FROM dedup_items WHERE kind = ANY($1::text[])"
# Forgetting (dedup._engine.forget): the rows of some values of one kind, or only those
# older than a cutoff, so that a prune never deletes a row saved after it began.
PG_FORGET = """
DELETE FROM dedup_items
WHERE kind = $1 AND digest = ANY($2::bytea[]) AND ($3::timestamptz IS NULL OR created_at < $3)
RETURNING digest
"""
# dedup's own deletes: the tombstone trigger skips the transactions that set this.
PG_FORGETTING = "SET LOCAL dedup.forgetting = 'on'"
PG_CUTOFF = "SELECT now() - make_interval(secs => $1)"
# Tombstones (migration 0002): the keys of rows deleted by anything else, oldest first.
PG_TOMBSTONES = "SELECT id, kind, digest FROM dedup_tombstones ORDER BY id LIMIT $1"
PG_DROP_TOMBSTONES = "DELETE FROM dedup_tombstones WHERE id = ANY($1::bigint[])"
PG_COUNT_TOMBSTONES = "SELECT count(*) FROM dedup_tombstones"
# Where the database is: its system identifier and timeline (a restore, a point-in-time
# recovery or a promoted standby changes one of them) and its WAL position, in bytes.
PG_POSITION = """
SELECT (SELECT system_identifier FROM pg_control_system())::text
       || '/' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8),
       (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint
"""
PG_POSITION_UNPRIVILEGED = """
SELECT substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8),
       (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint
"""
PG_COUNT_OLDER = "SELECT count(*) FROM dedup_items WHERE kind = $1 AND created_at < $2"
# Keyset pages in primary-key order: a prune walks the kind's rows once, with no index
# on created_at (which every insert would pay for).
PG_OLDER = """
SELECT digest FROM dedup_items
WHERE kind = $1 AND digest > $2 AND created_at < $3
ORDER BY digest LIMIT $4
"""
PG_TABLE_EXISTS = "SELECT to_regclass('dedup_items') IS NOT NULL"
PG_TOMBSTONES_EXIST = "SELECT to_regclass('dedup_tombstones') IS NOT NULL"
PG_FETCH = "SELECT payload::text FROM dedup_items WHERE kind = $1 AND digest = $2"
PG_FETCH_MANY = """
SELECT i.kind, i.digest, i.payload::text
FROM unnest($1::text[], $2::bytea[]) AS k (kind, digest)
JOIN dedup_items AS i ON i.kind = k.kind AND i.digest = k.digest
"""


@functools.cache
def _items() -> sa.Table:
    """An access description for SQLAlchemy Core, not a schema: the table itself is
    created by the migrations. payload is declared Text because rows carry JSON text
    already serialised; a JSON type would encode it a second time. Built on first use:
    a PostgreSQL gateway never imports SQLAlchemy, whose ~41,000 objects every full
    pass of the garbage collector would otherwise scan in every gateway process."""
    import sqlalchemy as sa

    return sa.Table(
        "dedup_items",
        sa.MetaData(),
        sa.Column("kind", sa.Text, primary_key=True),
        sa.Column("digest", sa.LargeBinary, primary_key=True),
        sa.Column("value", sa.Text),
        sa.Column("payload", sa.Text),
    )


_SQLITE_MAX_ROWS = 8000


@functools.lru_cache(maxsize=64)
def _sqlite_insert_sql(n: int) -> str:
    """The SQLite insert of ``n`` rows: parameters only, never values in the text."""
    values = ",".join(["(?,?,?,?)"] * n)
    return (
        f"INSERT INTO dedup_items (kind, digest, value, payload) VALUES {values} "  # noqa: S608
        "ON CONFLICT (kind, digest) DO NOTHING RETURNING kind, digest"
    )


class DefaultSink(Protocol):
    """What the Gateway needs of a default sink: the batch writer plus lifecycle and counting."""

    identity: str
    """Which database and table this sink writes (see :func:`sink_identity`)."""

    async def open(self) -> None:
        """Connect, and check that the schema is there."""

    async def aclose(self) -> None:
        """Close every connection; safe to call twice."""

    async def __call__(self, rows: Sequence[Row]) -> list[tuple[str, bytes]]:
        """Insert ``rows`` in one statement; return the keys of the rows inserted."""

    async def count(self, kinds: Sequence[str]) -> int:
        """How many rows the table holds for ``kinds``."""

    async def delete(self, kinds: Sequence[str]) -> int:
        """Delete the rows of ``kinds``; returns how many (used by the demo)."""

    async def fetch(self, kind: str, digest: bytes) -> tuple[bool, str | None]:
        """Whether the row ``(kind, digest)`` exists, and its payload as JSON text."""

    async def fetch_many(
        self, keys: Sequence[tuple[str, bytes]]
    ) -> dict[tuple[str, bytes], str | None]:
        """The rows of ``keys`` that exist, in one statement: their payloads as JSON text,
        by key (a key with no row is left out)."""

    async def forget_rows(
        self, kind: str, digests: Sequence[bytes], before: Any = None
    ) -> list[bytes]:
        """Delete the rows of ``digests`` of ``kind`` (only those created before
        ``before``, a :meth:`cutoff`, when given); the digests of the rows deleted."""

    async def cutoff(self, older_than_s: float) -> Any:
        """The database's time ``older_than_s`` seconds ago (one clock for every row)."""

    async def count_older(self, kind: str, before: Any) -> int:
        """How many rows of ``kind`` were created before ``before`` (a :meth:`cutoff`)."""

    async def older_digests(self, kind: str, before: Any, after: bytes, limit: int) -> list[bytes]:
        """Up to ``limit`` digests of rows of ``kind`` created before ``before``, in
        digest order, each greater than ``after``: one page of a prune."""

    async def tombstones(self, limit: int) -> list[Tombstone]:
        """Up to ``limit`` tombstones, oldest first: the keys of rows deleted by anything
        but dedup (a key of None: every row, a TRUNCATE)."""

    async def drop_tombstones(self, ids: Sequence[int]) -> None:
        """Delete the tombstones ``ids`` (drained)."""

    async def count_tombstones(self) -> int:
        """How many tombstones wait to be drained."""

    async def position(self) -> tuple[str, int] | None:
        """Where the database is: an identity that a restore, a point-in-time recovery or
        a failover changes, and a position that only grows otherwise (None: this
        database cannot tell)."""


Tombstone = tuple[int, str | None, bytes | None]
"""A tombstone: its id, and the deleted row's kind and digest (None, None: every row)."""


async def pg_insert(
    db: asyncpg.Pool | asyncpg.Connection, rows: Sequence[Row]
) -> list[tuple[str, bytes]]:
    """Run :data:`PG_INSERT` for ``rows`` on a pool or connection; the inserted keys."""
    records = await db.fetch(
        PG_INSERT,
        [r.kind for r in rows],
        [r.digest for r in rows],
        [r.value for r in rows],
        [r.payload_json for r in rows],
    )
    return [(rec[0], rec[1]) for rec in records]


async def keep_session(conn: asyncpg.Connection) -> None:
    """A pool ``reset`` for connections that only run single autocommit statements.

    asyncpg's default reset sends one more query on every release (advisory
    unlocks, CLOSE ALL, UNLISTEN *, RESET ALL): a second round trip and a second
    transaction per statement. The sink never sets session state, and asyncpg
    still rolls back an open transaction before calling this, so there is
    nothing to undo.
    """


class PostgresSink:
    """Writes ``dedup_items`` in PostgreSQL through an asyncpg pool.

    ``statement_timeout_ms`` is set on the server too, so a statement the client
    gave up on does not go on holding row locks.
    """

    def __init__(self, url: str, *, pool_size: int, statement_timeout_ms: int) -> None:
        self._url = url
        self.identity = default_identity(url)
        """Which database and table this sink writes: gateways share a writer only
        when these are equal (its URL without the password, see :func:`sink_identity`)."""
        self._pool_size = pool_size
        self._timeout_ms = statement_timeout_ms
        self._pool: asyncpg.Pool | None = None
        self._unprivileged = False
        self._tombstones = True

    async def open(self) -> None:
        """Create the pool and check that ``dedup migrate`` has run."""
        self._pool = await asyncpg.create_pool(
            self._url,
            min_size=1,
            max_size=self._pool_size,
            timeout=self._timeout_ms / 1000,
            command_timeout=self._timeout_ms / 1000,
            server_settings={
                "statement_timeout": str(self._timeout_ms),
                "application_name": "dedup",
            },
            reset=keep_session,
        )
        if not await self._pool.fetchval(PG_TABLE_EXISTS):
            await self.aclose()
            raise ConfigError(
                "table dedup_items does not exist in the database; run `dedup migrate` first"
            )
        self._tombstones = bool(await self._pool.fetchval(PG_TOMBSTONES_EXIST))
        if not self._tombstones:
            log.warning(
                "the database's schema is older than this dedup (no dedup_tombstones): rows "
                "deleted with SQL are not noticed until `dedup migrate` is run"
            )

    async def aclose(self) -> None:
        """Close the pool (cancellation-safe: the pool is forgotten first)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            try:
                await asyncio.wait_for(pool.close(), timeout=self._timeout_ms / 1000 + 5)
            except (TimeoutError, asyncio.CancelledError):
                pool.terminate()
                raise

    def _require_pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("sink is not open")
        return self._pool

    async def __call__(self, rows: Sequence[Row]) -> list[tuple[str, bytes]]:
        """Insert ``rows`` with one statement and return the inserted keys."""
        return await pg_insert(self._require_pool(), rows)

    async def count(self, kinds: Sequence[str]) -> int:
        """How many rows the table holds for ``kinds``."""
        return int(await self._require_pool().fetchval(PG_COUNT, list(kinds)))

    async def delete(self, kinds: Sequence[str]) -> int:
        """Delete the rows of ``kinds`` (no tombstones: used with the namespace's keys
        deleted too)."""
        async with self._require_pool().acquire() as conn, conn.transaction():
            await conn.execute(PG_FORGETTING)
            status = await conn.execute(PG_DELETE, list(kinds))
        return int(status.split()[-1])

    async def fetch(self, kind: str, digest: bytes) -> tuple[bool, str | None]:
        """Whether the row ``(kind, digest)`` exists, and its payload as JSON text."""
        record = await self._require_pool().fetchrow(PG_FETCH, kind, digest)
        return (False, None) if record is None else (True, record[0])

    async def fetch_many(
        self, keys: Sequence[tuple[str, bytes]]
    ) -> dict[tuple[str, bytes], str | None]:
        """The rows of ``keys`` that exist, in one statement: their payloads by key."""
        records = await self._require_pool().fetch(
            PG_FETCH_MANY, [k for k, _ in keys], [d for _, d in keys]
        )
        return {(rec[0], rec[1]): rec[2] for rec in records}

    async def forget_rows(
        self, kind: str, digests: Sequence[bytes], before: Any = None
    ) -> list[bytes]:
        """Delete the rows of ``digests`` of ``kind`` (created before ``before``, if given),
        with no tombstones: the forget cleared their markers already."""
        async with self._require_pool().acquire() as conn, conn.transaction():
            await conn.execute(PG_FORGETTING)
            records = await conn.fetch(PG_FORGET, kind, list(digests), before)
        return [bytes(rec[0]) for rec in records]

    async def cutoff(self, older_than_s: float) -> Any:
        """The database's ``now()`` less ``older_than_s`` seconds."""
        return await self._require_pool().fetchval(PG_CUTOFF, float(older_than_s))

    async def count_older(self, kind: str, before: Any) -> int:
        """How many rows of ``kind`` were created before ``before``."""
        return int(await self._require_pool().fetchval(PG_COUNT_OLDER, kind, before))

    async def older_digests(self, kind: str, before: Any, after: bytes, limit: int) -> list[bytes]:
        """A page of the digests of rows of ``kind`` created before ``before``."""
        records = await self._require_pool().fetch(PG_OLDER, kind, after, before, limit)
        return [bytes(rec[0]) for rec in records]

    async def tombstones(self, limit: int) -> list[Tombstone]:
        """Up to ``limit`` tombstones, oldest first (none before ``dedup migrate``)."""
        if not self._tombstones:
            return []
        records = await self._require_pool().fetch(PG_TOMBSTONES, limit)
        return [(int(r[0]), r[1], None if r[2] is None else bytes(r[2])) for r in records]

    async def drop_tombstones(self, ids: Sequence[int]) -> None:
        """Delete the tombstones ``ids``."""
        await self._require_pool().execute(PG_DROP_TOMBSTONES, list(ids))

    async def count_tombstones(self) -> int:
        """How many tombstones wait to be drained."""
        return int(await self._require_pool().fetchval(PG_COUNT_TOMBSTONES))

    async def position(self) -> tuple[str, int] | None:
        """The system identifier and timeline, and the WAL position (None on a standby,
        where there is no current WAL position to read). Without the right to read the
        control file (``pg_control_system``, granted to superusers and
        ``pg_read_all_stats`` where revoked), the timeline alone."""
        pool = self._require_pool()
        try:
            if self._unprivileged:
                record = await pool.fetchrow(PG_POSITION_UNPRIVILEGED)
            else:
                record = await pool.fetchrow(PG_POSITION)
        except asyncpg.InsufficientPrivilegeError:
            self._unprivileged = True
            return await self.position()
        except asyncpg.ObjectNotInPrerequisiteStateError:  # recovery is in progress
            return None
        assert record is not None
        return str(record[0]), int(record[1])


class SqliteSink:
    """Writes ``dedup_items`` in a SQLite file (the embedded default).

    SQLite has one writer at a time; WAL lets readers go on meanwhile. ``synchronous``
    is set to FULL, whatever the library was built with, so that a committed row is
    durable. A writer waits for the file's lock for at most four fifths of the
    statement bound, so that SQLite's own "database is locked" ends the wait: the bound
    that cancels a statement (``write_timeout_ms``) would otherwise cut it off mid-way,
    and a connection cut off like that kept the file's write lock, for every writer of
    every process, until the garbage collector freed it.
    """

    def __init__(self, url: str, *, statement_timeout_ms: int) -> None:
        self._url = url.replace("sqlite:///", "sqlite+aiosqlite:///", 1)
        self.identity = default_identity(url)
        """Which file and table this sink writes (see :func:`sink_identity`)."""
        self._timeout_s = statement_timeout_ms / 1000
        # SQLite's busy timeout, inside the statement's bound (see the class docstring).
        self._busy_s = 0.8 * self._timeout_s
        self._engine: AsyncEngine | None = None
        self._tombstones = True

    async def open(self) -> None:
        """Open the engine and check that the schema is there."""
        import sqlalchemy as sa
        from sqlalchemy.ext.asyncio import create_async_engine

        engine = create_async_engine(
            self._url, connect_args={"timeout": self._busy_s}, pool_size=1, max_overflow=0
        )

        @sa.event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=FULL")
            cursor.close()

        self._engine = engine
        try:
            async with engine.connect() as conn:
                exists = await conn.run_sync(lambda c: sa.inspect(c).has_table("dedup_items"))
                self._tombstones = await conn.run_sync(
                    lambda c: sa.inspect(c).has_table("dedup_tombstones")
                )
        except BaseException:
            await self.aclose()  # the caller registers aclose only after a good open
            raise
        if not exists:
            await self.aclose()
            raise ConfigError(
                "table dedup_items does not exist in the database; run `dedup migrate` first"
            )

    async def aclose(self) -> None:
        """Dispose of the engine."""
        engine, self._engine = self._engine, None
        if engine is not None:
            await engine.dispose()

    def _require_engine(self) -> AsyncEngine:
        if self._engine is None:
            raise RuntimeError("sink is not open")
        return self._engine

    async def __call__(self, rows: Sequence[Row]) -> list[tuple[str, bytes]]:
        """Insert ``rows`` with one statement and return the inserted keys."""
        # Compiling a multi-row insert with SQLAlchemy costs more than SQLite's
        # insert itself, so the statement text is built once per batch size.
        inserted: list[tuple[str, bytes]] = []
        async with self._require_engine().begin() as conn:
            # SQLite allows 32,766 parameters a statement: a huge batch takes several,
            # still in one transaction.
            for start in range(0, len(rows), _SQLITE_MAX_ROWS):
                chunk = rows[start : start + _SQLITE_MAX_ROWS]
                params = tuple(
                    x for r in chunk for x in (r.kind, r.digest, r.value, r.payload_json)
                )
                result = await conn.exec_driver_sql(_sqlite_insert_sql(len(chunk)), params)
                records: list[Any] = list(result.all())  # untyped: raw driver SQL
                inserted += [(str(rec[0]), bytes(rec[1])) for rec in records]
        return inserted

    async def count(self, kinds: Sequence[str]) -> int:
        """How many rows the table holds for ``kinds``."""
        import sqlalchemy as sa

        items = _items()
        stmt = sa.select(sa.func.count()).select_from(items).where(items.c.kind.in_(kinds))
        async with self._require_engine().connect() as conn:
            return int((await conn.execute(stmt)).scalar_one())

    async def delete(self, kinds: Sequence[str]) -> int:
        """Delete the rows of ``kinds``."""
        import sqlalchemy as sa

        items = _items()
        async with self._require_engine().begin() as conn:
            result = await conn.execute(sa.delete(items).where(items.c.kind.in_(kinds)))
            if self._tombstones and kinds:
                # SQLite's trigger cannot tell dedup's deletes: drop what it wrote for them.
                marks = ",".join("?" * len(kinds))
                await conn.exec_driver_sql(
                    f"DELETE FROM dedup_tombstones WHERE kind IN ({marks})",  # noqa: S608
                    tuple(kinds),
                )
            return int(result.rowcount)

    async def fetch(self, kind: str, digest: bytes) -> tuple[bool, str | None]:
        """Whether the row ``(kind, digest)`` exists, and its payload as JSON text."""
        import sqlalchemy as sa

        items = _items()
        stmt = sa.select(items.c.payload).where(items.c.kind == kind, items.c.digest == digest)
        async with self._require_engine().connect() as conn:
            row = (await conn.execute(stmt)).first()
        return (False, None) if row is None else (True, row[0])

    async def fetch_many(
        self, keys: Sequence[tuple[str, bytes]]
    ) -> dict[tuple[str, bytes], str | None]:
        """The rows of ``keys`` that exist: their payloads by key (one statement per
        8,000 keys, SQLite's bound on a statement's parameters)."""
        import sqlalchemy as sa

        items = _items()
        found: dict[tuple[str, bytes], str | None] = {}
        async with self._require_engine().connect() as conn:
            for start in range(0, len(keys), _SQLITE_MAX_ROWS):
                chunk = keys[start : start + _SQLITE_MAX_ROWS]
                stmt = sa.select(items.c.kind, items.c.digest, items.c.payload).where(
                    sa.tuple_(items.c.kind, items.c.digest).in_(chunk)
                )
                for row in (await conn.execute(stmt)).all():
                    found[(str(row[0]), bytes(row[1]))] = row[2]
        return found

    async def forget_rows(
        self, kind: str, digests: Sequence[bytes], before: Any = None
    ) -> list[bytes]:
        """Delete the rows of ``digests`` of ``kind`` (created before ``before``, if given;
        one statement per 8,000 digests, in one transaction)."""
        deleted: list[bytes] = []
        async with self._require_engine().begin() as conn:
            for start in range(0, len(digests), _SQLITE_MAX_ROWS):
                chunk = list(digests[start : start + _SQLITE_MAX_ROWS])
                marks = ",".join("?" * len(chunk))
                sql = (
                    f"DELETE FROM dedup_items WHERE kind = ? AND digest IN ({marks})"  # noqa: S608
                    " AND (? IS NULL OR created_at < ?) RETURNING digest"
                )
                result = await conn.exec_driver_sql(sql, (kind, *chunk, before, before))
                gone = [bytes(rec[0]) for rec in result.all()]
                deleted += gone
                if gone and self._tombstones:  # the trigger's: the forget clears the markers
                    marks = ",".join("?" * len(gone))
                    await conn.exec_driver_sql(
                        "DELETE FROM dedup_tombstones WHERE kind = ?"  # noqa: S608
                        f" AND digest IN ({marks})",
                        (kind, *gone),
                    )
        return deleted

    async def cutoff(self, older_than_s: float) -> Any:
        """SQLite's ``datetime('now')`` less ``older_than_s`` seconds, as the text that
        ``CURRENT_TIMESTAMP`` writes in ``created_at``."""
        async with self._require_engine().connect() as conn:
            result = await conn.exec_driver_sql(
                "SELECT datetime('now', ?)", (f"-{float(older_than_s)} seconds",)
            )
            return result.scalar_one()

    async def count_older(self, kind: str, before: Any) -> int:
        """How many rows of ``kind`` were created before ``before``."""
        async with self._require_engine().connect() as conn:
            result = await conn.exec_driver_sql(
                "SELECT count(*) FROM dedup_items WHERE kind = ? AND created_at < ?",
                (kind, before),
            )
            return int(result.scalar_one())

    async def older_digests(self, kind: str, before: Any, after: bytes, limit: int) -> list[bytes]:
        """A page of the digests of rows of ``kind`` created before ``before``."""
        async with self._require_engine().connect() as conn:
            result = await conn.exec_driver_sql(
                "SELECT digest FROM dedup_items WHERE kind = ? AND digest > ?"
                " AND created_at < ? ORDER BY digest LIMIT ?",
                (kind, after, before, limit),
            )
            return [bytes(rec[0]) for rec in result.all()]

    async def tombstones(self, limit: int) -> list[Tombstone]:
        """Up to ``limit`` tombstones, oldest first (none before ``dedup migrate``)."""
        if not self._tombstones:
            return []
        async with self._require_engine().connect() as conn:
            result = await conn.exec_driver_sql(
                "SELECT id, kind, digest FROM dedup_tombstones ORDER BY id LIMIT ?", (limit,)
            )
            records: list[Any] = list(result.all())  # untyped: raw driver SQL
        return [(int(r[0]), r[1], None if r[2] is None else bytes(r[2])) for r in records]

    async def drop_tombstones(self, ids: Sequence[int]) -> None:
        """Delete the tombstones ``ids``."""
        async with self._require_engine().begin() as conn:
            for start in range(0, len(ids), _SQLITE_MAX_ROWS):
                chunk = list(ids[start : start + _SQLITE_MAX_ROWS])
                marks = ",".join("?" * len(chunk))
                await conn.exec_driver_sql(
                    f"DELETE FROM dedup_tombstones WHERE id IN ({marks})",  # noqa: S608
                    tuple(chunk),
                )

    async def count_tombstones(self) -> int:
        """How many tombstones wait to be drained."""
        async with self._require_engine().connect() as conn:
            result = await conn.exec_driver_sql("SELECT count(*) FROM dedup_tombstones")
            return int(result.scalar_one())

    async def position(self) -> tuple[str, int] | None:
        """None: a SQLite file cannot tell that it was put back from a copy (run
        ``dedup reconcile`` after restoring one)."""
        return None


def open_sink(database_url: str, *, pool_size: int, statement_timeout_ms: int) -> DefaultSink:
    """The default sink for ``database_url`` (postgresql:// or sqlite:///), not yet opened."""
    if database_url.startswith(("postgresql://", "postgres://")):
        return PostgresSink(
            database_url, pool_size=pool_size, statement_timeout_ms=statement_timeout_ms
        )
    if database_url.startswith("sqlite:///"):
        return SqliteSink(database_url, statement_timeout_ms=statement_timeout_ms)
    raise ConfigError(f"database_url must start with one of {', '.join(DATABASE_SCHEMES)}")


def default_identity(database_url: str) -> str:
    """The identity of the default sink of ``database_url``: the database it reaches
    (:func:`dedup.urls.database_identity`, no password) and the table."""
    return f"{database_identity(database_url)}#{TABLE}"


def sink_identity(sink: object) -> str | None:
    """The identity a sink declares (its ``identity`` attribute: non-empty text naming
    the database and table it writes), or None when it declares none.

    Gateways write each other's rows (shared writes) only when their sinks declare
    the same identity; a sink that declares none writes only its own gateway's rows.
    """
    identity = getattr(sink, "identity", None)
    if identity is None:
        return None
    if not isinstance(identity, str) or not identity:
        raise ConfigError("a sink's identity must be non-empty text naming its database and table")
    return identity
