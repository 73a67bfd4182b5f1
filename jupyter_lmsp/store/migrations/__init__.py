"""The schema's migrations (Alembic): `versions/` holds one module per schema revision.

`jupyter_lmsp.store.schema` runs them; nothing here is imported by the service otherwise.
"""
