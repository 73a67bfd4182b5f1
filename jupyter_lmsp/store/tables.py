"""The tables of LMSP section 11.1 (and `pairings`, `runners`), as SQLModel classes.

JSON-shaped columns hold JSON text; the store decodes them. Model files never enter the
database: `models` holds paths, sizes and sha256 digests only.

These classes are the schema's single description: a new database is created from them, and
`store/migrations/` carries every older database to them (tests/test_migrations.py checks
that the migrations, applied in order, give exactly this schema). A change here needs a
migration.

Foreign keys are real (SQLite enforces them: `PRAGMA foreign_keys=ON` on every connection).
A task and its response point at each other, so those two are checked at commit
(`DEFERRABLE INITIALLY DEFERRED`): a response is inserted before its task, and a purge deletes
both in one transaction in any order. Not every id is a row reference: `owner` is a caller (a
paired client's id or a Jupyter user), `tasks.model` a model's name that outlives the model,
`previous_response_id` a response retention may already have deleted, and an idempotency
key's `response_id` a result that may have been deleted since.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, Column, ForeignKey, Index, String, Text, UniqueConstraint
from sqlmodel import Field, SQLModel

from . import notify

# Foreign keys get names (SQLite keeps them in the table's SQL), so a migration can name the
# one it adds or drops. Only `fk`: the other constraints keep the names they always had.
_naming: dict[str, Any] = dict(SQLModel.metadata.naming_convention)
_naming["fk"] = "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s"
SQLModel.metadata.naming_convention = _naming


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
    # The Jupyter user it belongs to (LMSP B12: that user sees this client's tasks): who
    # approved it, or the user of the client that approved it.
    paired_by: str | None = Field(default=None, index=True)
    # Who approved this client (a paired client's id, or a Jupyter user's). Revoking a client
    # revokes the clients it approved, so a token it minted cannot outlive its own revocation.
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
    client_id: str | None = Field(default=None, foreign_key="clients.id", ondelete="SET NULL")
    created_at: float
    expires_at: float
    decided_at: float | None = None
    # Who decided it, and who started it (a paired client's id, a Jupyter user's, or None
    # without credentials): a client may not approve a pairing it started itself.
    decided_by: str | None = None
    started_by: str | None = None


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
    task_id: str = Field(
        sa_column=Column(
            String,
            ForeignKey("tasks.id", deferrable=True, initially="DEFERRED", use_alter=True),
            index=True,
            nullable=False,
        )
    )
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
    # The conversation the response's turn joins when it completes (`conversation` on
    # `POST /responses`); not a row reference: the conversation may be deleted meanwhile.
    conversation_id: str | None = None


class Task(SQLModel, table=True):
    __tablename__ = "tasks"
    __table_args__ = (
        Index("ix_tasks_state_created", "state", "created_at"),
        Index("ix_tasks_runner_state", "runner_id", "state"),
    )

    id: str = Field(primary_key=True)
    kind: str
    state: str
    on_restart: str
    owner: str = Field(index=True)
    model: str
    response_id: str | None = Field(
        default=None,
        sa_column=Column(
            String,
            ForeignKey("responses.id", deferrable=True, initially="DEFERRED"),
            index=True,
        ),
    )
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
    # The process that drives this unfinished task (LMSP B12): set by the transaction that
    # takes it (its creation, or a recovery that adopts it), cleared by the one that ends it.
    # Only that runner's commits to the task count.
    runner_id: str | None = Field(default=None, foreign_key="runners.id", ondelete="SET NULL")
    # The request's `prompt_cache_key` (at most 64 characters), fixed at creation: a routing
    # hint for the shared queue, whose claim (`rules.claim_tasks`) gives a worker the tasks of
    # the keys it served recently first. No index: the claim reads the claimable tasks anyway.
    cache_key: str | None = Field(default=None, sa_column=Column(String(64)))
    # The characters a finished task keeps (its events' data and its response's output), counted
    # once, the first time its owner's storage quota is checked after it finished
    # (`quotas.usage`): a finished task's events and output never change again.
    stored_bytes: int | None = Field(default=None, sa_column=Column(BigInteger))


class TaskEvent(SQLModel, table=True):
    __tablename__ = "task_events"
    __table_args__ = (UniqueConstraint("task_id", "sequence_number"),)

    id: int | None = Field(default=None, primary_key=True)
    task_id: str = Field(foreign_key="tasks.id", ondelete="CASCADE")
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
    # The process handling the request while the key is claimed and has no result yet; such a
    # claim dies with its process (recovery releases it). Cleared once a result is written.
    runner_id: str | None = Field(default=None, foreign_key="runners.id", ondelete="SET NULL")


class Runner(SQLModel, table=True):
    """A process that drives tasks (LMSP B12): today a Jupyter server's task runner.

    It holds a lease it renews (`heartbeat_at`, `lease_expires_at`). A runner whose lease
    expired, or whose process is provably gone (same `host` and `boot_id`, and no process
    `pid` started at `process_started_at`), is dead: the 11.3 table is applied to its tasks
    and its row deleted, in one transaction.
    """

    __tablename__ = "runners"

    id: str = Field(primary_key=True)
    kind: str  # "server"
    host: str
    boot_id: str
    pid: int
    process_started_at: float
    label: str = ""
    started_at: float
    heartbeat_at: float
    lease_expires_at: float


class Conversation(SQLModel, table=True):
    """A conversation (OpenAI's Conversations API): its items are `conversation_items`."""

    __tablename__ = "conversations"

    id: str = Field(primary_key=True)
    owner: str = Field(index=True)
    # The conversation's `metadata` (JSON text; `metadata` is SQLModel's own attribute).
    labels: str = Field(default="{}", sa_column=Column(Text, nullable=False))
    created_at: float
    # The position the next item gets: items keep the order they were added in.
    next_position: int = 0


class ConversationItem(SQLModel, table=True):
    """One item of a conversation (its wire JSON, with its `id`), at its position. An item a
    response's turn added names that response (`response_id`)."""

    __tablename__ = "conversation_items"
    __table_args__ = (UniqueConstraint("conversation_id", "position"),)

    id: str = Field(primary_key=True)
    conversation_id: str = Field(foreign_key="conversations.id", ondelete="CASCADE")
    position: int
    item: str = Field(sa_column=Column(Text, nullable=False))
    response_id: str | None = None
    created_at: float


class WebhookEndpoint(SQLModel, table=True):
    """A URL the owner registered to be told of its responses' ends (issue 38), with the
    events it wants (a JSON list) and its Standard Webhooks secret (`whsec_…`), kept to sign
    with and shown only when the endpoint is created."""

    __tablename__ = "webhook_endpoints"

    id: str = Field(primary_key=True)
    # The Jupyter user (`jupyter:<name>`) it belongs to: it is sent the ends of that user's
    # responses and of the clients that user paired.
    owner: str = Field(index=True)
    url: str = Field(sa_column=Column(Text, nullable=False))
    events: str = Field(sa_column=Column(Text, nullable=False))
    secret: str = Field(sa_column=Column(Text, nullable=False))
    description: str = ""
    enabled: bool = True
    created_at: float
    updated_at: float


class WebhookDelivery(SQLModel, table=True):
    """The outbox: one event to deliver to one endpoint, written in the transaction that
    writes the task's terminal event (`store.webhooks.enqueue`). Its `event_id` is the
    `webhook-id` of every attempt; `payload` the exact body sent each time."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint("endpoint_id", "event_id"),
        Index("ix_webhook_deliveries_state_due", "state", "next_attempt_at"),
    )

    id: str = Field(primary_key=True)
    endpoint_id: str = Field(foreign_key="webhook_endpoints.id", ondelete="CASCADE", index=True)
    event_id: str
    event_type: str
    response_id: str | None = None
    payload: str = Field(sa_column=Column(Text, nullable=False))
    state: str = "pending"  # pending | delivered | dead
    attempts: int = 0
    next_attempt_at: float
    # The server delivering it now, until `lease_until`; its row's deletion (a dead runner's
    # recovery) frees the claim at once.
    claimed_by: str | None = Field(default=None, foreign_key="runners.id", ondelete="SET NULL")
    lease_until: float | None = None
    last_status: int | None = None
    last_error: str | None = Field(default=None, sa_column=Column(Text))
    created_at: float
    updated_at: float
    delivered_at: float | None = None


# On PostgreSQL, every committed event is announced to the servers listening (store.notify).
notify.install(TaskEvent.__table__)  # type: ignore[attr-defined]
