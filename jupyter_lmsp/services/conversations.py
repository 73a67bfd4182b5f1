"""Conversations (OpenAI's Conversations API): creating one with its first items, reading,
new metadata, deleting; adding, listing, reading and deleting its items; and the history a
response created with `conversation` is given (`history`).

Plain functions: the handlers run them on a database thread (`LMSPHandler.call`). A
conversation belongs to the caller that created it and is seen as a response is (LMSP B12):
a paired client sees only its own, the Jupyter user its own and its clients'; anyone else's
is a 404. A response's turn joins its conversation in the store, in the transaction that ends
the response (`store.conversations.join_turn`).
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..auth.scopes import Caller
from ..protocol.conversations import (
    AddItemsRequest,
    ConversationDeleted,
    ConversationItemList,
    ConversationObject,
    CreateConversationRequest,
    UpdateConversationRequest,
    conversation_item,
    history_messages,
)
from ..protocol.errors import invalid, not_found
from ..protocol.ids import new_id
from ..store import conversations as store
from ..store.database import Database
from ..store.tables import Conversation, ConversationItem

# The scope a paired client needs to write to a conversation (a response created in one
# writes its turn there) and to read one.
WRITE = "conversations:write"
READ = "conversations:read"


def conversation_object(conversation: Conversation) -> dict[str, Any]:
    return ConversationObject(
        id=conversation.id,
        created_at=int(conversation.created_at),
        metadata=json.loads(conversation.labels),
    ).model_dump(mode="json")


def _page(rows: list[ConversationItem], has_more: bool) -> dict[str, Any]:
    return ConversationItemList(
        data=[json.loads(r.item) for r in rows],
        first_id=rows[0].id if rows else None,
        last_id=rows[-1].id if rows else None,
        has_more=has_more,
    ).model_dump(mode="json")


def _visible(
    db: Database, conversation_id: str, caller: Caller, param: str | None = None
) -> Conversation:
    conversation = store.get_conversation(db, conversation_id)
    if conversation is None or not caller.can_see(conversation.owner):
        raise not_found("conversation", conversation_id, param=param)
    return conversation


def create_conversation(
    db: Database, body: CreateConversationRequest, caller: Caller
) -> dict[str, Any]:
    conversation = Conversation(
        id=new_id("conv"),
        owner=caller.id,
        labels=json.dumps(body.metadata or {}),
        created_at=time.time(),
    )
    store.create_conversation(db, conversation, [conversation_item(i) for i in body.items or []])
    return conversation_object(conversation)


def get_conversation(db: Database, conversation_id: str, caller: Caller) -> dict[str, Any]:
    return conversation_object(_visible(db, conversation_id, caller))


def update_conversation(
    db: Database, conversation_id: str, body: UpdateConversationRequest, caller: Caller
) -> dict[str, Any]:
    _visible(db, conversation_id, caller)
    updated = store.update_metadata(db, conversation_id, body.metadata or {})
    if updated is None:
        raise not_found("conversation", conversation_id)
    return conversation_object(updated)


def delete_conversation(db: Database, conversation_id: str, caller: Caller) -> dict[str, Any]:
    """Delete a conversation and its items (the responses of its turns stay)."""
    _visible(db, conversation_id, caller)
    store.delete_conversation(db, conversation_id)
    return ConversationDeleted(id=conversation_id).model_dump(mode="json")


def add_items(
    db: Database, conversation_id: str, body: AddItemsRequest, caller: Caller
) -> dict[str, Any]:
    """Append items after the conversation's last one; the page of the items added."""
    _visible(db, conversation_id, caller)
    rows = store.add_items(db, conversation_id, [conversation_item(i) for i in body.items])
    if rows is None:
        raise not_found("conversation", conversation_id)
    return _page(rows, False)


def list_items(
    db: Database,
    conversation_id: str,
    caller: Caller,
    *,
    after: str | None = None,
    limit: int = 20,
    order: str = "desc",
) -> dict[str, Any]:
    _visible(db, conversation_id, caller)
    found = store.list_items(db, conversation_id, after=after, limit=limit, order=order)
    if found is None:
        raise not_found("conversation", conversation_id)
    return _page(*found)


def get_item(db: Database, conversation_id: str, item_id: str, caller: Caller) -> dict[str, Any]:
    _visible(db, conversation_id, caller)
    row = store.get_item(db, conversation_id, item_id)
    if row is None:
        raise not_found("item", item_id)
    item: dict[str, Any] = json.loads(row.item)
    return item


def delete_item(db: Database, conversation_id: str, item_id: str, caller: Caller) -> dict[str, Any]:
    """Delete one item; the conversation, as OpenAI answers."""
    conversation = _visible(db, conversation_id, caller)
    if not store.delete_item(db, conversation_id, item_id):
        raise not_found("item", item_id)
    return conversation_object(conversation)


def history(db: Database, conversation_id: str, caller: Caller) -> list[dict[str, Any]]:
    """The messages a response created in the conversation is given before its input: the
    conversation's items, oldest first. The caller must be allowed to write to it."""
    caller.require(WRITE)
    _visible(db, conversation_id, caller, param="conversation")
    items = store.conversation_items(db, conversation_id)
    if items is None:
        raise not_found("conversation", conversation_id, param="conversation")
    return history_messages(items)


def conversation_id_of(value: Any) -> str | None:
    """The `conversation` of a `POST /responses` body: an id, or `{"id": ...}`."""
    if value is None:
        return None
    if isinstance(value, str) and value:
        return value
    if isinstance(value, dict) and isinstance(value.get("id"), str) and value["id"]:
        return str(value["id"])
    raise invalid(
        "'conversation' must be a conversation id or an object with its 'id'.",
        param="conversation",
    )
