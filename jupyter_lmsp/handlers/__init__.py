"""Tornado handlers for `{base_url}lmsp/v1/`: thin — authorize, validate, call a service, write.

The route table is `routes.py`; each endpoint method declares its operation (`base.operation`).
"""
