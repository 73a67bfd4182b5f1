"""An identity provider and an authorizer that name several users, as JupyterHub's do.

JupyterHub's single-user server plugs into the same two extension points of Jupyter Server
(`ServerApp.identity_provider_class`, `ServerApp.authorizer_class`): its identity provider
turns a Hub token into the Hub user, and its authorizer answers from the user's Hub scopes
(`custom:jupyter_server:<action>:<resource>`). These stand-ins answer from two tables, so the
tests can have several Jupyter users on one server without running a Hub.
"""

from __future__ import annotations

from typing import Any

from jupyter_server.auth import Authorizer, IdentityProvider, User

# Token → username (sent as `Authorization: token <token>`).
USERS = {"alice-token": "alice", "bob-token": "bob", "carol-token": "carol"}
# What each user may do: (action, resource) pairs; "*" for anything.
GRANTS: dict[str, set[tuple[str, str]] | str] = {
    "alice": "*",
    "carol": "*",
    # bob may read everything of LMSP's, and change nothing.
    "bob": {
        ("read", "lmsp-models"),
        ("read", "lmsp-responses"),
        ("read", "lmsp-tasks"),
    },
}


class HubLikeIdentityProvider(IdentityProvider):
    def get_user(self, handler: Any) -> User | None:
        scheme, _, token = handler.request.headers.get("Authorization", "").partition(" ")
        name = USERS.get(token.strip()) if scheme.lower() == "token" else None
        if name is None:
            return None
        # A request authenticated by a token, not a cookie, needs no XSRF check (JupyterHub's
        # provider says the same of its tokens).
        handler._token_authenticated = True
        return User(username=name, name=name.title())


class HubLikeAuthorizer(Authorizer):
    def is_authorized(self, handler: Any, user: User, action: str, resource: str) -> bool:
        grants = GRANTS.get(user.username, set())
        return grants == "*" or (action, resource) in grants
