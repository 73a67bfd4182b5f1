"""`/lmsp/v1/embeddings`: OpenAI's embeddings endpoint (issue 39), answered at once."""

from __future__ import annotations

from ..protocol.embeddings import CreateEmbeddingRequest, EmbeddingList
from ..protocol.operations import Reply
from ..services import embeddings
from .base import LMSPHandler, operation


class EmbeddingsHandler(LMSPHandler):
    @operation(
        "createEmbeddings",
        "Embed texts or token lists (OpenAI's embeddings API)",
        "embeddings",
        access="responses:write",
        replies={200: Reply("The vectors, one per input, in input order.", EmbeddingList)},
        errors=(404, 409, 500),
    )
    async def post(self, body: CreateEmbeddingRequest) -> None:
        data = await embeddings.create_embeddings(self.ctx, body)
        self.set_status(200)
        self.set_header("Content-Type", "application/json")
        self.finish(data)
