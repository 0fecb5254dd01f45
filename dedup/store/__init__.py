"""The database side: sinks that write a batch in one statement (:mod:`.sinks`), and the
schema's migrations (:mod:`.migrate`, the Alembic scripts under ``migrations/``).
"""

from __future__ import annotations

from dedup.store.sinks import (
    DATABASE_SCHEMES,
    TABLE,
    DefaultSink,
    PostgresSink,
    SqliteSink,
    Tombstone,
    default_identity,
    keep_session,
    open_sink,
    pg_insert,
    sink_identity,
)

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
