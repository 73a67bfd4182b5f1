"""Committed events announced to every server on a PostgreSQL database (`LISTEN/NOTIFY`).

A trigger on `task_events` sends, for every event inserted, a notification on the channel
`lmsp_events` whose payload is the task id and the event's sequence number
(`"<task_id> <sequence_number>"`). PostgreSQL delivers notifications only when, and only if,
the transaction commits, in commit order: a server that listens learns of each committed
event without polling. The payload only says where to look: the listener reads the events from
the table (`store.feed`, which `services.feed` drives), so a notification missed (a
listener reconnecting) costs latency, never an event.

The trigger is created with the tables (`install`, on PostgreSQL only) and by migration 0004
for databases made before it. SQLite has no such thing: its servers poll `PRAGMA
data_version`.
"""

from __future__ import annotations

from sqlalchemy import DDL, Table, event

CHANNEL = "lmsp_events"

FUNCTION = f"""
CREATE OR REPLACE FUNCTION lmsp_notify_event() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('{CHANNEL}', NEW.task_id || ' ' || NEW.sequence_number);
    RETURN NULL;
END;
$$ LANGUAGE plpgsql
"""

TRIGGER = """
CREATE TRIGGER lmsp_task_events_notify AFTER INSERT ON task_events
FOR EACH ROW EXECUTE FUNCTION lmsp_notify_event()
"""


def install(task_events: Table) -> None:
    """Create the trigger whenever the `task_events` table is created on PostgreSQL."""
    for statement in (FUNCTION, TRIGGER):
        event.listen(task_events, "after_create", DDL(statement).execute_if(dialect="postgresql"))


def parse(payload: str) -> tuple[str, int] | None:
    """A notification's task id and sequence number (None if it is not one of ours)."""
    task_id, _, seq = payload.partition(" ")
    return (task_id, int(seq)) if task_id and seq.isdigit() else None
