"""The seven tables of LMSP section 11.1, as SQLModel classes.

JSON-shaped columns hold JSON text; the store decodes them. Model files never enter the
database: `models` holds paths, sizes and sha256 digests only.
"""

from __future__ import annotations

from sqlalchemy import Column, Index, Text, UniqueConstraint
from sqlmodel import Field, SQLModel


class ServiceConfig(SQLModel, table=True):
    __tablename__ = "service_config"

    key: str = Field(primary_key=True)
    value: str = Field(sa_column=Column(Text, nullable=False))


class Client(SQLModel, table=True):
    __tablename__ = "clients"

    id: str = Field(primary_key=True)
    name: str
    token_hash: str = Field(index=True, unique=True)
    scopes: str = Field(sa_column=Column(Text, nullable=False))
    created_at: float
    last_used_at: float | None = None
    revoked_at: float | None = None
    # Who approved this client (a paired client's id, or the owner's). Revoking a client revokes
    # the clients it approved, so a token it minted cannot outlive its own revocation.
    approved_by: str | None = None


class Pairing(SQLModel, table=True):
    """A pairing request (LMSP B3, shaped like the RFC 8628 device flow). Only a hash of the
    device code is kept; the user code is not a secret (the owner reads it in the sidebar)."""

    __tablename__ = "pairings"

    id: str = Field(primary_key=True)
    client_name: str
    requested_scopes: str = Field(sa_column=Column(Text, nullable=False))
    granted_scopes: str | None = Field(default=None, sa_column=Column(Text))
    user_code: str = Field(index=True)
    device_code_hash: str
    status: str = "pending"  # pending | approved | denied | claimed
    interval: int = 5
    failed_attempts: int = 0
    last_polled_at: float | None = None
    client_id: str | None = None
    created_at: float
    expires_at: float
    decided_at: float | None = None
    # Who started it (a paired client's id, the owner's, or None without credentials) and who
    # decided it: a client may not approve a pairing it started itself.
    started_by: str | None = None
    decided_by: str | None = None


class Model(SQLModel, table=True):
    __tablename__ = "models"

    id: str = Field(primary_key=True)
    format: str
    path: str
    size_bytes: int = 0
    digest: str = ""
    files: str = Field(default="[]", sa_column=Column(Text, nullable=False))
    state: str = "available"
    source: str = ""
    owned_by: str = "owner"
    created_at: float
    # True only for a directory the service created itself (a GGUF conversion into its model
    # folder, with a marker file naming the model). Only such a directory is ever deleted.
    managed: bool = False


class Response(SQLModel, table=True):
    __tablename__ = "responses"

    id: str = Field(primary_key=True)
    task_id: str = Field(index=True)
    owner: str = Field(index=True)
    model: str
    request: str = Field(sa_column=Column(Text, nullable=False))
    output: str = Field(default="[]", sa_column=Column(Text, nullable=False))
    usage: str | None = Field(default=None, sa_column=Column(Text))
    error: str | None = Field(default=None, sa_column=Column(Text))
    incomplete_reason: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    created_at: float
    completed_at: float | None = None


class Task(SQLModel, table=True):
    __tablename__ = "tasks"
    __table_args__ = (Index("ix_tasks_state_created", "state", "created_at"),)

    id: str = Field(primary_key=True)
    kind: str
    state: str
    on_restart: str
    owner: str = Field(index=True)
    model: str
    response_id: str | None = Field(default=None, index=True)
    params: str = Field(default="{}", sa_column=Column(Text, nullable=False))
    # What resuming needs: generated token ids and the text already emitted for them. Written in
    # the same transaction as the events it covers (LMSP B7).
    snapshot: str | None = Field(default=None, sa_column=Column(Text))
    error: str | None = Field(default=None, sa_column=Column(Text))
    next_sequence: int = 0
    attempts: int = 0
    created_at: float
    updated_at: float
    finished_at: float | None = Field(default=None, index=True)


class TaskEvent(SQLModel, table=True):
    __tablename__ = "task_events"
    __table_args__ = (UniqueConstraint("task_id", "sequence_number"),)

    id: int | None = Field(default=None, primary_key=True)
    task_id: str
    sequence_number: int
    type: str
    data: str = Field(sa_column=Column(Text, nullable=False))
    created_at: float


class IdempotencyKey(SQLModel, table=True):
    __tablename__ = "idempotency_keys"

    caller: str = Field(primary_key=True)
    key: str = Field(primary_key=True)
    request_digest: str
    # Set for a request whose result is a response still being generated (plain or streamed):
    # the result is that response once it finishes.
    response_id: str | None = None
    status_code: int | None = None
    body: str | None = Field(default=None, sa_column=Column(Text))
    headers: str | None = Field(default=None, sa_column=Column(Text))
    created_at: float
    expires_at: float = Field(index=True)
