"""`/lmsp/v1/conversations` (OpenAI's Conversations API): create, retrieve, update metadata,
delete; add, list, retrieve and delete items."""

from __future__ import annotations

from ..protocol.conversations import (
    AddItemsRequest,
    ConversationDeleted,
    ConversationItemList,
    ConversationObject,
    CreateConversationRequest,
    IncludeQuery,
    ListItemsQuery,
    UpdateConversationRequest,
)
from ..protocol.operations import Reply
from ..services import conversations
from .base import LMSPHandler, operation


class ConversationsHandler(LMSPHandler):
    @operation(
        "createConversation",
        "Create a conversation, with its first items and metadata",
        "conversations",
        access="conversations:write",
        replies={200: Reply("The conversation.", ConversationObject)},
        idempotent=True,
    )
    async def post(self, body: CreateConversationRequest | None = None) -> None:
        body = body if body is not None else CreateConversationRequest()
        self.write_json(
            await self.call(conversations.create_conversation, self.ctx.db, body, self.caller)
        )


class ConversationHandler(LMSPHandler):
    @operation(
        "getConversation",
        "Retrieve a conversation",
        "conversations",
        access="conversations:read",
        replies={200: Reply("The conversation.", ConversationObject)},
        errors=(404,),
    )
    async def get(self, conversation_id: str) -> None:
        self.write_json(
            await self.call(
                conversations.get_conversation, self.ctx.db, conversation_id, self.caller
            )
        )

    @operation(
        "updateConversation",
        "Replace a conversation's metadata",
        "conversations",
        access="conversations:write",
        replies={200: Reply("The conversation.", ConversationObject)},
        errors=(404,),
        idempotent=True,
    )
    async def post(self, conversation_id: str, body: UpdateConversationRequest) -> None:
        self.write_json(
            await self.call(
                conversations.update_conversation,
                self.ctx.db,
                conversation_id,
                body,
                self.caller,
            )
        )

    @operation(
        "deleteConversation",
        "Delete a conversation and its items",
        "conversations",
        access="conversations:write",
        replies={200: Reply("Deleted.", ConversationDeleted)},
        errors=(404,),
    )
    async def delete(self, conversation_id: str) -> None:
        self.write_json(
            await self.call(
                conversations.delete_conversation, self.ctx.db, conversation_id, self.caller
            )
        )


class ConversationItemsHandler(LMSPHandler):
    @operation(
        "listConversationItems",
        "A page of a conversation's items",
        "conversations",
        access="conversations:read",
        replies={200: Reply("A page of items.", ConversationItemList)},
        errors=(404,),
    )
    async def get(self, conversation_id: str, query: ListItemsQuery) -> None:
        self.write_json(
            await self.call(
                conversations.list_items,
                self.ctx.db,
                conversation_id,
                self.caller,
                after=query.after,
                limit=query.limit,
                order=query.order,
            )
        )

    @operation(
        "createConversationItems",
        "Add items after a conversation's last one",
        "conversations",
        access="conversations:write",
        replies={200: Reply("The items added.", ConversationItemList)},
        errors=(404,),
        idempotent=True,
    )
    async def post(self, conversation_id: str, body: AddItemsRequest, query: IncludeQuery) -> None:
        self.write_json(
            await self.call(
                conversations.add_items, self.ctx.db, conversation_id, body, self.caller
            )
        )


class ConversationItemHandler(LMSPHandler):
    @operation(
        "getConversationItem",
        "Retrieve one item of a conversation",
        "conversations",
        access="conversations:read",
        replies={200: Reply("The item, as stored.", schema={"type": "object"})},
        errors=(404,),
    )
    async def get(self, conversation_id: str, item_id: str, query: IncludeQuery) -> None:
        self.write_json(
            await self.call(
                conversations.get_item, self.ctx.db, conversation_id, item_id, self.caller
            )
        )

    @operation(
        "deleteConversationItem",
        "Delete one item of a conversation",
        "conversations",
        access="conversations:write",
        replies={200: Reply("The conversation.", ConversationObject)},
        errors=(404,),
    )
    async def delete(self, conversation_id: str, item_id: str) -> None:
        self.write_json(
            await self.call(
                conversations.delete_item, self.ctx.db, conversation_id, item_id, self.caller
            )
        )
