"""`tasks.stored_bytes`: the characters a finished task keeps (its events' data and its
response's output), counted once, the first time its owner's storage quota is checked after it
finished (`store.quotas.usage`), so a quota check no longer reads every event of every finished
task of the tree. Nullable: tasks finished before this are counted when first needed.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A nullable column without a default: an ALTER TABLE on both backends, no rebuild.
    op.add_column("tasks", sa.Column("stored_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    raise NotImplementedError(
        "Schema downgrades are not supported: restore the backup taken before the upgrade "
        "(`jupyter lmsp restore PATH`)."
    )
