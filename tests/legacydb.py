"""A database as release 0.1.0 left it, for the upgrade tests (test_migrations.py) and the
HTTP test that finds its rows after the upgrade (test_identity.py).

Its schema is frozen below exactly as 0.1.0's `create_all` made it; its rows are made by the
rule functions of today (in a scratch store) and copied column by column into 0.1.0's tables,
with every owner the one user 0.1.0 had, `"owner"`.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from storehelpers import POLICIES, UNFINISHED, make_task, new_task, open_db

from jupyter_lmsp.store import rules
from jupyter_lmsp.store.tables import IdempotencyKey

# The schema release 0.1.0 created (`SQLModel.metadata.create_all` of its store/tables.py),
# exactly as SQLite stored it.
RELEASE_0_1_0_DDL = """
CREATE TABLE service_config (
	"key" VARCHAR NOT NULL,
	value TEXT NOT NULL,
	PRIMARY KEY ("key")
);
CREATE TABLE clients (
	id VARCHAR NOT NULL,
	name VARCHAR NOT NULL,
	token_hash VARCHAR NOT NULL,
	scopes TEXT NOT NULL,
	created_at FLOAT NOT NULL,
	last_used_at FLOAT,
	revoked_at FLOAT,
	PRIMARY KEY (id)
);
CREATE UNIQUE INDEX ix_clients_token_hash ON clients (token_hash);
CREATE TABLE pairings (
	id VARCHAR NOT NULL,
	client_name VARCHAR NOT NULL,
	requested_scopes TEXT NOT NULL,
	granted_scopes TEXT,
	user_code VARCHAR NOT NULL,
	device_code_hash VARCHAR NOT NULL,
	status VARCHAR NOT NULL,
	interval INTEGER NOT NULL,
	failed_attempts INTEGER NOT NULL,
	last_polled_at FLOAT,
	client_id VARCHAR,
	created_at FLOAT NOT NULL,
	expires_at FLOAT NOT NULL,
	decided_at FLOAT,
	PRIMARY KEY (id)
);
CREATE INDEX ix_pairings_user_code ON pairings (user_code);
CREATE TABLE models (
	id VARCHAR NOT NULL,
	format VARCHAR NOT NULL,
	path VARCHAR NOT NULL,
	size_bytes INTEGER NOT NULL,
	digest VARCHAR NOT NULL,
	files TEXT NOT NULL,
	state VARCHAR NOT NULL,
	source VARCHAR NOT NULL,
	owned_by VARCHAR NOT NULL,
	created_at FLOAT NOT NULL,
	PRIMARY KEY (id)
);
CREATE TABLE responses (
	id VARCHAR NOT NULL,
	task_id VARCHAR NOT NULL,
	owner VARCHAR NOT NULL,
	model VARCHAR NOT NULL,
	request TEXT NOT NULL,
	output TEXT NOT NULL,
	usage TEXT,
	error TEXT,
	incomplete_reason VARCHAR,
	previous_response_id VARCHAR,
	store BOOLEAN NOT NULL,
	created_at FLOAT NOT NULL,
	completed_at FLOAT,
	PRIMARY KEY (id)
);
CREATE INDEX ix_responses_owner ON responses (owner);
CREATE INDEX ix_responses_task_id ON responses (task_id);
CREATE TABLE tasks (
	id VARCHAR NOT NULL,
	kind VARCHAR NOT NULL,
	state VARCHAR NOT NULL,
	on_restart VARCHAR NOT NULL,
	owner VARCHAR NOT NULL,
	model VARCHAR NOT NULL,
	response_id VARCHAR,
	params TEXT NOT NULL,
	snapshot TEXT,
	error TEXT,
	next_sequence INTEGER NOT NULL,
	attempts INTEGER NOT NULL,
	created_at FLOAT NOT NULL,
	updated_at FLOAT NOT NULL,
	finished_at FLOAT,
	PRIMARY KEY (id)
);
CREATE INDEX ix_tasks_finished_at ON tasks (finished_at);
CREATE INDEX ix_tasks_state_created ON tasks (state, created_at);
CREATE INDEX ix_tasks_response_id ON tasks (response_id);
CREATE INDEX ix_tasks_owner ON tasks (owner);
CREATE TABLE task_events (
	id INTEGER NOT NULL,
	task_id VARCHAR NOT NULL,
	sequence_number INTEGER NOT NULL,
	type VARCHAR NOT NULL,
	data TEXT NOT NULL,
	created_at FLOAT NOT NULL,
	PRIMARY KEY (id),
	UNIQUE (task_id, sequence_number)
);
CREATE TABLE idempotency_keys (
	caller VARCHAR NOT NULL,
	"key" VARCHAR NOT NULL,
	request_digest VARCHAR NOT NULL,
	response_id VARCHAR,
	status_code INTEGER,
	body TEXT,
	headers TEXT,
	created_at FLOAT NOT NULL,
	expires_at FLOAT NOT NULL,
	PRIMARY KEY (caller, "key")
);
CREATE INDEX ix_idempotency_keys_expires_at ON idempotency_keys (expires_at);
"""

# The columns each table had in 0.1.0, in order (what an upgrade must keep intact).
V010_TABLES = {
    "service_config": ["key", "value"],
    "clients": [
        "id",
        "name",
        "token_hash",
        "scopes",
        "created_at",
        "last_used_at",
        "revoked_at",
    ],
    "pairings": [
        "id",
        "client_name",
        "requested_scopes",
        "granted_scopes",
        "user_code",
        "device_code_hash",
        "status",
        "interval",
        "failed_attempts",
        "last_polled_at",
        "client_id",
        "created_at",
        "expires_at",
        "decided_at",
    ],
    "models": [
        "id",
        "format",
        "path",
        "size_bytes",
        "digest",
        "files",
        "state",
        "source",
        "owned_by",
        "created_at",
    ],
    "responses": [
        "id",
        "task_id",
        "owner",
        "model",
        "request",
        "output",
        "usage",
        "error",
        "incomplete_reason",
        "previous_response_id",
        "store",
        "created_at",
        "completed_at",
    ],
    "tasks": [
        "id",
        "kind",
        "state",
        "on_restart",
        "owner",
        "model",
        "response_id",
        "params",
        "snapshot",
        "error",
        "next_sequence",
        "attempts",
        "created_at",
        "updated_at",
        "finished_at",
    ],
    "task_events": ["id", "task_id", "sequence_number", "type", "data", "created_at"],
    "idempotency_keys": [
        "caller",
        "key",
        "request_digest",
        "response_id",
        "status_code",
        "body",
        "headers",
        "created_at",
        "expires_at",
    ],
}
LEGACY_OWNER = "owner"
NEW_OWNER = "jupyter:alice"
# Which column of each table names the one user of 0.1.0.
OWNER_COLUMN = {"tasks": "owner", "responses": "owner", "idempotency_keys": "caller"}


def _plain(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def release_0_1_0_database(path: Path, scratch: Path) -> None:
    """A database as release 0.1.0 left it: its schema, and rows of every kind, tasks in
    every state under every policy with their events and responses, made by the rule
    functions (in a scratch store) and copied column by column into 0.1.0's tables."""
    db = open_db(scratch, "scratch.sqlite")
    for state in (*UNFINISHED, "completed", "failed", "cancelled"):
        for policy in POLICIES:
            make_task(db, state, policy)
    make_task(db, "cancelled", via="queued")
    now = time.time()
    rules.create_task(
        db,
        *_task_with_response(),
        idempotency=IdempotencyKey(
            caller=LEGACY_OWNER,
            key="k-replay",
            request_digest="d1",
            status_code=202,
            body='{"id": "resp_x"}',
            headers="{}",
            created_at=now,
            expires_at=now + 3600,
        ),
    )
    db.dispose()
    src = _plain(scratch / "scratch.sqlite")
    dst = _plain(path)
    dst.executescript(RELEASE_0_1_0_DDL)
    dst.execute("BEGIN")
    for table in ("tasks", "responses", "task_events", "idempotency_keys"):
        columns = V010_TABLES[table]
        quoted = ", ".join(f'"{c}"' for c in columns)
        marks = ", ".join("?" * len(columns))
        for row in src.execute(f"SELECT {quoted} FROM {table}"):
            values = dict(zip(columns, row, strict=True))
            if table in OWNER_COLUMN:
                values[OWNER_COLUMN[table]] = LEGACY_OWNER
            dst.execute(f"INSERT INTO {table} ({quoted}) VALUES ({marks})", list(values.values()))
    dst.execute(
        "INSERT INTO service_config VALUES ('service_id', ?)", (json.dumps("svc_0123456789"),)
    )
    dst.execute(
        "INSERT INTO models VALUES ('tiny', 'mlx', '/models/tiny', 1234, 'sha256:ab',"
        ' \'[{"path": "config.json", "size": 1234, "sha256": "ab"}]\', \'available\','
        " '/models/tiny', 'owner', ?)",
        (now,),
    )
    dst.execute(
        "INSERT INTO clients VALUES ('client_1', 'notebook', 'hash1', '[\"responses:read\"]',"
        " ?, ?, NULL)",
        (now, now),
    )
    dst.execute(
        "INSERT INTO clients VALUES ('client_2', 'old script', 'hash2', '[]', ?, NULL, ?)",
        (now, now),
    )
    dst.execute(
        "INSERT INTO pairings VALUES ('pair_1', 'notebook', '[\"responses:read\"]',"
        " '[\"responses:read\"]', 'BCDF-GHJK', 'dch', 'claimed', 5, 0, ?, 'client_1', ?, ?, ?)",
        (now, now, now + 600, now),
    )
    dst.execute(
        "INSERT INTO pairings VALUES ('pair_2', 'pending one', '[\"tasks:read\"]', NULL,"
        " 'LMNP-QRST', 'dch2', 'pending', 5, 1, NULL, NULL, ?, ?, NULL)",
        (now, now + 600),
    )
    dst.execute(
        "INSERT INTO idempotency_keys VALUES (?, 'k-claim', 'd2', NULL, NULL, NULL, NULL, ?, ?)",
        (LEGACY_OWNER, now, now + 3600),
    )
    dst.execute("COMMIT")
    src.close()
    dst.close()


def _task_with_response():
    return new_task("resume")
