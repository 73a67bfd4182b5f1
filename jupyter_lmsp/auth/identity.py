"""Who a Jupyter-authenticated caller is, as an owner of tasks and responses (LMSP B12).

A Jupyter user owns rows as `jupyter:<username>`; a paired client as its client id
(`client_…`). The prefix keeps the two apart whatever a user is called.

Which username: JupyterHub (or any identity provider of its own) gives every user a stable
name, and that name is the owner, so two Hub users sharing a database never see each other's
tasks. Jupyter Server's own single-user providers (its token, its password) have one user —
whoever started the server — but name each browser session or token request with a random
`anonymous` name; there the owner is the user the server runs for (`$JUPYTERHUB_USER`, else
the operating-system user), the same on every request and after every restart.
`LMSPExtension.owner_from` chooses explicitly (`identity` or `server`).

What a Jupyter user may do comes from Jupyter Server's `Authorizer`, asked once per LMSP
scope (`jupyter_permission`), so a JupyterHub deployment's permissions apply.
"""

from __future__ import annotations

import functools
import getpass
import inspect
import os
from collections.abc import Iterable
from typing import Any

JUPYTER_PREFIX = "jupyter:"


def owner_id(username: str) -> str:
    """The owner id of the Jupyter user `username`."""
    return f"{JUPYTER_PREFIX}{username}"


def is_jupyter_owner(owner: str) -> bool:
    return owner.startswith(JUPYTER_PREFIX)


def server_user() -> str:
    """The user this server runs for: JupyterHub's name for it, else the OS user."""
    name = os.environ.get("JUPYTERHUB_USER")
    if name:
        return name
    return _os_user()


@functools.cache
def _os_user() -> str:
    """The OS user this process runs as (asked once: it reads the password database, and the
    answer cannot change while the process lives)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a bare container)
        return f"uid{os.getuid()}" if hasattr(os, "getuid") else "user"


def server_owner() -> str:
    """The owner id of the user this server runs for: who owns what release 0.1.0 wrote, and
    what `jupyter lmsp` on the command line acts as."""
    return owner_id(server_user())


def identity_names_users(identity_provider: Any) -> bool:
    """Whether this identity provider's usernames name real, distinct users.

    Jupyter Server's own providers (`jupyter_server.auth.*`) serve one user under random
    per-session names; any other (JupyterHub's) names its users.
    """
    module = type(identity_provider).__module__ or ""
    return not module.startswith("jupyter_server.")


def owner_for(user: Any, identity_provider: Any, owner_from: str = "auto") -> str:
    """The owner id of an authenticated Jupyter `user` (a `jupyter_server.auth.User`)."""
    if owner_from == "identity" or (
        owner_from == "auto" and identity_names_users(identity_provider)
    ):
        username = getattr(user, "username", None) or str(user)
        return owner_id(username)
    return server_owner()


# -- what Jupyter's authorizer grants --------------------------------------------------------


def jupyter_permission(scope: str) -> tuple[str, str]:
    """The (action, resource) Jupyter Server's `Authorizer` is asked about for an LMSP scope:
    `models:read` → ("read", "lmsp-models"), anything but `:read` → "write"
    (`clients:admin` → ("write", "lmsp-clients")). JupyterHub grants these as
    `custom:jupyter_server:<action>:<resource>` scopes (or all of them with `access:servers`).
    """
    area, _, verb = scope.partition(":")
    return ("read" if verb == "read" else "write"), f"lmsp-{area}"


async def jupyter_scopes(handler: Any, user: Any, scopes: Iterable[str]) -> frozenset[str]:
    """The LMSP scopes Jupyter Server's authorizer allows `user` (its default authorizer
    allows everything to an authenticated user; JupyterHub's follows the Hub's scopes)."""
    granted = set()
    for scope in scopes:
        action, resource = jupyter_permission(scope)
        allowed = handler.authorizer.is_authorized(handler, user, action, resource)
        if inspect.isawaitable(allowed):
            allowed = await allowed
        if allowed:
            granted.add(scope)
    return frozenset(granted)
