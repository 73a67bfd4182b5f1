"""The stored shape of a task's snapshot (LMSP B7): the `tasks.snapshot` JSON, as typed dicts.

`protocol.output.Attempt` reads and changes a snapshot as plain dicts (it is rewritten at every
commit of every running task, and a dict is what the JSON is); these `TypedDict`s say which keys
it has, so mypy checks every access, and `load` validates the JSON against them with pydantic as
it parses it. Keys a snapshot must have are `Required`; the rest appear as an attempt needs them
(the layout of the first releases had only `output_index`, `item_id`, `open`, `token_ids`,
`text`). Unknown keys are kept (`extra="allow"`): a snapshot written by a newer release still
loads. tests/test_snapshot_model.py checks that every snapshot an attempt dumps uses only these
keys.
"""

from __future__ import annotations

from typing import Literal, Required

from pydantic import ConfigDict, TypeAdapter, with_config

# pydantic reads TypedDicts only from typing_extensions before Python 3.12.
from typing_extensions import TypedDict

_CONFIG = ConfigDict(extra="allow", strict=True)


@with_config(_CONFIG)
class SnapshotItem(TypedDict, total=False):
    """One output item of the attempt: a message (`text`, `lp`: it has log-probabilities), a
    reasoning item (`text`, `sealed`), or
    a function or custom tool call (`call_id`, `call`: its number within the choice, `name`,
    `arguments`: a function's arguments, a custom tool's input)."""

    type: Required[Literal["message", "reasoning", "function_call", "custom_tool_call"]]
    id: Required[str]
    output_index: Required[int]
    choice: int
    status: Required[str]  # in_progress, completed, incomplete
    text: str
    lp: bool
    call_id: str
    call: int
    name: str
    arguments: str
    # A reasoning item's text sealed for the client (`include: reasoning.encrypted_content`).
    sealed: str


@with_config(_CONFIG)
class ChoiceSnapshot(TypedDict):
    """Choice k >= 1 of a job with n > 1 (choice 0's are the snapshot's own keys)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None


@with_config(_CONFIG)
class Snapshot(TypedDict, total=False):
    """The attempt: its first output index and message id, whether it is open, choice 0's
    token ids and raw text, the prompt's token count, the hex `base` item ids are made of,
    every item, choices 1.., choice 0's finish reason, the next output index, `n`, and
    `label` (its item events say their `choice`)."""

    output_index: int
    item_id: str | None
    open: bool
    token_ids: list[int]
    text: str
    input_tokens: int
    base: str
    items: list[SnapshotItem]
    choices: list[ChoiceSnapshot]
    finish_reason: str | None
    next_index: int
    n: int
    label: bool


SNAPSHOT = TypeAdapter(Snapshot)

KEYS = frozenset(Snapshot.__optional_keys__ | Snapshot.__required_keys__)
ITEM_KEYS = frozenset(SnapshotItem.__optional_keys__ | SnapshotItem.__required_keys__)


def load(snapshot: str | None) -> Snapshot:
    """A stored snapshot, validated as it is parsed; an empty one for a task without any."""
    return SNAPSHOT.validate_json(snapshot) if snapshot else Snapshot()
