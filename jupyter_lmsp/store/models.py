"""The model registry's rows (the `models` table of 11.1): metadata and digests, never files."""

from __future__ import annotations

from sqlalchemy import bindparam, delete, select, update
from sqlalchemy.engine import Connection

from .database import Database
from .records import get, records, table, upsert
from .tables import Model

_models = table(Model)
_ALL = select(_models).order_by(_models.c.id)
_SET_STATE = (
    update(_models)
    .where(_models.c.id == bindparam("model_id"), _models.c.state != bindparam("new_state"))
    .values(state=bindparam("new_state"))
)
_DELETE = delete(_models).where(_models.c.id == bindparam("model_id"))


def list_models(db: Database) -> list[Model]:
    with db.reading() as conn:
        return records(Model, conn.execute(_ALL))


def get_model(db: Database, model_id: str) -> Model | None:
    with db.reading() as conn:
        return get(conn, Model, model_id)


def save_model(db: Database, model: Model) -> Model:
    with db.writing() as conn:
        put_model(conn, model)
    return model


def put_model(conn: Connection, model: Model) -> None:
    """Insert `model`'s row or replace the one with its id, in the caller's transaction (a
    registration's row is written with the task's terminal event: `rules.Outcome.also`)."""
    upsert(conn, model)


def set_model_state(db: Database, model_id: str, state: str) -> None:
    with db.writing() as conn:
        conn.execute(_SET_STATE, {"model_id": model_id, "new_state": state})


def delete_model(db: Database, model_id: str) -> Model | None:
    with db.writing() as conn:
        model = get(conn, Model, model_id, for_update=True)
        if model is not None:
            conn.execute(_DELETE, {"model_id": model_id})
        return model
