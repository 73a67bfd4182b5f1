"""`POST /embeddings` on the wire (issue 39): OpenAI's embeddings request and its list.

The request is OpenAI's: `input` is a string, a list of strings, a list of token ids (one
input) or a list of such lists, at most `MAX_INPUTS` of them, none empty; `encoding_format`
is `float` (lists of numbers) or `base64` (each vector's float32 values, little-endian, in
base64: what the openai SDK asks for by default and decodes itself); `dimensions` shortens the
vectors of an embedding model (docs/protocol.md, "Embeddings").
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from .fields import KEEP_ALIVE_DOC, Body, KeepAlive, WireObject, refuse

# OpenAI's own limit on inputs per request.
MAX_INPUTS = 2048
# A token id is an index into a vocabulary: the largest any model has is far below this.
MAX_TOKEN_ID = 2**31 - 1

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Text = Annotated[str, Field(min_length=1)]
Tokens = Annotated[list[TokenId], Field(min_length=1)]
_SHAPES = (
    "'input' must be a string, a list of strings, a list of token ids or a list of token-id "
    "lists (one kind throughout)."
)


class CreateEmbeddingRequest(Body):
    input: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
        | Tokens
        | Annotated[list[Tokens], Field(min_length=1, max_length=MAX_INPUTS)]
    ) = Field(
        description="What to embed: a string, a list of strings, a list of token ids (one "
        "input), or a list of token-id lists; at most 2048 inputs, none empty."
    )
    model: str | None = Field(None, description="The model (the default model when absent).")
    encoding_format: Literal["float", "base64"] = Field(
        "float",
        description="`float`: each vector a list of numbers; `base64`: its float32 values "
        "(little-endian) in base64.",
    )
    dimensions: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="Shorten the vectors to this many dimensions (then scaled to unit length "
        "again); only for an embedding model, up to its vector size.",
    )
    user: str | None = Field(None, description="Accepted and ignored, as OpenAI's end-user id.")
    keep_alive: KeepAlive | None = Field(None, description=KEEP_ALIVE_DOC)

    @field_validator("input", mode="before")
    @classmethod
    def _one_shape(cls, value: Any) -> Any:
        """Refuse, with a message that says which, what fits none of the four shapes."""
        if isinstance(value, str):
            if not value:
                raise refuse("invalid_value", "'input' must not be an empty string.")
            return value
        if not isinstance(value, list):
            raise refuse("invalid_type", _SHAPES)
        if not value:
            raise refuse("invalid_value", "'input' must hold at least one input.")
        if len(value) > MAX_INPUTS:
            raise refuse("invalid_value", f"'input' may hold at most {MAX_INPUTS} inputs.")
        kinds = {type(item) for item in value}
        if kinds == {str}:
            if not all(value):
                raise refuse("invalid_value", "An input of 'input' is an empty string.")
        elif kinds == {list}:
            if not all(value):
                raise refuse("invalid_value", "An input of 'input' is an empty token list.")
        elif kinds != {int}:
            raise refuse("invalid_type", _SHAPES)
        return value

    def inputs(self) -> list[str | list[int]]:
        """The inputs, one entry per vector."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [[int(t) for t in value if isinstance(t, int)]]
        return [item for item in value if isinstance(item, str | list)]


class Embedding(WireObject):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(
        description="The vector (unit length), or its float32 values in base64."
    )


class EmbeddingUsage(WireObject):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(WireObject):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
