"""Tombstones: every row deleted from dedup_items by any means, for the gateways to forget.

A row deleted by plain SQL (a cleanup job, a GDPR script, a person) leaves its Redis
marker and the gateways' local entries saying "saved": every later save of the value
would answer ``created=False`` with no row. Triggers write each deleted row's key to
``dedup_tombstones``; a gateway drains it, clearing the markers and the local entries
(``dedup._engine.guardian``), so that the value saves as new again a few seconds later.

- PostgreSQL: one statement-level ``AFTER DELETE`` trigger (a transition table: one
  INSERT per statement, whatever the rows) and an ``AFTER TRUNCATE`` trigger that
  writes one tombstone with no key, meaning "every row". dedup's own forgets and
  prunes set ``dedup.forgetting`` in their transaction, and the triggers skip them:
  those markers are cleared already.
- SQLite: a row-level ``AFTER DELETE`` trigger (SQLite has no TRUNCATE; its ``DELETE``
  without ``WHERE`` fires row triggers too).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-28 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# Revision identifiers, used by Alembic.
revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_PG_FUNCTIONS = """
CREATE FUNCTION dedup_items_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF coalesce(current_setting('dedup.forgetting', true), '') <> 'on' THEN
        INSERT INTO dedup_tombstones (kind, digest) SELECT kind, digest FROM gone;
    END IF;
    RETURN NULL;
END $$;

CREATE FUNCTION dedup_items_truncated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO dedup_tombstones (kind, digest) VALUES (NULL, NULL);
    RETURN NULL;
END $$;

CREATE TRIGGER dedup_items_deleted AFTER DELETE ON dedup_items
    REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION dedup_items_deleted();

CREATE TRIGGER dedup_items_truncated AFTER TRUNCATE ON dedup_items
    FOR EACH STATEMENT EXECUTE FUNCTION dedup_items_truncated();
"""

_SQLITE_TRIGGER = """
CREATE TRIGGER dedup_items_deleted AFTER DELETE ON dedup_items
BEGIN
    INSERT INTO dedup_tombstones (kind, digest) VALUES (OLD.kind, OLD.digest);
END
"""


def upgrade() -> None:
    """Create ``dedup_tombstones`` and the triggers that fill it."""
    op.create_table(
        "dedup_tombstones",
        # Drained in id order; a 64-bit id never wraps.
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        # Both NULL: every row went (TRUNCATE).
        sa.Column("kind", sa.Text(), nullable=True),
        sa.Column("digest", sa.LargeBinary(), nullable=True),
        sa.Column(
            "deleted_at",
            sa.DateTime(timezone=True),
            server_default=sa.func.now(),
            nullable=False,
        ),
    )
    if op.get_bind().dialect.name == "postgresql":
        for statement in _PG_FUNCTIONS.split(";\n\n"):
            op.execute(statement)
    else:
        op.execute(_SQLITE_TRIGGER)


def downgrade() -> None:
    """Drop the triggers and ``dedup_tombstones``."""
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS dedup_items_truncated ON dedup_items")
        op.execute("DROP TRIGGER IF EXISTS dedup_items_deleted ON dedup_items")
        op.execute("DROP FUNCTION IF EXISTS dedup_items_truncated()")
        op.execute("DROP FUNCTION IF EXISTS dedup_items_deleted()")
    else:
        op.execute("DROP TRIGGER IF EXISTS dedup_items_deleted")
    op.drop_table("dedup_tombstones")
