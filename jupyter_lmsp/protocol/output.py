"""A generation attempt's output: its items, how what a runner commits changes them, and the
events that say so (LMSP B6, B7, B11).

An attempt (one run of a task's generation; `retry` after a crash starts another) produces
output items, each at its own `output_index`, in the order they begin:

- a **message** per choice, its text in one `output_text` part (with log-probabilities when
  the request included them). Without tools a choice's message opens when generation starts;
  with tools it opens at the choice's first text that is not whitespace (a choice that only
  calls functions has none);
- a **reasoning** item per choice of a thinking model (`reasoning`: its thinking block's text
  in one `reasoning_text` part), opened at the choice's first thinking text and closed when
  anything else of the choice begins (its message, a call) or it ends;
- a **function call** per call the model makes (`function_call`: `call_id`, `name`,
  `arguments`; a custom tool's is a `custom_tool_call` with its `input` text); it begins once
  the call's name is known, its arguments stream, and it ends when the call is complete. A
  call closes the choice's message before it.

The runner commits `Batch`es: per choice, the tokens and raw text generated (what a resumed
job needs), and the `Piece`s that text made (content, call begin/arguments/end, a choice's
end). `Attempt.apply` turns them into events; the state after them is the task's snapshot, so
the snapshot always covers exactly the committed events. The snapshot is JSON with these keys
(typed in `protocol.snapshot`, and validated as it is loaded):

- `output_index`, `item_id`, `open`, `token_ids`, `text`, `input_tokens`: the attempt's first
  output index, its first message's id, whether the attempt is open, choice 0's tokens and raw
  text, the prompt's token count (the layout of the first releases, still read);
- `base`: the hex part of the response id that item ids are made of;
- `items`: every item of the attempt (`type`, `id`, `output_index`, `choice`, `status`; a
  message's `text` and `lp` (it has log-probabilities); a call's `call_id`, `call` (its number
  within the choice), `name`, `arguments`);
- `choices`: choices 1.. of a job with n > 1 (`token_ids`, `text`, `finish_reason`), and
  `finish_reason` for choice 0 once it ended;
- `next_index`: the output index the next item gets.

Log-probabilities are not kept in the snapshot (it is rewritten at every commit; with 20
alternatives a token they would make that quadratic): they are in the delta events, and a
message's are gathered from there (`lookup`) when it closes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from . import events as ev
from . import snapshot as stored
from .responses import custom_tool_call_item, function_call_item, output_message, reasoning_item
from .snapshot import ChoiceSnapshot, Snapshot, SnapshotItem

Event = dict[str, Any]
CUSTOM_CALL: Literal["custom_tool_call"] = "custom_tool_call"
CALL_TYPES = ("function_call", CUSTOM_CALL)
LogprobLookup = Callable[[str], list[dict[str, Any]]]


@dataclass
class Text:
    """More text of a choice's message, with the log-probabilities of the tokens committed
    with it (when asked for)."""

    choice: int
    text: str
    logprobs: list[dict[str, Any]] | None = None


@dataclass
class Reasoning:
    """More of a choice's thinking (the text of its thinking block, markers left out)."""

    choice: int
    text: str


@dataclass
class CallBegin:
    """Call `index` (the choice's n-th) of function (or custom tool, `custom`) `name`
    began."""

    choice: int
    index: int
    name: str
    custom: bool = False


@dataclass
class CallArguments:
    choice: int
    index: int
    delta: str


@dataclass
class CallEnd:
    """Call `index` is complete; `arguments` is its arguments' JSON text."""

    choice: int
    index: int
    arguments: str


@dataclass
class ChoiceEnd:
    """The choice ended: "stop" (its message is completed) or "length" (incomplete)."""

    choice: int
    finish_reason: str


Piece = Text | Reasoning | CallBegin | CallArguments | CallEnd | ChoiceEnd


@dataclass
class Batch:
    """What one commit adds to a task's output: per choice, the token ids and raw text
    generated since the last commit, and the pieces they made."""

    tokens: dict[int, tuple[list[int], str]] = field(default_factory=dict)
    pieces: list[Piece] = field(default_factory=list)

    @classmethod
    def plain(cls, token_ids: list[int], text: str) -> Batch:
        """Choice 0's tokens and text, all of it message content (a task without tools)."""
        return cls({0: (list(token_ids), text)}, [Text(0, text)] if text else [])

    def add(self, other: Batch) -> None:
        for choice, (ids, text) in other.tokens.items():
            have_ids, have_text = self.tokens.get(choice, ([], ""))
            self.tokens[choice] = (have_ids + ids, have_text + text)
        for piece in other.pieces:
            last = self.pieces[-1] if self.pieces else None
            if (
                isinstance(piece, Reasoning)
                and isinstance(last, Reasoning)
                and last.choice == piece.choice
            ):
                self.pieces[-1] = Reasoning(last.choice, last.text + piece.text)
            elif isinstance(piece, Text) and isinstance(last, Text) and last.choice == piece.choice:
                # One delta event per commit and message, however many tokens it holds.
                merged = None
                if last.logprobs is not None or piece.logprobs is not None:
                    merged = (last.logprobs or []) + (piece.logprobs or [])
                self.pieces[-1] = Text(last.choice, last.text + piece.text, merged)
            else:
                self.pieces.append(piece)

    def __bool__(self) -> bool:
        return bool(self.pieces) or any(ids or text for ids, text in self.tokens.values())


def _hex(response_or_task_id: str) -> str:
    return response_or_task_id.split("_", 1)[1]


def message_id(base: str, output_index: int) -> str:
    """A message item's id: `msg_<hex>` for the first, `msg_<hex>_<k>` at output index k."""
    return f"msg_{base}" + (f"_{output_index}" if output_index else "")


def call_ids(base: str, output_index: int, custom: bool = False) -> tuple[str, str]:
    """A function (custom tool) call item's id and its `call_id`."""
    prefix = "ctc" if custom else "fc"
    return f"{prefix}_{base}_{output_index}", f"call_{base}_{output_index}"


class Attempt:
    """A task's output state (its snapshot), read and changed by the store's rules."""

    def __init__(self, data: Snapshot) -> None:
        self.data = data
        if "items" not in data:
            data["items"] = self._legacy_items()
        self.data.setdefault("token_ids", [])
        self.data.setdefault("text", "")
        self.data.setdefault("output_index", 0)

    @classmethod
    def load(cls, snapshot: str | None) -> Attempt:
        return cls(stored.load(snapshot))

    def dump(self) -> str:
        return json.dumps(self.data, separators=(",", ":"))

    def _legacy_items(self) -> list[SnapshotItem]:
        item_id = self.data.get("item_id")
        if not item_id:
            return []
        return [
            {
                "type": "message",
                "id": item_id,
                "output_index": self.data.get("output_index", 0),
                "choice": 0,
                "text": self.data.get("text", ""),
                "status": "in_progress" if self.data.get("open") else "incomplete",
            }
        ]

    # -- reading ---------------------------------------------------------------------------

    @property
    def open(self) -> bool:
        return bool(self.data.get("open"))

    @property
    def items(self) -> list[SnapshotItem]:
        return list(self.data["items"])

    @property
    def started(self) -> bool:
        """Whether an attempt was ever begun (a task that ran before a restart)."""
        return bool(self.data.get("base") or self.data.get("item_id"))

    @property
    def base(self) -> str:
        base = self.data.get("base")
        if base:
            return str(base)
        return str(self.data["item_id"]).split("_")[1]

    @property
    def next_index(self) -> int:
        if "next_index" in self.data:
            return int(self.data["next_index"])
        indexes = [item["output_index"] for item in self.data["items"]]
        return max(indexes) + 1 if indexes else int(self.data.get("output_index", 0))

    def choice_state(self, choice: int) -> ChoiceSnapshot:
        """Choice `choice`'s `token_ids`, `text` and `finish_reason` (None if still going)."""
        if choice == 0:
            return {
                "token_ids": list(self.data.get("token_ids", [])),
                "text": self.data.get("text", ""),
                "finish_reason": self.data.get("finish_reason"),
            }
        choices = self.data.get("choices") or []
        if choice - 1 < len(choices):
            return ChoiceSnapshot(**choices[choice - 1])
        return {"token_ids": [], "text": "", "finish_reason": None}

    def choices(self, n: int) -> list[ChoiceSnapshot]:
        return [self.choice_state(i) for i in range(n)]

    def output(self, lookup: LogprobLookup | None = None) -> list[dict[str, Any]]:
        """The attempt's items as the response's `output` shows them, by output index."""
        out = []
        for item in sorted(self.data["items"], key=lambda i: i["output_index"]):
            out.append(self._wire(item, item["status"], lookup))
        return out

    def choice_of(self) -> dict[str, int]:
        """Item id → choice, for every item."""
        return {item["id"]: item.get("choice", 0) for item in self.data["items"]}

    # -- changing --------------------------------------------------------------------------

    @classmethod
    def begin(
        cls,
        previous: Attempt,
        base: str,
        input_tokens: int,
        *,
        n: int = 1,
        eager: bool = True,
        label_choices: bool = False,
    ) -> tuple[Attempt, list[Event]]:
        """A new attempt after `previous` (an empty one for a task's first), with its
        messages opened when `eager` (no tools), one per choice."""
        start = previous.next_index if previous.started else 0
        attempt = cls(
            Snapshot(
                base=base,
                output_index=start,
                item_id=message_id(base, start) if eager else None,
                open=True,
                token_ids=[],
                text="",
                input_tokens=input_tokens,
                items=[],
                next_index=start,
            )
        )
        if n > 1:
            attempt.data["n"] = n
            attempt.data["choices"] = [
                {"token_ids": [], "text": "", "finish_reason": None} for _ in range(n - 1)
            ]
        if label_choices:
            attempt.data["label"] = True
        events: list[Event] = []
        if eager:
            for choice in range(n):
                events += attempt._open_message(choice)
        return attempt, events

    def apply(self, batch: Batch, lookup: LogprobLookup | None = None) -> list[Event]:
        """Add a committed batch: the choices' tokens and text, and the events its pieces
        make."""
        for choice, (ids, text) in batch.tokens.items():
            state = self._choice_slot(choice)
            state["token_ids"].extend(ids)
            state["text"] += text
        events: list[Event] = []
        fresh: dict[str, list[dict[str, Any]]] = {}
        for piece in batch.pieces:
            match piece:
                case Reasoning(choice=choice, text=text):
                    events += self._reasoning(choice, text)
                case Text(choice=choice, text=text, logprobs=logprobs):
                    events += self._close_reasoning(choice)
                    events += self._text(choice, text, logprobs or [], fresh)
                case CallBegin(choice=choice, index=index, name=name, custom=custom):
                    events += self._close_reasoning(choice)
                    events += self._close_message(choice, "completed", lookup, fresh)
                    events += self._open_call(choice, index, name, custom)
                case CallArguments(choice=choice, index=index, delta=delta):
                    item = self._call(choice, index)
                    item["arguments"] += delta
                    custom = item["type"] == CUSTOM_CALL
                    events.append(
                        self._label(
                            ev.call_arguments(item["id"], item["output_index"], delta, custom),
                            item,
                        )
                    )
                case CallEnd(choice=choice, index=index, arguments=arguments):
                    item = self._call(choice, index)
                    item["arguments"] = arguments
                    events += self._close(item, "completed", lookup, fresh)
                case ChoiceEnd(choice=choice, finish_reason=reason):
                    self._choice_slot(choice)["finish_reason"] = reason
                    status = "incomplete" if reason == "length" else "completed"
                    for item in self._open_items(choice):
                        events += self._close(item, _ended(item, status), lookup, fresh)
        return events

    def close(self, status: str, lookup: LogprobLookup | None = None) -> list[Event]:
        """End the attempt: the done events of every item still open (`status`; a call
        still open is `incomplete`)."""
        if not self.open:
            return []
        events: list[Event] = []
        for item in sorted(self.data["items"], key=lambda i: i["output_index"]):
            if item["status"] == "in_progress":
                events += self._close(item, _ended(item, status), lookup, {})
        self.data["open"] = False
        return events

    # -- internals -------------------------------------------------------------------------

    def _choice_slot(self, choice: int) -> Snapshot | ChoiceSnapshot:
        if choice == 0:
            return self.data
        choices = self.data.setdefault("choices", [])
        while len(choices) < choice:
            choices.append({"token_ids": [], "text": "", "finish_reason": None})
        slot: ChoiceSnapshot = choices[choice - 1]
        return slot

    def _take_index(self) -> int:
        index = self.next_index
        self.data["next_index"] = index + 1
        return index

    def _label(self, event: Event, item: SnapshotItem) -> Event:
        """Events of a job with several choices say whose they are (LMSP `choice`)."""
        if self.data.get("n", 1) > 1 or self.data.get("label"):
            event["choice"] = item.get("choice", 0)
        return event

    def _open_items(self, choice: int) -> list[SnapshotItem]:
        return [
            item
            for item in self.data["items"]
            if item.get("choice", 0) == choice and item["status"] == "in_progress"
        ]

    def _message(self, choice: int) -> SnapshotItem | None:
        for item in self._open_items(choice):
            if item["type"] == "message":
                return item
        return None

    def _call(self, choice: int, index: int) -> SnapshotItem:
        for item in self.data["items"]:
            if (
                item["type"] in CALL_TYPES
                and item.get("choice", 0) == choice
                and item["call"] == index
            ):
                return item
        raise ValueError(f"no call {index} of choice {choice} in this attempt")

    def _open_message(self, choice: int) -> list[Event]:
        index = self._take_index()
        item_id = message_id(self.base, index)
        item: SnapshotItem = {
            "type": "message",
            "id": item_id,
            "output_index": index,
            "choice": choice,
            "text": "",
            "status": "in_progress",
        }
        self.data["items"].append(item)
        if choice == 0 and not self.data.get("item_id"):
            self.data["item_id"] = item_id
        return [self._label(event, item) for event in ev.item_opened(item_id, index)]

    def _text(
        self,
        choice: int,
        text: str,
        logprobs: list[dict[str, Any]],
        fresh: dict[str, list[dict[str, Any]]],
    ) -> list[Event]:
        if not text and not logprobs:
            return []
        events: list[Event] = []
        item = self._message(choice)
        if item is None:
            events += self._open_message(choice)
            item = self._message(choice)
            assert item is not None
        item["text"] += text
        if logprobs:
            item["lp"] = True
            fresh.setdefault(item["id"], []).extend(logprobs)
        events.append(
            self._label(ev.text_delta(item["id"], item["output_index"], text, logprobs), item)
        )
        return events

    def _reasoning(self, choice: int, text: str) -> list[Event]:
        if not text:
            return []
        events: list[Event] = []
        item = self._open_of(choice, "reasoning")
        if item is None:
            index = self._take_index()
            item_id = f"rs_{self.base}_{index}"
            item = {
                "type": "reasoning",
                "id": item_id,
                "output_index": index,
                "choice": choice,
                "text": "",
                "status": "in_progress",
            }
            self.data["items"].append(item)
            events += [self._label(e, item) for e in ev.reasoning_opened(item_id, index)]
        item["text"] += text
        events.append(self._label(ev.reasoning_delta(item["id"], item["output_index"], text), item))
        return events

    def _close_reasoning(self, choice: int) -> list[Event]:
        item = self._open_of(choice, "reasoning")
        return self._close(item, "completed", None, {}) if item is not None else []

    def _open_of(self, choice: int, kind: str) -> SnapshotItem | None:
        for item in self._open_items(choice):
            if item["type"] == kind:
                return item
        return None

    def _open_call(self, choice: int, index: int, name: str, custom: bool) -> list[Event]:
        output_index = self._take_index()
        item_id, call_id = call_ids(self.base, output_index, custom)
        item: SnapshotItem = {
            "type": CUSTOM_CALL if custom else "function_call",
            "id": item_id,
            "call_id": call_id,
            "output_index": output_index,
            "choice": choice,
            "call": index,
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        self.data["items"].append(item)
        return [self._label(ev.call_opened(item_id, call_id, output_index, name, custom), item)]

    def _close_message(
        self,
        choice: int,
        status: str,
        lookup: LogprobLookup | None,
        fresh: dict[str, list[dict[str, Any]]],
    ) -> list[Event]:
        item = self._message(choice)
        return self._close(item, status, lookup, fresh) if item is not None else []

    def _close(
        self,
        item: SnapshotItem,
        status: str,
        lookup: LogprobLookup | None,
        fresh: dict[str, list[dict[str, Any]]],
    ) -> list[Event]:
        item["status"] = status
        if item["type"] == "message":
            logprobs = self._logprobs(item, lookup) + fresh.get(item["id"], [])
            built = ev.item_closed(item["id"], item["output_index"], item["text"], status, logprobs)
        elif item["type"] == "reasoning":
            built = ev.reasoning_closed(
                item["id"], item["output_index"], item["text"], status, item.get("sealed")
            )
        else:
            built = ev.call_closed(
                item["id"],
                item["call_id"],
                item["output_index"],
                item["name"],
                item["arguments"],
                status,
                item["type"] == CUSTOM_CALL,
            )
        return [self._label(event, item) for event in built]

    def _logprobs(self, item: SnapshotItem, lookup: LogprobLookup | None) -> list[dict[str, Any]]:
        if not item.get("lp") or lookup is None:
            return []
        return lookup(item["id"])

    def _wire(
        self, item: SnapshotItem, status: str, lookup: LogprobLookup | None
    ) -> dict[str, Any]:
        if item["type"] == "message":
            return output_message(item["id"], item["text"], status, self._logprobs(item, lookup))
        if item["type"] == "reasoning":
            return reasoning_item(item["id"], item["text"], status, item.get("sealed"))
        wire = custom_tool_call_item if item["type"] == CUSTOM_CALL else function_call_item
        return wire(item["id"], item["call_id"], item["name"], item["arguments"], status)


def _ended(item: SnapshotItem, status: str) -> str:
    """The status an open item ends with when its choice or attempt ends with `status`: a
    message or a thinking block cut short is as its choice is; a call cut short is
    `incomplete` (its arguments are not whole)."""
    if item["type"] in ("message", "reasoning"):
        return status
    return "incomplete"


def logprobs_from_events(events: list[Event], item_id: str) -> list[dict[str, Any]]:
    """The log-probabilities of message `item_id`, from its delta events in order."""
    out: list[dict[str, Any]] = []
    for event in events:
        if event.get("type") == ev.TEXT_DELTA and event.get("item_id") == item_id:
            out.extend(event.get("logprobs") or [])
    return out
