"""What a TaskWatcher shows, computed from a task's events: a pure, testable reducer.

`WatcherState.apply(event)` folds one event into the state (task state, text, the last events,
token counts and rates). It accepts each sequence number once, in order: a repeat is ignored
and a skipped number raises `SequenceGapError`, so a bug upstream can never show a text with a
hole or a doubled piece. (`client.follow.EventFollower` repairs gaps and drops repeats before
events get here.)

Tokens: the wire does not say how many tokens a delta holds, so while a task runs they are
estimated with the model's own tokenizer (read from the model directory the service reports)
or, failing that, at four characters a token; the final event's `usage.output_tokens` replaces
the estimate. The rate is measured over the events this watcher saw arrive live.

Function calls (issue 14) are kept beside the text, each with its name, its arguments as they
stream and its status; `format` is the response's `text.format` type, so a view can show a
structured output as JSON. A chat completion with several choices shows its first choice.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..client.errors import SequenceGapError
from ..client.objects import Event, output_text_of
from ..protocol.states import EVENT_STATES as _EVENT_STATES
from ..protocol.states import TERMINAL_STATES as _TERMINAL_STATES

# The task state each lifecycle event moves to: the service's one map (protocol.states).
EVENT_STATES: dict[str, str] = {event: str(state) for event, state in _EVENT_STATES.items()}
TERMINAL_STATES = frozenset(str(state) for state in _TERMINAL_STATES)
# Output items that are calls the client runs: a function's, a custom tool's.
CALL_ITEMS = ("function_call", "custom_tool_call")

TokenCounter = Callable[[str], int]


def rough_token_count(text: str) -> int:
    """About four characters a token: the fallback when no tokenizer can be read."""
    return math.ceil(len(text) / 4) if text else 0


_tokenizers: dict[str, TokenCounter] = {}
_tokenizers_lock = threading.Lock()


def tokenizer_counter(model_path: str | None) -> TokenCounter:
    """A token counter using the model's `tokenizer.json` (cached per path), or the rough one."""
    if not model_path:
        return rough_token_count
    with _tokenizers_lock:
        if model_path in _tokenizers:
            return _tokenizers[model_path]
        counter: TokenCounter = rough_token_count
        path = Path(model_path) / "tokenizer.json"
        try:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(path))

            def count(text: str) -> int:
                return len(tok.encode(text, add_special_tokens=False).ids) if text else 0

            counter = count
        except Exception:
            # A remote server, or a model without a tokenizer.json: estimate instead.
            pass
        _tokenizers[model_path] = counter
        return counter


def _detail(event: Event) -> str:
    """A short human description of an event for the "last events" list."""
    data = event.data
    if event.type in (
        "response.output_text.delta",
        "response.function_call_arguments.delta",
        "response.custom_tool_call_input.delta",
    ):
        delta = data.get("delta", "")
        return repr(delta if len(delta) <= 40 else delta[:39] + "…")
    item = data.get("item")
    if isinstance(item, dict) and item.get("type") in CALL_ITEMS:
        return f"call {item.get('name', '')} {item.get('status', '')}".strip()
    response = data.get("response")
    if isinstance(response, dict):
        error = response.get("error")
        if error:
            return f"{response.get('status')}: {error.get('code')}"
        return str(response.get("status", ""))
    if "item" in data and isinstance(data["item"], dict):
        return f"item {data.get('output_index', 0)} {data['item'].get('status', '')}".strip()
    if "text" in data:
        return f"{len(data['text'])} characters"
    return ""


def _is_call(data: dict[str, Any]) -> bool:
    item = data.get("item")
    return isinstance(item, dict) and item.get("type") in CALL_ITEMS


@dataclass
class EventLine:
    sequence_number: int
    type: str
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.sequence_number, "type": self.type, "detail": self.detail}


@dataclass
class WatcherState:
    """Everything a TaskWatcher displays; `apply` events to it in sequence order."""

    task_id: str
    response_id: str | None = None
    kind: str = "response"
    model: str | None = None
    state: str = "queued"
    status: str | None = None
    text: str = ""
    error: dict[str, Any] | None = None
    incomplete_reason: str | None = None
    created_at: float | None = None
    finished_at: float | None = None
    last_sequence_number: int = -1
    max_events: int = 8
    recent: deque[EventLine] = field(default_factory=deque)
    count_tokens: TokenCounter = rough_token_count
    estimated_tokens: int = 0
    output_tokens: int | None = None
    # Rate measurement: from the first event that arrived live (after `live_after`).
    live_after: int = -1
    rate_start: tuple[float, int] | None = None
    rate_end: tuple[float, int] | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    format: str = "text"
    _output_index: int = 0

    def __post_init__(self) -> None:
        self.recent = deque(self.recent, maxlen=self.max_events)

    @classmethod
    def from_task(cls, task: dict[str, Any], **kwargs: Any) -> WatcherState:
        """A state seeded from a task object; events after `live_after` count as live."""
        return cls(
            task_id=task["id"],
            response_id=task.get("response_id"),
            kind=task.get("kind") or "response",
            model=task.get("model"),
            state=task.get("state") or "queued",
            error=task.get("error"),
            created_at=task.get("created_at"),
            finished_at=task.get("finished_at"),
            live_after=int(task.get("last_sequence_number", -1)),
            **kwargs,
        )

    # -- derived values --------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else self.estimated_tokens

    def elapsed(self, now: float | None = None) -> float:
        """Seconds since the task was created, until it finished."""
        if self.created_at is None:
            return 0.0
        end = self.finished_at if self.finished_at is not None else (now or time.time())
        return max(0.0, end - self.created_at)

    def tokens_per_second(self) -> float | None:
        """Output tokens per second while this watcher saw them arrive; for a task that was
        over before it was watched, the average over the task's life."""
        if self.rate_start is not None:
            if self.rate_end is None:
                return None
            (t0, n0), (t1, _) = self.rate_start, self.rate_end
            span = t1 - t0
            # Too short a window says nothing (and would divide by almost nothing).
            return max(0.0, (self.tokens - n0) / span) if span > 0.05 else None
        if self.finished and self.output_tokens:
            life = self.elapsed()
            return self.output_tokens / life if life > 0 else None
        return None

    # -- the reducer -----------------------------------------------------------------------

    def apply(self, event: Event, now: float | None = None) -> bool:
        """Fold `event` in. Returns False for a repeat; raises `SequenceGapError` on a gap."""
        seq = event.sequence_number
        if seq <= self.last_sequence_number:
            return False
        if seq != self.last_sequence_number + 1:
            raise SequenceGapError(self.last_sequence_number + 1, seq)
        self.last_sequence_number = seq
        now = time.monotonic() if now is None else now
        data = event.data
        new_state = EVENT_STATES.get(event.type)
        if new_state is not None and self.state not in TERMINAL_STATES:
            self.state = new_state
        response = data.get("response")
        if isinstance(response, dict):
            self._take_response(response, event.terminal)
        if int(data.get("choice", 0)):
            pass  # an item event of another choice than the first (chat `n` > 1)
        elif event.type == "response.queued":
            # Queued again (restart policy `retry`): the next attempt's output replaces this.
            self.text = ""
            self.calls = []
        elif event.type == "response.output_item.added" and _is_call(data):
            item = data["item"]
            self.calls.append(
                {
                    "id": item.get("id", ""),
                    "name": item.get("name", ""),
                    "arguments": item.get("arguments", ""),
                    "status": item.get("status", "in_progress"),
                }
            )
        elif event.type == "response.function_call_arguments.delta":
            call = self._call(data.get("item_id"))
            if call is not None:
                call["arguments"] += data.get("delta", "")
                self.estimated_tokens += self.count_tokens(data.get("delta", ""))
        elif event.type == "response.output_item.done" and _is_call(data):
            call = self._call(data["item"].get("id"))
            if call is not None:
                call["arguments"] = data["item"].get("arguments", call["arguments"])
                call["status"] = data["item"].get("status", call["status"])
        elif event.type == "response.output_item.added":
            index = int(data.get("output_index", 0))
            if index != self._output_index or self.text:
                # A new attempt (restart policy `retry`): its message replaces the old one.
                self._output_index = index
                self.text = ""
        elif event.type == "response.output_text.delta":
            delta = data.get("delta", "")
            self._output_index = int(data.get("output_index", self._output_index))
            self.text += delta
            self.estimated_tokens += self.count_tokens(delta)
        elif event.type == "response.output_text.done":
            self.text = data.get("text", self.text)
        live = seq > self.live_after
        if live and self.rate_start is None and not self.finished:
            self.rate_start = (now, self.tokens)
        if live and (event.type == "response.output_text.delta" or event.terminal):
            self.rate_end = (now, self.tokens)
        self.recent.append(EventLine(seq, event.type, _detail(event)))
        return True

    def _call(self, item_id: Any) -> dict[str, Any] | None:
        return next((call for call in self.calls if call["id"] == item_id), None)

    def _take_response(self, response: dict[str, Any], terminal: bool) -> None:
        self.response_id = response.get("id", self.response_id)
        text_config = response.get("text")
        if isinstance(text_config, dict) and isinstance(text_config.get("format"), dict):
            self.format = str(text_config["format"].get("type", "text"))
        self.model = response.get("model") or self.model
        self.status = response.get("status", self.status)
        if response.get("error"):
            self.error = response["error"]
        if isinstance(response.get("incomplete_details"), dict):
            self.incomplete_reason = response["incomplete_details"].get("reason")
        if terminal:
            output = response.get("output") or []
            if output:
                self.text = output_text_of(output)
                self.calls = [
                    {
                        "id": item.get("id", ""),
                        "name": item.get("name", ""),
                        # A custom tool's call has its input text where a function has
                        # arguments.
                        "arguments": item.get("arguments", item.get("input", "")),
                        "status": item.get("status", ""),
                    }
                    for item in output
                    if item.get("type") in CALL_ITEMS
                ]
            usage = response.get("usage")
            if isinstance(usage, dict) and "output_tokens" in usage:
                self.output_tokens = int(usage["output_tokens"])
            if self.finished_at is None:
                self.finished_at = float(response.get("completed_at") or time.time())

    def to_traits(self, now: float | None = None) -> dict[str, Any]:
        """The values the widget's synced traits take."""
        rate = self.tokens_per_second()
        return {
            "task_id": self.task_id,
            "response_id": self.response_id or "",
            "kind": self.kind,
            "model": self.model or "",
            "state": self.state,
            "status": self.status or "",
            "text": self.text,
            "calls": [dict(call) for call in self.calls],
            "format": self.format,
            "error": self.error or {},
            "incomplete_reason": self.incomplete_reason or "",
            "created_at": self.created_at or 0.0,
            "finished_at": self.finished_at or 0.0,
            "elapsed": round(self.elapsed(now), 2),
            "tokens": self.tokens,
            "tokens_exact": self.output_tokens is not None,
            "tokens_per_second": round(rate, 2) if rate is not None else -1.0,
            "events": [line.to_json() for line in self.recent],
            "last_sequence_number": self.last_sequence_number,
        }
