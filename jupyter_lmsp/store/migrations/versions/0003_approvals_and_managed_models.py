"""Who approved a client and who started a pairing; models the service manages.

- `clients.approved_by`: who approved the client (a Jupyter user, or a paired client holding
  `clients:admin`); revoking a client revokes those it approved. Clients paired before this
  were approved by the Jupyter user they belong to (`paired_by`).
- `pairings.started_by`: who started the pairing (a client may not approve its own).
- `models.managed`: true only for a model folder the service created itself (a GGUF
  conversion, marked by a file naming the model); only such a folder is ever deleted. Models
  registered before this are not managed (their files are never deleted by the service).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("clients", sa.Column("approved_by", sa.String(), nullable=True))
    op.execute("UPDATE clients SET approved_by = paired_by WHERE approved_by IS NULL")
    op.add_column("pairings", sa.Column("started_by", sa.String(), nullable=True))
    # NOT NULL needs a value for the rows there: added with a default, which is then dropped
    # (the models declare none).
    with op.batch_alter_table("models") as batch:
        batch.add_column(
            sa.Column("managed", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    with op.batch_alter_table("models", recreate="always") as batch:
        batch.alter_column("managed", server_default=None)


def downgrade() -> None:
    raise NotImplementedError(
        "Schema downgrades are not supported: restore the backup taken before the upgrade "
        "(`jupyter lmsp restore PATH`)."
    )
