"""Helpers for the hardening tests (issue 12): pairing a client over HTTP, a client with its
token, waiting for a task, reading the server's database directly."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
from serverproc import http_client

ALL_SCOPES = [
    "models:read",
    "models:write",
    "responses:read",
    "responses:write",
    "tasks:read",
    "tasks:write",
    "clients:admin",
    "metrics:read",
]
TERMINAL_STATES = ("completed", "failed", "cancelled")


def pair(server: Any, name: str, scopes: list[str], grant: list[str] | None = None) -> dict:
    """The whole device flow over HTTP (start, the owner approves, one poll): the token answer."""
    with (
        http_client(base_url=server.api, timeout=30) as anon,
        server.client() as owner,
    ):
        started = anon.post("/pairings", json={"client_name": name, "scopes": scopes})
        assert started.status_code == 201, started.text
        p = started.json()
        body = {} if grant is None else {"scopes": grant}
        approved = owner.post(f"/pairings/{p['id']}/approve", json=body)
        assert approved.status_code == 200, approved.text
        token = anon.post(f"/pairings/{p['id']}/token", json={"device_code": p["device_code"]})
        assert token.status_code == 200, token.text
        return {**token.json(), "pairing": p}


def bearer(server: Any, token: str, **kw: Any) -> httpx.Client:
    kw.setdefault("timeout", 30)
    return http_client(base_url=server.api, headers={"Authorization": f"Bearer {token}"}, **kw)


def wait_task(client: httpx.Client, task_id: str, predicate=None, timeout: float = 120.0) -> dict:
    """The task once `predicate(task)` holds (default: it finished)."""
    predicate = predicate or (lambda t: t["state"] in TERMINAL_STATES)
    deadline = time.monotonic() + timeout
    while True:
        task = client.get(f"/tasks/{task_id}").json()
        if predicate(task):
            return task
        if time.monotonic() > deadline:
            raise AssertionError(f"task {task_id} never got there: {task}")
        time.sleep(0.05)


def events(client: httpx.Client, task_id: str) -> list[dict]:
    page = client.get(f"/tasks/{task_id}/events", params={"limit": 1000}).json()
    assert not page["has_more"]
    return page["data"]


def database(data_dir: Path) -> sqlite3.Connection:
    """A read connection on a (possibly running) server's database."""
    conn = sqlite3.connect(data_dir / "lmsp.sqlite", timeout=30)
    conn.row_factory = sqlite3.Row
    return conn
