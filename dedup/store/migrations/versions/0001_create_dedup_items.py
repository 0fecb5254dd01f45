"""Create dedup_items: one row per saved (kind, value).

Revision ID: 0001
Revises:
Create Date: 2024-11-22 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# Revision identifiers, used by Alembic.
revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the ``dedup_items`` table."""
    op.create_table(
        "dedup_items",
        sa.Column("kind", sa.Text(), nullable=False),
        # The digest of the value, not the value: a fixed-size key keeps the primary
        # key index small however long values get. bytea on PostgreSQL, BLOB on SQLite.
        sa.Column("digest", sa.LargeBinary(), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        # jsonb on PostgreSQL (binary, indexable); plain JSON text elsewhere.
        sa.Column(
            "payload",
            sa.JSON().with_variant(postgresql.JSONB(), "postgresql"),
            nullable=True,
        ),
        # Set by the database so every writer agrees on one clock: now() on
        # PostgreSQL, CURRENT_TIMESTAMP on SQLite.
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.func.now(),
            nullable=False,
        ),
        # (kind, digest) is what makes a write a duplicate: INSERT ... ON CONFLICT
        # DO NOTHING on this key is the dedup guarantee of the database.
        sa.PrimaryKeyConstraint("kind", "digest", name="dedup_items_pkey"),
    )


def downgrade() -> None:
    """Drop the ``dedup_items`` table."""
    op.drop_table("dedup_items")
