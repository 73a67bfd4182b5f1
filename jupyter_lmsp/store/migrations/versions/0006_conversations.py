"""Conversations (issue 38): `conversations` (owner, metadata, the next item's position),
`conversation_items` (each item's wire JSON at its position, the response whose turn added
it; deleted with its conversation), and `responses.conversation_id`, the conversation a
response's turn joins when it completes (nullable, not a row reference; responses created
before this belong to none).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "conversations",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("labels", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("next_position", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_conversations_owner", "conversations", ["owner"])
    op.create_table(
        "conversation_items",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("conversation_id", sa.String(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("item", sa.Text(), nullable=False),
        sa.Column("response_id", sa.String(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            name="fk_conversation_items_conversation_id_conversations",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("conversation_id", "position"),
    )
    # A nullable column without a default: an ALTER TABLE on both backends, no rebuild.
    op.add_column("responses", sa.Column("conversation_id", sa.String(), nullable=True))


def downgrade() -> None:
    raise NotImplementedError(
        "Schema downgrades are not supported: restore the backup taken before the upgrade "
        "(`jupyter lmsp restore PATH`)."
    )
