"""Typed objects the client returns: responses, tasks, events, models, the service, pairings.

Each keeps the JSON it was made from in `raw` (new server fields stay reachable) and, where it
makes sense, the `Client` that fetched it, so `response.cancel()` or `task.wait()` need no
further arguments. Inside a notebook, a response or a task shown as the last expression of a
cell renders as a live `TaskWatcher` (see `_repr_mimebundle_`); elsewhere it prints as text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# The service's own state map (protocol.states, standard library only), not a copy of it.
from ..protocol.states import TERMINAL_EVENT_TYPES, TERMINAL_RESPONSE_STATUSES, TERMINAL_STATES
from .display import watcher_factory

if TYPE_CHECKING:
    from .api import Client

TERMINAL_TASK_STATES: frozenset[str] = frozenset(TERMINAL_STATES)


def _short(text: str, n: int = 60) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= n else text[: n - 1] + "…"


def _in_kernel() -> bool:
    """Whether we run inside an IPython kernel that can show widgets."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class _WatchableMixin:
    """What responses and tasks share: the client they came from, and rich display as a
    TaskWatcher inside a kernel (plain text everywhere else)."""

    client: Client | None

    def _need_client(self) -> Client:
        if self.client is None:
            raise ValueError("this object has no client; pass one explicitly")
        return self.client

    def watch(self, **kwargs: Any) -> Any:
        """A live `TaskWatcher` for this object's task (from `jupyter_lmsp.widgets`)."""
        factory = watcher_factory()
        if factory is None:
            raise RuntimeError("no watcher is registered (jupyter_lmsp.widgets is not installed)")
        # The object itself, not its id: the watcher's first state message then already
        # carries what the object knows (its model), for a notebook saved right away.
        return factory(self, client=kwargs.pop("client", self.client), **kwargs)

    def _repr_mimebundle_(
        self, include: Any = None, exclude: Any = None, **kwargs: Any
    ) -> dict[str, Any] | tuple[dict[str, Any], dict[str, Any]]:
        if not _in_kernel() or self.client is None or watcher_factory() is None:
            return {"text/plain": repr(self)}
        bundle = self.watch()._repr_mimebundle_(include=include, exclude=exclude, **kwargs)
        if isinstance(bundle, tuple):  # (data, metadata)
            data, meta = bundle
            data = {**data, "text/plain": repr(self)}
            return (data, meta)
        if isinstance(bundle, dict):
            return {**bundle, "text/plain": repr(self)}
        return {"text/plain": repr(self)}


@dataclass
class Usage:
    input_tokens: int
    output_tokens: int
    total_tokens: int

    @classmethod
    def from_wire(cls, data: dict[str, Any] | None) -> Usage | None:
        if not data:
            return None
        return cls(
            input_tokens=int(data.get("input_tokens", 0)),
            output_tokens=int(data.get("output_tokens", 0)),
            total_tokens=int(data.get("total_tokens", 0)),
        )


def output_text_of(output: list[dict[str, Any]]) -> str:
    """The text of a response's `output` (what the openai SDK calls `output_text`)."""
    parts = []
    for item in output:
        if item.get("type") != "message":
            continue
        for part in item.get("content") or []:
            if part.get("type") == "output_text":
                parts.append(part.get("text", ""))
    return "".join(parts)


@dataclass(repr=False)
class Response(_WatchableMixin):
    """A response object (LMSP B5, the OpenAI Responses API shape plus `task_id`)."""

    id: str
    status: str
    model: str
    created_at: int
    output_text: str
    task_id: str | None
    background: bool
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    usage: Usage | None
    seed: int | None
    on_restart: str | None
    metadata: dict[str, Any]
    raw: dict[str, Any] = field(compare=False)
    client: Client | None = field(default=None, compare=False)

    @classmethod
    def from_wire(cls, data: dict[str, Any], client: Client | None = None) -> Response:
        return cls(
            id=data["id"],
            status=data.get("status", ""),
            model=data.get("model", ""),
            created_at=int(data.get("created_at") or 0),
            output_text=output_text_of(data.get("output") or []),
            task_id=data.get("task_id"),
            background=bool(data.get("background", False)),
            error=data.get("error"),
            incomplete_details=data.get("incomplete_details"),
            usage=Usage.from_wire(data.get("usage")),
            seed=data.get("seed"),
            on_restart=data.get("on_restart"),
            metadata=data.get("metadata") or {},
            raw=data,
            client=client,
        )

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL_RESPONSE_STATUSES

    def refresh(self) -> Response:
        """The response as it is now."""
        return self._need_client().get_response(self.id)

    def cancel(self) -> Response:
        return self._need_client().cancel_response(self.id)

    def wait(self, timeout: float | None = None) -> Response:
        """Block until the response is finished (following its event stream) and return it."""
        finished = self._need_client().wait(self, timeout=timeout)
        assert isinstance(finished, Response)
        return finished

    def __repr__(self) -> str:
        text = f", text={_short(self.output_text)!r}" if self.output_text else ""
        return f"Response(id={self.id!r}, status={self.status!r}, model={self.model!r}{text})"


@dataclass(repr=False)
class Task(_WatchableMixin):
    """A task object (LMSP B6): the durable unit of work behind a response."""

    id: str
    kind: str
    state: str
    on_restart: str | None
    model: str | None
    response_id: str | None
    owner: str | None
    error: dict[str, Any] | None
    last_sequence_number: int
    attempts: int
    created_at: float
    updated_at: float
    finished_at: float | None
    raw: dict[str, Any] = field(compare=False)
    client: Client | None = field(default=None, compare=False)

    @classmethod
    def from_wire(cls, data: dict[str, Any], client: Client | None = None) -> Task:
        return cls(
            id=data["id"],
            kind=data.get("kind", ""),
            state=data.get("state", ""),
            on_restart=data.get("on_restart"),
            model=data.get("model"),
            response_id=data.get("response_id"),
            owner=data.get("owner"),
            error=data.get("error"),
            last_sequence_number=int(data.get("last_sequence_number", -1)),
            attempts=int(data.get("attempts") or 0),
            created_at=float(data.get("created_at") or 0.0),
            updated_at=float(data.get("updated_at") or 0.0),
            finished_at=data.get("finished_at"),
            raw=data,
            client=client,
        )

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_TASK_STATES

    @property
    def elapsed(self) -> float:
        """Seconds from creation to the end (or to now, while unfinished)."""
        end = self.finished_at if self.finished_at is not None else time.time()
        return max(0.0, end - self.created_at)

    def refresh(self) -> Task:
        return self._need_client().get_task(self.id)

    def cancel(self) -> Task:
        return self._need_client().cancel_task(self.id)

    def wait(self, timeout: float | None = None) -> Task:
        """Block until the task is finished (following its event stream) and return it."""
        self._need_client().wait(self, timeout=timeout)
        return self.refresh()

    def response(self) -> Response:
        if self.response_id is None:
            raise ValueError(f"task {self.id} has no response")
        return self._need_client().get_response(self.response_id)

    def __repr__(self) -> str:
        return (
            f"Task(id={self.id!r}, kind={self.kind!r}, state={self.state!r}, "
            f"model={self.model!r}, last_sequence_number={self.last_sequence_number})"
        )


@dataclass
class Event:
    """One event of a task's log: `sequence_number`, `type`, and the rest of its data."""

    sequence_number: int
    type: str
    data: dict[str, Any]

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Event:
        return cls(int(data["sequence_number"]), str(data["type"]), data)

    @property
    def terminal(self) -> bool:
        return self.type in TERMINAL_EVENT_TYPES

    @property
    def delta(self) -> str:
        """The text of a `response.output_text.delta` event ('' for other events)."""
        return self.data.get("delta", "") if self.type == "response.output_text.delta" else ""

    @property
    def response(self) -> Response | None:
        """The response object that lifecycle events carry."""
        data = self.data.get("response")
        return Response.from_wire(data) if isinstance(data, dict) else None


@dataclass
class EventPage:
    data: list[Event]
    has_more: bool
    last_sequence_number: int


@dataclass
class Model:
    id: str
    format: str | None
    path: str | None
    size_bytes: int | None
    state: str | None
    digest: str | None
    raw: dict[str, Any] = field(compare=False, repr=False)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Model:
        return cls(
            id=data["id"],
            format=data.get("format"),
            path=data.get("path"),
            size_bytes=data.get("size_bytes"),
            state=data.get("state"),
            digest=data.get("digest"),
            raw=data,
        )


@dataclass
class ServiceInfo:
    id: str
    name: str
    protocol: str
    version: str
    capabilities: list[str]
    default_model: str | None
    limits: dict[str, Any]
    raw: dict[str, Any] = field(compare=False, repr=False)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> ServiceInfo:
        return cls(
            id=data["id"],
            name=data.get("name", ""),
            protocol=data.get("protocol", ""),
            version=data.get("version", ""),
            capabilities=list(data.get("capabilities") or []),
            default_model=data.get("default_model"),
            limits=data.get("limits") or {},
            raw=data,
        )


@dataclass
class Pairing:
    """A pairing request as the owner sees it (LMSP B3); never its device code."""

    id: str
    client_name: str
    user_code: str
    status: str
    requested_scopes: list[str]
    granted_scopes: list[str] | None
    client_id: str | None
    expires_at: int
    raw: dict[str, Any] = field(compare=False, repr=False)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Pairing:
        return cls(
            id=data["id"],
            client_name=data.get("client_name", ""),
            user_code=data.get("user_code", ""),
            status=data.get("status", ""),
            requested_scopes=list(data.get("requested_scopes") or []),
            granted_scopes=data.get("granted_scopes"),
            client_id=data.get("client_id"),
            expires_at=int(data.get("expires_at") or 0),
            raw=data,
        )


@dataclass
class PairedClient:
    """A paired client as the owner sees it; never its token."""

    id: str
    name: str
    scopes: list[str]
    created_at: int
    last_used_at: int | None
    revoked_at: int | None
    raw: dict[str, Any] = field(compare=False, repr=False)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> PairedClient:
        return cls(
            id=data["id"],
            name=data.get("name", ""),
            scopes=list(data.get("scopes") or []),
            created_at=int(data.get("created_at") or 0),
            last_used_at=data.get("last_used_at"),
            revoked_at=data.get("revoked_at"),
            raw=data,
        )
