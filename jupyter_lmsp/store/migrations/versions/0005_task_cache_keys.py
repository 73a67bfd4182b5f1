"""`tasks.cache_key`: the request's `prompt_cache_key`, a routing hint for the shared queue
(`rules.claim_tasks` gives a worker the tasks of the keys it served recently first). Nullable,
no index (the claim sorts the claimable tasks it reads anyway); tasks created before this have
none.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A nullable column without a default: an ALTER TABLE on both backends, no rebuild.
    op.add_column("tasks", sa.Column("cache_key", sa.String(length=64), nullable=True))


def downgrade() -> None:
    raise NotImplementedError(
        "Schema downgrades are not supported: restore the backup taken before the upgrade "
        "(`jupyter lmsp restore PATH`)."
    )
