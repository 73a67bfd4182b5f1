"""Jupyter's own authorization and per-user ownership (LMSP B12), through a real in-process
Jupyter Server (`jp_fetch`).

What these tests prove:

- with an identity provider that names its users (as JupyterHub's does), each Jupyter user
  owns what it creates (`jupyter:<username>`), and two users sharing a database never see,
  list, stream, cancel or delete each other's tasks and responses (404, as for anyone else's);
- a Jupyter user's scopes are what Jupyter Server's authorizer grants it: a user allowed only
  to read gets 403 `insufficient_scope` on writes;
- a pairing records who approved it: the client it makes is that user's, who sees (and may
  revoke) it and its tasks, while the other user does neither; the client itself sees only
  its own tasks, not the user's;
- with Jupyter Server's own single-user provider (random per-session names), every request is
  the one user the server runs for;
- rows a release-0.1.0 database held for its one user are that user's after the upgrade.
"""

from __future__ import annotations

import pytest
from jpserver import ServerPool, call, server_config
from legacydb import release_0_1_0_database
from prerequisites import require

from jupyter_lmsp.auth.identity import server_owner

pytest_plugins = ["pytest_jupyter.jupyter_server"]

ALICE = {"Authorization": "token alice-token"}
BOB = {"Authorization": "token bob-token"}
CAROL = {"Authorization": "token carol-token"}


def hub_config(data_dir, request):
    config = server_config(data_dir, request)
    config["ServerApp"].update(
        {
            "identity_provider_class": "hubidentity.HubLikeIdentityProvider",
            "authorizer_class": "hubidentity.HubLikeAuthorizer",
        }
    )
    return config


async def create(jp_fetch, headers, **body):
    body = {"input": "hi", "background": True, "max_output_tokens": 4, **body}
    status, resp, _ = await call(jp_fetch, "POST", "responses", body, headers=headers)
    assert status == 202, resp
    return resp


async def task_ids(jp_fetch, headers):
    """The ids of the tasks `headers`' caller sees, newest first."""
    status, page, _ = await call(jp_fetch, "GET", "tasks", params={"limit": 100}, headers=headers)
    assert status == 200, page
    return [t["id"] for t in page["data"]]


class TestHubUsers:
    """One server for the class's tests: what a user sees is compared with what the user saw
    before the test (`task_ids`), not with an empty database."""

    @pytest.fixture(scope="class")
    @classmethod
    def server_pool(cls, tmp_path_factory, test_model_dir):
        with ServerPool(tmp_path_factory, test_model_dir) as pool:
            yield pool

    @pytest.fixture(scope="class")
    @classmethod
    def hub_db_url(cls):
        """The database the class's server uses instead of its own SQLite file, if any."""
        return None

    @pytest.fixture
    def jp_fetch(self, server_pool, hub_db_url, request):
        def config(data_dir):
            config = hub_config(data_dir, request)
            if hub_db_url is not None:
                config["LMSPExtension"]["db_url"] = hub_db_url
            return config

        client = server_pool.get(None, config).client()
        yield client.fetch
        client.close()

    async def test_two_users_never_see_each_others_tasks(self, jp_fetch):
        before = await task_ids(jp_fetch, ALICE)
        mine = await create(jp_fetch, ALICE)
        _, task, _ = await call(jp_fetch, "GET", f"tasks/{mine['task_id']}", headers=ALICE)
        assert task["owner"] == "jupyter:alice"

        for method, path in (
            ("GET", f"responses/{mine['id']}"),
            ("GET", f"tasks/{mine['task_id']}"),
            ("GET", f"tasks/{mine['task_id']}/events"),
            ("GET", f"responses/{mine['id']}/input_items"),
        ):
            status, body, _ = await call(jp_fetch, method, path, headers=BOB)
            assert status == 404, (path, body)
        status, page, _ = await call(jp_fetch, "GET", "tasks", headers=BOB)
        assert status == 200 and page["data"] == []
        assert await task_ids(jp_fetch, ALICE) == [mine["task_id"], *before]

    async def test_scopes_come_from_jupyters_authorizer(self, jp_fetch):
        status, body, _ = await call(jp_fetch, "POST", "responses", {"input": "hi"}, headers=BOB)
        assert status == 403 and body["error"]["code"] == "insufficient_scope"
        assert "responses:write" in body["error"]["message"]
        status, _, _ = await call(jp_fetch, "GET", "models", headers=BOB)
        assert status == 200
        status, body, _ = await call(jp_fetch, "GET", "clients", headers=BOB)
        assert status == 403
        mine = await create(jp_fetch, ALICE)
        status, body, _ = await call(
            jp_fetch, "POST", f"tasks/{mine['task_id']}/cancel", headers=BOB
        )
        assert status == 403  # tasks:write is not bob's, whoever's task it is

    async def test_a_paired_client_belongs_to_who_approved_it(self, jp_fetch):
        status, started, _ = await call(
            jp_fetch,
            "POST",
            "pairings",
            {"client_name": "alice's notebook", "scopes": ["responses:write", "tasks:read"]},
            headers={"Authorization": ""},
        )
        assert status == 201, started
        status, approved, _ = await call(
            jp_fetch, "POST", f"pairings/{started['id']}/approve", headers=ALICE
        )
        assert status == 200, approved
        status, token, _ = await call(
            jp_fetch,
            "POST",
            f"pairings/{started['id']}/token",
            {"device_code": started["device_code"]},
            headers={"Authorization": ""},
        )
        assert status == 200, token
        client = {"Authorization": f"Bearer {token['access_token']}"}

        before = await task_ids(jp_fetch, ALICE)
        theirs = await create(jp_fetch, client)
        own = await create(jp_fetch, ALICE)
        # Alice sees her client and its task; the client sees only its own.
        _, clients, _ = await call(jp_fetch, "GET", "clients", headers=ALICE)
        assert [c["id"] for c in clients["data"]] == [token["client_id"]]
        status, _, _ = await call(jp_fetch, "GET", f"tasks/{theirs['task_id']}", headers=ALICE)
        assert status == 200
        assert set(await task_ids(jp_fetch, ALICE)) == {theirs["task_id"], own["task_id"], *before}
        status, _, _ = await call(jp_fetch, "GET", f"tasks/{own['task_id']}", headers=client)
        assert status == 404
        _, page, _ = await call(jp_fetch, "GET", "tasks", headers=client)
        assert [t["id"] for t in page["data"]] == [theirs["task_id"]]
        # Another user, even one with every scope, sees neither the client nor its task, and
        # cannot revoke it.
        status, _, _ = await call(jp_fetch, "GET", f"tasks/{theirs['task_id']}", headers=CAROL)
        assert status == 404
        _, clients, _ = await call(jp_fetch, "GET", "clients", headers=CAROL)
        assert clients["data"] == []
        status, _, _ = await call(
            jp_fetch, "DELETE", f"clients/{token['client_id']}", headers=CAROL
        )
        assert status == 404
        # Alice may revoke her client.
        status, revoked, _ = await call(
            jp_fetch, "DELETE", f"clients/{token['client_id']}", headers=ALICE
        )
        assert status == 200 and revoked["revoked_at"] is not None


class TestHubUsersOnPostgres(TestHubUsers):
    """The same users on a shared PostgreSQL database (as a JupyterHub's servers share one)."""

    @pytest.fixture(scope="class")
    @classmethod
    def hub_db_url(cls, pg_cluster):
        require(
            pg_cluster is not None,
            "PostgreSQL (Debian's postgresql package; `make test` installs it)",
        )
        return pg_cluster.new_database()

    async def test_two_writing_users_each_see_only_their_own(self, jp_fetch):
        before = {
            "alice": await task_ids(jp_fetch, ALICE),
            "carol": await task_ids(jp_fetch, CAROL),
        }
        mine = [await create(jp_fetch, ALICE) for _ in range(2)]
        theirs = [await create(jp_fetch, CAROL) for _ in range(2)]
        for who, headers, own, other in (
            ("alice", ALICE, mine, theirs),
            ("carol", CAROL, theirs, mine),
        ):
            seen = await task_ids(jp_fetch, headers)
            assert set(seen) == {r["task_id"] for r in own} | set(before[who])
            for resp in other:
                for method, path in (
                    ("GET", f"responses/{resp['id']}"),
                    ("GET", f"tasks/{resp['task_id']}"),
                    ("GET", f"tasks/{resp['task_id']}/events"),
                    ("POST", f"tasks/{resp['task_id']}/cancel"),
                    ("DELETE", f"responses/{resp['id']}"),
                ):
                    status, body, _ = await call(jp_fetch, method, path, headers=headers)
                    assert status == 404, (method, path, body)


class TestSingleUserServer:
    @pytest.fixture
    def jp_server_config(self, lmsp_data, request):
        return server_config(lmsp_data, request)

    async def test_every_request_is_the_user_the_server_runs_for(self, jp_fetch):
        # Jupyter's own provider names each cookie-less token request anew; the owner stays.
        first = await create(jp_fetch, {})
        second = await create(jp_fetch, {})
        owners = set()
        for resp in (first, second):
            _, task, _ = await call(jp_fetch, "GET", f"tasks/{resp['task_id']}")
            owners.add(task["owner"])
        assert owners == {server_owner()}


class TestRowsOfRelease010:
    @pytest.fixture
    def jp_server_config(self, lmsp_data, request, tmp_path_factory):
        release_0_1_0_database(lmsp_data / "lmsp.sqlite", tmp_path_factory.mktemp("scratch"))
        return server_config(lmsp_data, request)

    async def test_are_the_server_users_after_the_upgrade(self, jp_fetch, lmsp_data):
        status, page, _ = await call(jp_fetch, "GET", "tasks", params={"limit": "100"})
        assert status == 200
        assert len(page["data"]) == 23  # every task of the old database
        assert {t["owner"] for t in page["data"]} == {server_owner()}
        first = page["data"][-1]
        status, resp, _ = await call(jp_fetch, "GET", f"responses/{first['response_id']}")
        assert status == 200 and resp["id"] == first["response_id"]
        assert list(lmsp_data.glob("lmsp.sqlite.backup-0001-*"))
