"""`Client`: a small synchronous Python API over the LMSP endpoints, returning typed objects.

One `httpx.Client` per `Client` (httpx's connection pool is safe to share between the threads
that widgets follow tasks in). The Jupyter user authenticates with the server's own token
(`Authorization: token …`) and acts as the owner; a paired program uses its access token
(`Authorization: Bearer …`, see `Client.paired`).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx

from .discovery import ServerInfo, find_server, normalize_url
from .errors import APIError
from .follow import EventFollower, StatusCallback
from .objects import (
    Event,
    EventPage,
    Model,
    PairedClient,
    Pairing,
    Response,
    ServiceInfo,
    Task,
)
from .sse import parse_sse

DEFAULT_TIMEOUT = 30.0
# SSE keep-alives come every 15 s by default; a stream silent for longer than this is dead.
STREAM_READ_TIMEOUT = 60.0

_UNSET: Any = object()


class _HTTPEventStream:
    """An open SSE response, closable from another thread."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for message in parse_sse(self.response.iter_lines()):
            yield message.json()

    def close(self) -> None:
        self.response.close()


class _TaskEventSource:
    """The `EventSource` of one task, over HTTP."""

    def __init__(self, client: Client, task_id: str) -> None:
        self.client = client
        self.task_id = task_id

    def stream(self, after: int) -> _HTTPEventStream:
        return self.client._open_stream(
            "GET",
            f"/tasks/{self.task_id}/events",
            params={"stream": "true"},
            headers={"Last-Event-ID": str(after)},
        )

    def page(self, after: int, limit: int) -> tuple[list[dict[str, Any]], bool]:
        body = self.client._request(
            "GET", f"/tasks/{self.task_id}/events", params={"after": after, "limit": limit}
        )
        return body["data"], bool(body.get("has_more"))


class Client:
    """The LMSP service of one Jupyter server.

    `Client()` inside a notebook finds the server its kernel belongs to; `Client(url, token)`
    talks to a given one (see `discovery.find_server`).
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        scheme: str = "token",
        timeout: float = DEFAULT_TIMEOUT,
        server: ServerInfo | None = None,
    ) -> None:
        self.server = server or find_server(url, token)
        self.token = self.server.token
        self.scheme = scheme
        self.timeout = timeout
        headers = {"User-Agent": "jupyter-lmsp-client"}
        if self.token:
            headers["Authorization"] = f"{scheme} {self.token}"
        self._http = httpx.Client(base_url=self.api_url, headers=headers, timeout=timeout)

    @classmethod
    def paired(cls, url: str, access_token: str, **kwargs: Any) -> Client:
        """A client acting as a paired program, with the access token pairing gave it."""
        server = ServerInfo(normalize_url(url), access_token, "explicit")
        return cls(server=server, scheme="Bearer", **kwargs)

    @property
    def url(self) -> str:
        """The Jupyter server's URL (base_url included)."""
        return self.server.url

    @property
    def api_url(self) -> str:
        """The LMSP API root, `{url}lmsp/v1`."""
        return self.server.api_url

    def __repr__(self) -> str:
        return f"Client(url={self.url!r}, source={self.server.source!r})"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport -------------------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        timeout: Any = _UNSET,
    ) -> Any:
        kwargs: dict[str, Any] = {"params": params, "headers": headers}
        if json_body is not None:
            kwargs["json"] = json_body
        if timeout is not _UNSET:
            kwargs["timeout"] = timeout
        r = self._http.request(method, path, **kwargs)
        if r.status_code >= 400:
            raise _api_error(r)
        return r.json() if r.content else None

    def _open_stream(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> _HTTPEventStream:
        request = self._http.build_request(
            method,
            path,
            json=json_body,
            params=params,
            headers={"Accept": "text/event-stream", **(headers or {})},
            timeout=httpx.Timeout(self.timeout, read=STREAM_READ_TIMEOUT),
        )
        r = self._http.send(request, stream=True)
        if r.status_code >= 400:
            r.read()
            r.close()
            raise _api_error(r)
        return _HTTPEventStream(r)

    # -- service and models ----------------------------------------------------------------

    def service(self) -> ServiceInfo:
        return ServiceInfo.from_wire(self._request("GET", "/service"))

    def models(self) -> list[Model]:
        return [Model.from_wire(m) for m in self._request("GET", "/models")["data"]]

    def model(self, model_id: str) -> Model:
        return Model.from_wire(self._request("GET", f"/models/{model_id}"))

    def register_model(self, source: str, model_id: str | None = None) -> Task:
        """Start registering a model (`POST /models`): a local folder, a cached repo id, a GGUF
        file, or `hf://ORG/NAME[@REVISION]` to download; the registration task (follow it
        for `task.progress`, `wait()` for its end)."""
        body: dict[str, Any] = {"source": source}
        if model_id is not None:
            body["id"] = model_id
        return Task.from_wire(self._request("POST", "/models", json_body=body), self)

    def load_model(self, model_id: str, keep_alive: float | None = None) -> Model:
        """Load a model into the server's inference worker now (`state` becomes `loaded`);
        `keep_alive`: seconds it stays loaded once idle (0: not kept; negative: until evicted)."""
        body = {} if keep_alive is None else {"keep_alive": keep_alive}
        return Model.from_wire(self._request("POST", f"/models/{model_id}/load", json_body=body))

    def unload_model(self, model_id: str) -> Model:
        """Unload a model from the worker now (refused while work on it runs: `model_busy`)."""
        return Model.from_wire(self._request("POST", f"/models/{model_id}/unload", json_body={}))

    # -- responses -------------------------------------------------------------------------

    @staticmethod
    def _response_body(input: Any, **fields: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"input": input}
        body.update({k: v for k, v in fields.items() if v is not None})
        return body

    def create_response(
        self,
        input: str | list[dict[str, Any]],
        *,
        model: str | None = None,
        instructions: str | None = None,
        background: bool = False,
        max_output_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        on_restart: str | None = None,
        metadata: dict[str, str] | None = None,
        store: bool | None = None,
        previous_response_id: str | None = None,
        idempotency_key: str | None = None,
        **fields: Any,
    ) -> Response:
        """`POST /responses`. With `background=True` it returns at once (status `queued`);
        otherwise it waits for the finished response. Other request fields (`tools`,
        `tool_choice`, `text`, `stop`, `include`, `top_logprobs`, …) go in `fields`, as the
        API takes them."""
        body = self._response_body(
            input,
            **fields,
            model=model,
            instructions=instructions,
            background=background or None,
            max_output_tokens=max_output_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            on_restart=on_restart,
            metadata=metadata,
            store=store,
            previous_response_id=previous_response_id,
        )
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        data = self._request(
            "POST",
            "/responses",
            json_body=body,
            headers=headers,
            # A plain create answers when generation is over, however long that takes.
            timeout=None if not background else _UNSET,
        )
        return Response.from_wire(data, self)

    def start_response(self, input: str | list[dict[str, Any]], **kwargs: Any) -> Response:
        """A background response (`background=True`): the task is stored before this returns.

        An `Idempotency-Key` is generated unless given, so a retried call cannot start two.
        """
        kwargs.setdefault("idempotency_key", f"py-{uuid.uuid4()}")
        return self.create_response(input, background=True, **kwargs)

    def stream_response(self, input: str | list[dict[str, Any]], **kwargs: Any) -> Iterator[Event]:
        """`POST /responses` with `stream: true`: the events as they are generated."""
        idempotency_key = kwargs.pop("idempotency_key", None)
        body = self._response_body(input, stream=True, **kwargs)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        stream = self._open_stream("POST", "/responses", json_body=body, headers=headers)
        try:
            for raw in stream:
                event = Event.from_wire(raw)
                yield event
                if event.terminal:
                    return
        finally:
            stream.close()

    def stream_text(self, input: str | list[dict[str, Any]], **kwargs: Any) -> Iterator[str]:
        """Only the text deltas of `stream_response`."""
        for event in self.stream_response(input, **kwargs):
            if event.delta:
                yield event.delta

    def get_response(self, response_id: str) -> Response:
        return Response.from_wire(self._request("GET", f"/responses/{response_id}"), self)

    def cancel_response(self, response_id: str) -> Response:
        return Response.from_wire(self._request("POST", f"/responses/{response_id}/cancel"), self)

    def delete_response(self, response_id: str) -> None:
        self._request("DELETE", f"/responses/{response_id}")

    # -- tasks -----------------------------------------------------------------------------

    def tasks(
        self,
        state: str | list[str] | None = None,
        *,
        kind: str | None = None,
        limit: int | None = None,
    ) -> list[Task]:
        """Tasks, newest first, optionally filtered by state(s) and kind; every page is read
        unless `limit` caps the number."""
        states = [state] if isinstance(state, str) else list(state or [])
        out: list[Task] = []
        after: str | None = None
        while True:
            page_size = 100 if limit is None else max(1, min(100, limit - len(out)))
            params: dict[str, Any] = {"limit": page_size}
            if states:
                params["state"] = ",".join(states)
            if kind:
                params["kind"] = kind
            if after:
                params["after"] = after
            page = self._request("GET", "/tasks", params=params)
            out.extend(Task.from_wire(t, self) for t in page["data"])
            if not page.get("has_more") or not page["data"]:
                return out
            if limit is not None and len(out) >= limit:
                return out[:limit]
            after = page["last_id"]

    def lifecycle(self, after: int | None = None) -> _HTTPEventStream:
        """`GET /lifecycle`: every task of this caller created, changing state and ending, as
        an open stream of event dicts (iterate it; `close()` it from any thread). From now on,
        or after `after` (an earlier event's `sequence_number`), missing nothing."""
        headers = {} if after is None else {"Last-Event-ID": str(after)}
        return self._open_stream("GET", "/lifecycle", headers=headers)

    def get_task(self, task_id: str) -> Task:
        return Task.from_wire(self._request("GET", f"/tasks/{task_id}"), self)

    def cancel_task(self, task_id: str) -> Task:
        return Task.from_wire(self._request("POST", f"/tasks/{task_id}/cancel"), self)

    def events(self, task_id: str, after: int = -1, limit: int = 100) -> EventPage:
        """One JSON page of a task's stored events after sequence number `after`."""
        body = self._request(
            "GET", f"/tasks/{task_id}/events", params={"after": after, "limit": limit}
        )
        return EventPage(
            data=[Event.from_wire(e) for e in body["data"]],
            has_more=bool(body.get("has_more")),
            last_sequence_number=int(body.get("last_sequence_number", after)),
        )

    def all_events(self, task_id: str, after: int = -1) -> list[Event]:
        """Every stored event of a task after `after`."""
        out: list[Event] = []
        while True:
            page = self.events(task_id, after, 1000)
            out.extend(page.data)
            if not page.has_more or not page.data:
                return out
            after = page.data[-1].sequence_number

    def follow(
        self,
        task_id: str,
        after: int = -1,
        *,
        on_status: StatusCallback | None = None,
        max_downtime: float | None = None,
    ) -> EventFollower:
        """The task's events after `after`, live, until the terminal one — across dropped
        connections and server restarts, each exactly once (see `follow.EventFollower`)."""
        return EventFollower(
            _TaskEventSource(self, task_id),
            after,
            on_status=on_status,
            max_downtime=max_downtime,
        )

    def task_id_of(self, target: str | Task | Response) -> str:
        """The task id behind a task, a response, or either's id."""
        if isinstance(target, Task):
            return target.id
        if isinstance(target, Response):
            return target.task_id or self.get_response(target.id).task_id or target.id
        if target.startswith("resp_"):
            task_id = self.get_response(target).task_id
            if task_id is None:
                raise ValueError(f"response {target} has no task")
            return task_id
        return target

    def wait(self, target: str | Task | Response, timeout: float | None = None) -> Response | Task:
        """Block until the task behind `target` is finished; return `target` refreshed."""
        task_id = self.task_id_of(target)
        follower = self.follow(task_id, max_downtime=timeout)
        timer = None
        if timeout is not None:
            timer = threading.Timer(timeout, follower.close)
            timer.daemon = True
            timer.start()
        start = time.monotonic()
        try:
            for _ in follower:
                pass
        finally:
            if timer is not None:
                timer.cancel()
        if not follower.done:
            raise TimeoutError(
                f"task {task_id} did not finish within {timeout} s "
                f"(waited {time.monotonic() - start:.1f} s)"
            )
        if isinstance(target, Response) or (isinstance(target, str) and target.startswith("resp_")):
            rid = target.id if isinstance(target, Response) else target
            return self.get_response(rid)
        return self.get_task(task_id)

    # -- pairing (the owner's side, LMSP B3) -------------------------------------------------

    def pairings(self) -> list[Pairing]:
        """Pairing requests waiting for a decision."""
        return [Pairing.from_wire(p) for p in self._request("GET", "/pairings")["data"]]

    def approve_pairing(self, id_or_user_code: str, scopes: list[str] | None = None) -> Pairing:
        """Approve a pairing (by its id or the code the program shows), optionally narrowing
        the scopes it asked for."""
        body = {"scopes": scopes} if scopes is not None else {}
        return Pairing.from_wire(
            self._request("POST", f"/pairings/{id_or_user_code}/approve", json_body=body)
        )

    def deny_pairing(self, id_or_user_code: str) -> Pairing:
        return Pairing.from_wire(
            self._request("POST", f"/pairings/{id_or_user_code}/deny", json_body={})
        )

    def clients(self) -> list[PairedClient]:
        return [PairedClient.from_wire(c) for c in self._request("GET", "/clients")["data"]]

    def revoke_client(self, client_id: str) -> PairedClient:
        return PairedClient.from_wire(self._request("DELETE", f"/clients/{client_id}"))

    # -- the openai SDK --------------------------------------------------------------------

    def openai_client(self, **kwargs: Any) -> Any:
        """An `openai.OpenAI` pointed at this service (it sends the token as a Bearer)."""
        try:
            import openai
        except ImportError as e:  # pragma: no cover - openai is optional
            raise ImportError("openai_client() needs the `openai` package") from e
        return openai.OpenAI(base_url=self.api_url, api_key=self.token or "none", **kwargs)


def _api_error(r: httpx.Response) -> APIError:
    try:
        body: Any = r.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = r.text
    return APIError(r.status_code, body, dict(r.headers))
