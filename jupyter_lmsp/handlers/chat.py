"""`/lmsp/v1/chat/completions`: the older OpenAI API, plain or streamed.

The stream is the Chat Completions format, not LMSP's event format: `data:` lines only, each a
`chat.completion.chunk`, `: keep-alive` comments while idle, and `data: [DONE]` at the end. A
client that goes away before the completion is finished cancels its task: nobody is left to
receive the text.

`Idempotency-Key` (LMSP B8) works as for `/responses`: a repeated request gets the first one's
completion (or its chunks, read back from the task's stored events) and starts nothing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

from ..protocol.chat import ChatCompletion, ChatCompletionChunk, CreateChatCompletionRequest
from ..protocol.errors import Error, conflict
from ..protocol.operations import EventStream, Reply
from ..protocol.validation import validate
from ..services import chat
from .base import LMSPHandler, operation

CHUNKS = EventStream(
    "ChatStreamItem",
    (ChatCompletionChunk, Error),
    framed=False,
    done=chat.DONE,
    description="One `data:` line of a chat stream: a ChatCompletionChunk, an Error if the task "
    "failed or was cancelled after the stream began, or `[DONE]` last.",
)


class ChatCompletionsHandler(LMSPHandler):
    run: chat.ChatRun | None = None
    done: bool = False

    @operation(
        "createChatCompletion",
        "Create a chat completion (the older OpenAI API), plain or streamed",
        "chat",
        access="responses:write",
        replies={
            200: Reply(
                "The chat completion, or with `stream: true` an SSE stream of `data:` lines "
                "(ChatCompletionChunk objects, `: keep-alive` comments, `data: [DONE]` last; "
                "a failure after the first chunk arrives as a `data:` Error).",
                ChatCompletion,
                stream=CHUNKS,
            )
        },
        errors=(404, 409, 429, 500),
        idempotent=True,
    )
    async def post(self, body: CreateChatCompletionRequest) -> None:
        self.run = await chat.start_chat_completion(self.ctx, body, self.caller, self.keyed)
        await self._answer(bool(body.stream))

    async def replay_response_result(self, response_id: str, parsed: Any) -> None:
        """A repeated request whose first one is still generating, or was streamed."""
        request = validate(CreateChatCompletionRequest, parsed)
        run = await chat.existing_run(self.ctx, response_id, request, self.caller)
        if not await chat.is_finished(self.ctx, run):
            raise conflict(
                "idempotency_key_in_use",
                "The chat completion started with this 'Idempotency-Key' is still being generated.",
                retry_after=1,
            )
        # Finished: nothing to cancel if this client goes away.
        self.done = True
        self.run = run
        await self._answer(bool(request.stream))

    async def _answer(self, stream: bool) -> None:
        assert self.run is not None
        try:
            if stream:
                await self.write_chat_sse(*chat.stream(self.ctx, self.run))
            else:
                completion = await chat.wait_for_completion(self.ctx, self.run)
                self.done = True
                self.write_json(completion)
        finally:
            self.done = True

    async def write_chat_sse(
        self,
        chunks: AsyncGenerator[chat.Chunk, None],
        ready: Callable[[], bool] = lambda: False,
    ) -> None:
        # The chunks of events already at hand go out in one write (`stream_sse`).
        if not await self.stream_sse(self._chat_frames(chunks), ready):
            await self._cancel_unfinished()

    async def _chat_frames(
        self, chunks: AsyncGenerator[chat.Chunk, None]
    ) -> AsyncGenerator[str, None]:
        try:
            async for item in chunks:
                if item is None:
                    yield ": keep-alive\n\n"
                elif isinstance(item, chat.ChunkJSON):
                    yield f"data: {item}\n\n"
                elif item == chat.DONE:
                    self.done = True
                    yield "data: [DONE]\n\n"
                else:
                    yield f"data: {json.dumps(item, separators=(',', ':'))}\n\n"
        finally:
            await chunks.aclose()

    def on_connection_close(self) -> None:
        super().on_connection_close()
        if self.run is not None and not self.done:
            asyncio.get_running_loop().create_task(self._cancel_unfinished())

    async def _cancel_unfinished(self) -> None:
        if self.run is not None and not self.done:
            self.done = True
            await chat.cancel(self.ctx, self.run)
