"""On PostgreSQL, a trigger announcing every committed event (`LISTEN/NOTIFY`,
`store.notify`): servers sharing the database learn of new events without polling. Nothing
on SQLite.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        """
        CREATE OR REPLACE FUNCTION lmsp_notify_event() RETURNS trigger AS $$
        BEGIN
            PERFORM pg_notify('lmsp_events', NEW.task_id || ' ' || NEW.sequence_number);
            RETURN NULL;
        END;
        $$ LANGUAGE plpgsql
        """
    )
    op.execute(
        "CREATE TRIGGER lmsp_task_events_notify AFTER INSERT ON task_events"
        " FOR EACH ROW EXECUTE FUNCTION lmsp_notify_event()"
    )


def downgrade() -> None:
    raise NotImplementedError(
        "Schema downgrades are not supported: restore the backup taken before the upgrade "
        "(`jupyter lmsp restore PATH`)."
    )
