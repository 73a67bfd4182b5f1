"""The building blocks of the wire models: base classes and field types with JSON's semantics.

Request bodies (`Body`) are validated strictly, as JSON reads them: a string is not a number,
`true` is not `1`, NaN and infinities are not numbers (and `8.0` is the integer 8, as JSON
Schema's `integer` has it: protocol.validation parses integral numbers as integers). Unknown fields are refused. Objects the service returns
(`WireObject`) are built through their models, so what is sent is what the document says.

Fields accepted only with a value that asks for nothing the service would not do anyway
(`tools: []`, `tool_choice: "auto"`) are declared with `Neutral(...)`: any other value is
refused with `unsupported_parameter` naming the field, and the OpenAPI document lists exactly
the accepted values. When a body has several such fields, the error names the one declared
first, so a model declares them in order of significance (`tools` before `tool_choice`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field
from pydantic.json_schema import GetJsonSchemaHandler, JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema

__all__ = [
    "ID_PATTERN",
    "Body",
    "Neutral",
    "Query",
    "WireObject",
    "by_json_type",
    "json_equal",
    "optional_on_wire",
    "refuse",
]

# The characters of every id (responses, tasks, models, pairings, clients): the routes match
# only these.
ID_PATTERN = "^[A-Za-z0-9_.-]+$"


class Body(BaseModel):
    """A request body: strict JSON types, unknown fields refused (`unknown_parameter`)."""

    model_config = ConfigDict(
        extra="forbid", strict=True, allow_inf_nan=False, validate_default=False
    )


class Query(BaseModel):
    """Query parameters: strings from the URL, converted (`"8"` is 8, `"true"` is true)."""

    model_config = ConfigDict(extra="ignore", strict=False, allow_inf_nan=False)


class WireObject(BaseModel):
    """An object the service sends. Every field it has is declared: a builder that adds an
    undeclared one fails at once instead of sending something the document does not say."""

    model_config = ConfigDict(
        extra="forbid", allow_inf_nan=False, json_schema_serialization_defaults_required=True
    )

    def wire(self) -> dict[str, Any]:
        """The JSON-ready dict, as sent."""
        return self.model_dump(mode="json", by_alias=True)


def optional_on_wire(*names: str) -> Callable[[dict[str, Any]], None]:
    """`json_schema_extra` for an object that leaves out `names` when they do not apply (every
    other field of a `WireObject` is always sent, so its schema requires it)."""

    def adjust(schema: dict[str, Any]) -> None:
        required = [n for n in schema.get("required", []) if n not in names]
        if required:
            schema["required"] = required
        else:
            schema.pop("required", None)

    return adjust


def refuse(code: str, message: str, **context: Any) -> PydanticCustomError:
    """A validation error carrying an LMSP error `code` (see protocol.validation). `message` may
    say `{param}`: it becomes the path of the offending field."""
    return PydanticCustomError(code, message, context or None)


def json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON has it: `0` is not `false`, `1.0` is `1`."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


# eq=False: two markers are the same only if they are one object (`Neutral(0)` would otherwise
# equal `Neutral(False)`, as `0 == False` in Python, and pydantic would reuse one's schema).
@dataclass(frozen=True, eq=False)
class Neutral:
    """Field metadata: the field is accepted only as null or one of `values`, which change
    nothing the service does; anything else is `unsupported_parameter`.

    `tools: Annotated[Any, Neutral([])] = None` accepts a missing `tools`, `null` and `[]`.
    `message` replaces the standard error message (it may say `{param}`).
    """

    values: tuple[Any, ...]
    message: str | None

    def __init__(self, *values: Any, message: str | None = None) -> None:
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "message", message)

    def accepts(self, value: Any) -> bool:
        return value is None or any(json_equal(value, v) for v in self.values)

    def __get_pydantic_core_schema__(
        self, source: Any, handler: Callable[[Any], core_schema.CoreSchema]
    ) -> core_schema.CoreSchema:
        def check(value: Any) -> Any:
            if not self.accepts(value):
                raise refuse(
                    "unsupported_parameter",
                    self.message
                    or "The parameter '{param}' with this value is not supported by this service.",
                )
            return value

        return core_schema.no_info_plain_validator_function(
            check, serialization=core_schema.plain_serializer_function_ser_schema(lambda v: v)
        )

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        if not self.values:
            return {"type": "null", "description": "Accepted only as null (not supported)."}
        return {
            "anyOf": [*({"const": v} for v in self.values), {"type": "null"}],
            "description": "Accepted only with these values (they change nothing).",
        }


def _json_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    return None


def by_json_type(expected: str) -> Discriminator:
    """Metadata for a union whose members are tagged `Tag("string")`, `Tag("array")` or
    `Tag("object")`: the member is chosen by the JSON type of the value, so only its errors are
    reported (a bad message inside `input`'s list is named, not drowned among "not a string"
    errors). A value of another type is `invalid_value`: "'{param}' must be `expected`"."""
    return Discriminator(
        _json_kind,
        custom_error_type="invalid_value",
        custom_error_message="'{param}' must be " + expected,
    )


# The shared fields of both generation APIs (Responses, Chat Completions).

MAX_METADATA_KEYS = 16


def _check_metadata(value: Any) -> Any:
    if value is None:
        return value
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA_KEYS
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in value.items()
        )
    ):
        raise refuse(
            "invalid_value",
            "'{param}' is at most 16 string keys (64 chars) with string values (512 chars).",
        )
    return value


Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(
        max_length=MAX_METADATA_KEYS,
        description="At most 16 string keys (64 characters) with string values (512 characters).",
    ),
    BeforeValidator(_check_metadata),
]

Temperature = Annotated[float, Field(ge=0, le=2, description="0 is greedy decoding.")]
TopP = Annotated[float, Field(gt=0, le=1)]
Penalty = Annotated[
    float,
    Field(
        ge=-2,
        le=2,
        description="Subtracted from a token's logit (presence: once if the answer has it; "
        "frequency: once per time it has it), counting the tokens generated, not the prompt.",
    ),
]
Seed = Annotated[
    int,
    Field(
        ge=0,
        le=2**63 - 1,
        description="LMSP: sampling seed; a random one is chosen (and shown) when absent.",
    ),
]
TokenLimit = Annotated[int, Field(ge=1)]
# Reasoning (issue 37): the effort, as the model's chat template's switch (a model that cannot
# think takes only "none" and "minimal"), and LMSP's thinking budget.
ReasoningEffort = Annotated[
    Literal["none", "minimal", "low", "medium", "high", "xhigh"],
    Field(
        description="A thinking model thinks unless `none` or `minimal` (its chat template's "
        "`enable_thinking`); a template with `reasoning_effort` (gpt-oss) gets the level. A "
        "model that cannot think takes only `none` and `minimal` (else 400 "
        "`unsupported_parameter`)."
    ),
]
ReasoningBudget = Annotated[
    int,
    Field(
        ge=0,
        description="LMSP: the most tokens a thinking model writes inside its thinking block "
        "(its markers not counted); then the block's end marker is forced and the answer "
        "follows. Default: the service's `max_reasoning_tokens` (none: no limit).",
    ),
]
# Ollama's per-request `keep_alive`, in seconds (Ollama also takes "5m"; LMSP only numbers). An
# LMSP extension on generation and embeddings: OpenAI's APIs have no such field. Its description
# goes on each request's field (`Field(None, description=KEEP_ALIVE_DOC)`): on the number inside
# `anyOf: [number, null]` the OpenAPI document's readers do not show it.
KeepAlive = Annotated[float, Field(allow_inf_nan=False)]
KEEP_ALIVE_DOC = (
    "LMSP extension (as Ollama's `keep_alive`; OpenAI's API has no such field): seconds the "
    "model stays loaded once idle after this request. 0: unloaded as soon as the request is "
    "done; negative: kept until evicted for room or unloaded on request; absent: the server's "
    "`keep_alive` (300 s by default)."
)
# Sequence numbers in queries and headers: -1 (before the first event) up to what SQLite's
# 64-bit integers hold, so a huge value is a 400, not an overflow.
SequenceNumber = Annotated[int, Field(ge=-1, le=2**63 - 1)]
Label = Annotated[str, Field(description="A label for the caller's own bookkeeping; not used.")]

Role = Literal["user", "assistant", "system", "developer"]


# The queue's tiers (services.fairqueue.Tier): `auto` and `default` wait as every request does,
# `priority` before its caller's other work, `flex` after it (and after others' work). OpenAI's
# `scale` (capacity bought ahead) has no meaning on a local machine.
def _no_scale_tier(value: Any) -> Any:
    if value == "scale":
        raise refuse(
            "unsupported_parameter",
            "'{param}' 'scale' is capacity bought ahead, which a local service has not; use "
            "'auto', 'default', 'priority' or 'flex'.",
        )
    return value


ServiceTier = Annotated[
    Literal["auto", "default", "priority", "flex"] | None,
    BeforeValidator(_no_scale_tier),
    Field(
        description="The caller's own queued work is served `priority` first, then `auto`/"
        "`default`, then `flex` (which also waits for everyone else's other work)."
    ),
]
