"""`/lmsp/v1/chat/completions`: the older OpenAI API, plain or streamed.

The stream is the Chat Completions format, not LMSP's event format: `data:` lines only, each a
`chat.completion.chunk`, `: keep-alive` comments while idle, and `data: [DONE]` at the end. A
client that goes away before the completion is finished cancels its task: nobody is left to
receive the text.

`Idempotency-Key` (LMSP B8) works as for `/responses`: a repeated request gets the first one's
completion (or its chunks, read back from the task's stored events) and starts nothing.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from ..protocol.chat import parse_chat_request
from ..protocol.errors import conflict
from ..services import chat
from ..store.tables import IdempotencyKey
from .base import LMSPHandler, allow_unauthenticated, idempotent, requires


class ChatCompletionsHandler(LMSPHandler):
    run: chat.ChatRun | None = None
    done: bool = False

    @allow_unauthenticated
    @requires("responses:write")
    @idempotent
    async def post(self) -> None:
        request = parse_chat_request(self.json_body())
        self.run = await chat.start_chat_completion(self.ctx, request, self.caller, self.keyed)
        await self._answer(request.stream)

    async def replay_response_result(self, row: IdempotencyKey) -> None:
        """A repeated request whose first one is still generating, or was streamed."""
        assert row.response_id is not None
        request = parse_chat_request(self.json_body())
        run = chat.existing_run(self.ctx, row.response_id, request, self.caller)
        if not chat.is_finished(self.ctx, run):
            raise conflict(
                "idempotency_key_in_use",
                "The chat completion started with this 'Idempotency-Key' is still being generated.",
                retry_after=1,
            )
        # Finished: nothing to cancel if this client goes away.
        self.done = True
        self.run = run
        await self._answer(request.stream)

    async def _answer(self, stream: bool) -> None:
        assert self.run is not None
        try:
            if stream:
                await self.write_chat_sse(chat.chunks(self.ctx, self.run))
            else:
                completion = await chat.wait_for_completion(self.ctx, self.run)
                self.done = True
                self.write_json(completion)
        finally:
            self.done = True

    async def write_chat_sse(self, chunks: AsyncIterator[chat.Chunk]) -> None:
        if not await self.stream_sse(self._chat_frames(chunks)):
            self._cancel_unfinished()

    async def _chat_frames(self, chunks: AsyncIterator[chat.Chunk]) -> AsyncIterator[str]:
        try:
            async for item in chunks:
                if item is None:
                    yield ": keep-alive\n\n"
                elif item == chat.DONE:
                    self.done = True
                    yield "data: [DONE]\n\n"
                else:
                    yield f"data: {json.dumps(item, separators=(',', ':'))}\n\n"
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    def on_connection_close(self) -> None:
        super().on_connection_close()
        self._cancel_unfinished()

    def _cancel_unfinished(self) -> None:
        if self.run is not None and not self.done:
            self.done = True
            chat.cancel(self.ctx, self.run)
