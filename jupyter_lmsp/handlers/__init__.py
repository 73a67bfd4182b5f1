"""Tornado handlers for `{base_url}lmsp/v1/`: thin — parse, authorize, call a service, write."""

from .routes import routes

__all__ = ["routes"]
