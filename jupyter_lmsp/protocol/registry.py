"""The model registry on the wire (LMSP B4): models in the OpenAI list shape with LMSP's registry
fields, and `POST /models` bodies."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from .fields import Body, WireObject

MODEL_ID_PATTERN = "^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"
ModelState = Literal["available", "loaded", "missing", "corrupt"]


class RegisterModelRequest(Body):
    source: Annotated[
        str,
        Field(
            pattern="\\S",
            description="A local MLX model directory, a Hugging Face repo id found in the local "
            "cache, `hf://ORG/NAME[@REVISION]` (downloaded from the hub into the Hugging Face "
            "cache), or a GGUF file (converted into the model store).",
        ),
    ]
    id: Annotated[str, Field(pattern=MODEL_ID_PATTERN)] | None = Field(
        None, description="The model's id (derived from the source when absent)."
    )


class ModelFile(WireObject):
    path: str
    size: Annotated[int, Field(ge=0)]
    sha256: str


class Model(WireObject):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    format: str
    path: str | None = Field(description="Its folder on the host; null for a paired client.")
    size_bytes: Annotated[int, Field(ge=0)]
    digest: str | None = Field(description="`sha256:` over its files' digests.")
    files: list[ModelFile] | None = Field(
        description="Its files (relative paths); null for a paired client."
    )
    state: ModelState
    source: str | None = Field(
        description="A Hugging Face repo id, or the path registered from (null for a paired "
        "client)."
    )
    loaded_bytes: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="The bytes its weights take in this server's inference worker while it is "
        "loaded (`state: loaded`); null when it is not.",
    )


class ModelList(WireObject):
    object: Literal["list"] = "list"
    data: list[Model]


class ModelDeleted(WireObject):
    id: str
    object: Literal["model"] = "model"
    deleted: Literal[True] = True
