"""The model registry's rows (the `models` table of 11.1): metadata and digests, never files."""

from __future__ import annotations

from sqlalchemy import select
from sqlmodel import col

from .database import Database
from .tables import Model


def list_models(db: Database) -> list[Model]:
    with db.read() as session:
        return list(session.execute(select(Model).order_by(col(Model.id))).scalars())


def get_model(db: Database, model_id: str) -> Model | None:
    with db.read() as session:
        return session.get(Model, model_id)


def save_model(db: Database, model: Model) -> Model:
    with db.write() as session:
        session.merge(model)
    return model


def set_model_state(db: Database, model_id: str, state: str) -> None:
    with db.write() as session:
        model = session.get(Model, model_id)
        if model is not None and model.state != state:
            model.state = state
            session.add(model)


def delete_model(db: Database, model_id: str) -> Model | None:
    with db.write() as session:
        model = session.get(Model, model_id)
        if model is not None:
            session.delete(model)
        return model
