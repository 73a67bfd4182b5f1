"""The Python client of the LMSP service, for notebooks and programs.

    from jupyter_lmsp.client import connect
    lmsp = connect()                  # in a kernel: the Jupyter server it belongs to
    r = lmsp.start_response("Tell me a story.")
    r                                 # shown as a live TaskWatcher in JupyterLab
    lmsp.openai_client().responses.create(input="Hi")

`connect(url, token)` (or `LMSP_URL` / `LMSP_TOKEN`) talks to a given server instead; see
`discovery` for how the kernel's own server is found. Objects returned are typed
(`objects.Response`, `Task`, `Event`, …); errors are `APIError`.
"""

from __future__ import annotations

import threading
from typing import Any

from .api import Client
from .discovery import ServerInfo, find_server
from .errors import APIError, LMSPClientError, SequenceGapError, ServerNotFoundError
from .follow import EventFollower
from .objects import (
    Event,
    EventPage,
    Model,
    PairedClient,
    Pairing,
    Response,
    ServiceInfo,
    Task,
    Usage,
)
from .pairing import PairingDeniedError, PairingRequest, PairingToken, request_pairing
from .pairing import wait_for_token as wait_for_pairing_token
from .sandbox import SandboxServer

_default: Client | None = None
_default_lock = threading.Lock()


def connect(url: str | None = None, token: str | None = None, **kwargs: Any) -> Client:
    """A client of the service: of `url` if given, else of the kernel's own Jupyter server.

    The first client made without arguments becomes the default one that widgets use when
    they are given only an id.
    """
    global _default
    client = Client(url, token, **kwargs)
    with _default_lock:
        if _default is None:
            _default = client
    return client


def default_client() -> Client:
    """The client widgets use when none is given (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Client()
        return _default


def set_default_client(client: Client | None) -> None:
    global _default
    with _default_lock:
        _default = client


def openai_client(**kwargs: Any) -> Any:
    """An `openai.OpenAI` already pointed at the service of the default client."""
    return default_client().openai_client(**kwargs)


__all__ = [
    "APIError",
    "Client",
    "Event",
    "EventFollower",
    "EventPage",
    "LMSPClientError",
    "Model",
    "PairedClient",
    "Pairing",
    "PairingDeniedError",
    "PairingRequest",
    "PairingToken",
    "Response",
    "SandboxServer",
    "SequenceGapError",
    "ServerInfo",
    "ServerNotFoundError",
    "ServiceInfo",
    "Task",
    "Usage",
    "connect",
    "default_client",
    "find_server",
    "openai_client",
    "request_pairing",
    "set_default_client",
    "wait_for_pairing_token",
]
