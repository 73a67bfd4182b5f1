"""Runners with leases, per-user ownership, and real foreign keys.

- `runners`: the processes that drive tasks, each with a lease (LMSP B12);
  `tasks.runner_id` says which one drives an unfinished task, `idempotency_keys.runner_id`
  which one handles a claimed key that has no result yet.
- Owners are Jupyter users now, not the one `"owner"` of release 0.1.0: every row 0.1.0 wrote
  for `"owner"` is given to the user named by the upgrade (`legacy_owner`, the user the
  upgrading server runs for), clients and pairings record who approved them.
- Foreign keys: `task_events.task_id` → `tasks` (cascade), `tasks.response_id` ⇄
  `responses.task_id` (checked at commit), `tasks.runner_id` and
  `idempotency_keys.runner_id` → `runners` (set null), `pairings.client_id` → `clients`
  (set null). Rows 0.1.0 could leave dangling (none in practice: it deleted a task with its
  events and response) are cleaned first, so the new keys hold for every row.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Who owned everything in release 0.1.0 (it had one user).
LEGACY_OWNER = "owner"


def upgrade() -> None:
    legacy_owner = context.config.attributes.get("legacy_owner") or LEGACY_OWNER
    op.create_table(
        "runners",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("host", sa.String(), nullable=False),
        sa.Column("boot_id", sa.String(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("process_started_at", sa.Float(), nullable=False),
        sa.Column("label", sa.String(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("heartbeat_at", sa.Float(), nullable=False),
        sa.Column("lease_expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )

    # Dangling references would break the new keys: an event or a response without its task
    # can no longer be read through the API anyway, a task's link to a missing response is
    # dropped, a pairing's to a missing client likewise.
    op.execute("DELETE FROM task_events WHERE task_id NOT IN (SELECT id FROM tasks)")
    op.execute("DELETE FROM responses WHERE task_id NOT IN (SELECT id FROM tasks)")
    op.execute(
        "UPDATE tasks SET response_id = NULL"
        " WHERE response_id IS NOT NULL AND response_id NOT IN (SELECT id FROM responses)"
    )
    op.execute(
        "UPDATE pairings SET client_id = NULL"
        " WHERE client_id IS NOT NULL AND client_id NOT IN (SELECT id FROM clients)"
    )

    with op.batch_alter_table("tasks", recreate="always") as batch:
        batch.add_column(sa.Column("runner_id", sa.String(), nullable=True))
        batch.create_foreign_key(
            "fk_tasks_response_id_responses",
            "responses",
            ["response_id"],
            ["id"],
            deferrable=True,
            initially="DEFERRED",
        )
        batch.create_foreign_key(
            "fk_tasks_runner_id_runners", "runners", ["runner_id"], ["id"], ondelete="SET NULL"
        )
        batch.create_index("ix_tasks_runner_state", ["runner_id", "state"])
    with op.batch_alter_table("responses", recreate="always") as batch:
        batch.create_foreign_key(
            "fk_responses_task_id_tasks",
            "tasks",
            ["task_id"],
            ["id"],
            deferrable=True,
            initially="DEFERRED",
        )
    with op.batch_alter_table("task_events", recreate="always") as batch:
        batch.create_foreign_key(
            "fk_task_events_task_id_tasks", "tasks", ["task_id"], ["id"], ondelete="CASCADE"
        )
    with op.batch_alter_table("idempotency_keys", recreate="always") as batch:
        batch.add_column(sa.Column("runner_id", sa.String(), nullable=True))
        batch.create_foreign_key(
            "fk_idempotency_keys_runner_id_runners",
            "runners",
            ["runner_id"],
            ["id"],
            ondelete="SET NULL",
        )
    with op.batch_alter_table("pairings", recreate="always") as batch:
        batch.add_column(sa.Column("decided_by", sa.String(), nullable=True))
        batch.create_foreign_key(
            "fk_pairings_client_id_clients", "clients", ["client_id"], ["id"], ondelete="SET NULL"
        )
    op.add_column("clients", sa.Column("paired_by", sa.String(), nullable=True))
    op.create_index("ix_clients_paired_by", "clients", ["paired_by"])

    # Release 0.1.0 had one user, "owner": its rows become the upgrading server's user's.
    bind = op.get_bind()
    new = {"new": legacy_owner, "old": LEGACY_OWNER}
    bind.execute(sa.text("UPDATE tasks SET owner = :new WHERE owner = :old"), new)
    bind.execute(sa.text("UPDATE responses SET owner = :new WHERE owner = :old"), new)
    bind.execute(sa.text("UPDATE idempotency_keys SET caller = :new WHERE caller = :old"), new)
    bind.execute(sa.text("UPDATE clients SET paired_by = :new WHERE paired_by IS NULL"), new)
    bind.execute(
        sa.text(
            "UPDATE pairings SET decided_by = :new"
            " WHERE decided_by IS NULL AND status IN ('approved', 'denied', 'claimed')"
        ),
        new,
    )


def downgrade() -> None:
    raise NotImplementedError(
        "Schema downgrades are not supported: restore the backup taken before the upgrade "
        "(`jupyter lmsp restore PATH`)."
    )
