"""Alembic's environment for the LMSP store: runs the migrations on the connection that
`jupyter_lmsp.store.schema` hands over in `config.attributes["connection"]`, inside the
transaction it already began (so every migration of an upgrade commits together, or none)."""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

from jupyter_lmsp.store import tables  # noqa: F401  (registers the tables on SQLModel.metadata)

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "The LMSP migrations run through jupyter_lmsp.store.schema (the server does it at "
        "start-up), not through the alembic command line."
    )
context.configure(
    connection=connection,
    target_metadata=SQLModel.metadata,
    render_as_batch=True,
    transaction_per_migration=False,
)
with context.begin_transaction():
    context.run_migrations()
