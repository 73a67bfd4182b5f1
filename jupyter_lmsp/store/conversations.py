"""Conversations and their items (the `conversations` and `conversation_items` tables).

Every public function is one transaction, except `join_turn`, which runs inside the rule that
ends a response (`rules.lifecycle.end`), on its connection: a response's turn (its input and
its output items) joins its conversation in the transaction that writes its terminal event, so
a crash leaves the turn there whole or not at all. Only a `completed` response adds its turn
(an `incomplete` one is completed with a reason); a failed or cancelled one adds nothing.

Items are stored as their wire JSON (with their `id`) at a position that grows by one per item
added (`conversations.next_position`, read and advanced with the conversation's row locked), so
a conversation's items keep the order they were added in, whoever adds them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import bindparam, delete, insert, select, update
from sqlalchemy.engine import Connection

from ..protocol.objects import input_items
from ..protocol.output import Attempt
from ..protocol.states import TaskState
from ..protocol.stored_request import own_input
from .database import Database
from .records import get, record, table
from .tables import Conversation, ConversationItem

_CONVERSATIONS = table(Conversation)
_ITEMS = table(ConversationItem)
_INSERT_CONVERSATION = insert(_CONVERSATIONS)
_INSERT_ITEMS = insert(_ITEMS)
_ADVANCE = (
    update(_CONVERSATIONS)
    .where(_CONVERSATIONS.c.id == bindparam("key_id"))
    .values(next_position=bindparam("next_position"))
)
_RELABEL = (
    update(_CONVERSATIONS)
    .where(_CONVERSATIONS.c.id == bindparam("key_id"))
    .values(labels=bindparam("labels"))
)
_ITEM = select(_ITEMS).where(
    _ITEMS.c.conversation_id == bindparam("conversation_id"), _ITEMS.c.id == bindparam("item_id")
)
_ALL_ITEMS = (
    select(_ITEMS.c.item)
    .where(_ITEMS.c.conversation_id == bindparam("conversation_id"))
    .order_by(_ITEMS.c.position)
)


def create_conversation(
    db: Database, conversation: Conversation, items: Sequence[dict[str, Any]]
) -> list[ConversationItem]:
    """Store a new conversation with its first items, in one transaction."""
    with db.writing() as conn:
        conversation.next_position = 0
        conn.execute(_INSERT_CONVERSATION, conversation.model_dump())
        return _append(conn, conversation, items, None, conversation.created_at)


def get_conversation(db: Database, conversation_id: str) -> Conversation | None:
    with db.reading() as conn:
        return get(conn, Conversation, conversation_id)


def update_metadata(
    db: Database, conversation_id: str, labels: dict[str, str]
) -> Conversation | None:
    """Replace a conversation's metadata; None when there is no such conversation."""
    with db.writing() as conn:
        conversation = get(conn, Conversation, conversation_id, for_update=True)
        if conversation is None:
            return None
        conversation.labels = json.dumps(labels)
        conn.execute(_RELABEL, {"key_id": conversation_id, "labels": conversation.labels})
        return conversation


def delete_conversation(db: Database, conversation_id: str) -> bool:
    """Delete a conversation and its items (their foreign key cascades); False if none."""
    with db.writing() as conn:
        deleted = conn.execute(delete(_CONVERSATIONS).where(_CONVERSATIONS.c.id == conversation_id))
        return bool(deleted.rowcount)


def add_items(
    db: Database, conversation_id: str, items: Sequence[dict[str, Any]]
) -> list[ConversationItem] | None:
    """Append items (wire JSON with their ids) after the conversation's last one; None when
    there is no such conversation."""
    now = time.time()
    with db.writing() as conn:
        conversation = get(conn, Conversation, conversation_id, for_update=True)
        if conversation is None:
            return None
        return _append(conn, conversation, items, None, now)


def get_item(db: Database, conversation_id: str, item_id: str) -> ConversationItem | None:
    with db.reading() as conn:
        row = conn.execute(_ITEM, {"conversation_id": conversation_id, "item_id": item_id}).first()
        return None if row is None else record(ConversationItem, row)


def delete_item(db: Database, conversation_id: str, item_id: str) -> bool:
    """Delete one item of a conversation (the others keep their positions); False if none."""
    with db.writing() as conn:
        deleted = conn.execute(
            delete(_ITEMS).where(
                _ITEMS.c.conversation_id == conversation_id, _ITEMS.c.id == item_id
            )
        )
        return bool(deleted.rowcount)


def list_items(
    db: Database,
    conversation_id: str,
    *,
    after: str | None = None,
    limit: int = 20,
    order: str = "desc",
) -> tuple[list[ConversationItem], bool] | None:
    """A page of a conversation's items in `order` of position, after the item `after` (an
    item of another conversation, or none, is as if not given): the items and whether more
    follow. None when there is no such conversation."""
    ascending = order == "asc"
    position = _ITEMS.c.position
    query = select(_ITEMS).where(_ITEMS.c.conversation_id == conversation_id)
    with db.reading() as conn:
        if get(conn, Conversation, conversation_id) is None:
            return None
        if after is not None:
            row = conn.execute(
                _ITEM, {"conversation_id": conversation_id, "item_id": after}
            ).first()
            if row is not None:
                query = query.where(
                    position > row.position if ascending else position < row.position
                )
        query = query.order_by(position if ascending else position.desc()).limit(limit + 1)
        rows = [record(ConversationItem, r) for r in conn.execute(query)]
    return rows[:limit], len(rows) > limit


def conversation_items(db: Database, conversation_id: str) -> list[dict[str, Any]] | None:
    """Every item of a conversation, oldest first, as wire JSON (a prompt's history); None when
    there is no such conversation."""
    with db.reading() as conn:
        if get(conn, Conversation, conversation_id) is None:
            return None
        return [
            json.loads(text)
            for text in conn.execute(_ALL_ITEMS, {"conversation_id": conversation_id}).scalars()
        ]


def join_turn(conn: Connection, task: Any, response: Any, now: float) -> int:
    """Add a response's turn to its conversation, on the connection of the transaction that
    ends it: its input items (as `input_items` lists them), then the output items of its
    first choice. Only a `completed` response has a turn to add; a response without a
    conversation, or whose conversation was deleted meanwhile, adds nothing. How many items
    were added."""
    conversation_id = getattr(response, "conversation_id", None)
    if conversation_id is None or task.state != TaskState.COMPLETED:
        return 0
    conversation = get(conn, Conversation, conversation_id, for_update=True)
    if conversation is None:
        return 0
    messages = own_input(json.loads(response.request)) or []
    choice_of = Attempt.load(task.snapshot).choice_of()
    output = [i for i in json.loads(response.output) if choice_of.get(i.get("id"), 0) == 0]
    items = input_items(response.id, messages) + output
    return len(_append(conn, conversation, items, response.id, now))


def _append(
    conn: Connection,
    conversation: Conversation,
    items: Sequence[dict[str, Any]],
    response_id: str | None,
    now: float,
) -> list[ConversationItem]:
    start = conversation.next_position
    rows = [
        ConversationItem(
            id=item["id"],
            conversation_id=conversation.id,
            position=start + offset,
            item=json.dumps(item),
            response_id=response_id,
            created_at=now,
        )
        for offset, item in enumerate(items)
    ]
    if rows:
        conn.execute(_INSERT_ITEMS, [row.model_dump() for row in rows])
        conversation.next_position = start + len(rows)
        conn.execute(
            _ADVANCE, {"key_id": conversation.id, "next_position": conversation.next_position}
        )
    return rows
