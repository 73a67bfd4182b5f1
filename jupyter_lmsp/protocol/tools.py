"""Tools, structured outputs, stop sequences and log-probabilities on the wire (LMSP B11, issue
15), for both generation APIs: the request shapes, and the plain form every one of them is
turned into (`ToolsSpec`, `FormatSpec`, `logprob_entry`), which the services hand to the engine.

One code path for both APIs: a Responses `text.format` and a Chat Completions `response_format`
become the same `FormatSpec`; Responses `tools` (flat: `{"type": "function", "name", ...}`) and
Chat `tools` (nested: `{"type": "function", "function": {"name", ...}}`) the same `ToolsSpec`.
Function tools exist in both APIs; the Responses API also has `custom` tools (their input is
text: free, or a sentence of a Lark or regex grammar), and groups either kind in a `namespace`
tool (flattened for the model: its tools are offered by their own names, and the calls name the
namespace again); another tool type (`web_search`, …) is refused by name
(`unsupported_parameter`). A tool choice is `auto`, `none`, `required`, one named function or
custom tool, or `allowed_tools` (the model is offered only those, `mode` `auto` or
`required`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag

from .fields import Body, Neutral, WireObject, by_json_type, refuse

# OpenAI's rule for function and schema names (it also keeps them safe in a grammar literal).
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
MAX_TOOLS = 128
# A custom tool's grammar definition (Lark or regex text), at most.
MAX_GRAMMAR_CHARS = 65536

# The include value that asks the Responses API for log-probabilities.
LOGPROBS_INCLUDE = "message.output_text.logprobs"

FunctionName = Annotated[str, Field(pattern=NAME_PATTERN)]
JSONSchema = Annotated[dict[str, Any], Field(description="A JSON Schema (an object).")]


# ---------------------------------------------------------------------------------------------
# stop sequences


Stop = Annotated[
    Annotated[str, Field(min_length=1), Tag("string")]
    | Annotated[
        list[Annotated[str, Field(min_length=1)]],
        Field(max_length=MAX_STOP_SEQUENCES),
        Tag("array"),
    ],
    by_json_type("a string or a list of up to 4 strings"),
    Field(
        description="Up to 4 non-empty strings (or one string): generation stops before the "
        'first of them, which is not part of the output (`finish_reason: "stop"`).'
    ),
]
"""Stop sequences: a string, or a list of up to 4 non-empty strings."""


def stop_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]


# A `tool_choice` that asks for a call ("required" or a named function) needs `tools`: the
# JSON Schema form of that rule, for the request models' `json_schema_extra`.
CHOICE_NEEDS_TOOLS: dict[str, Any] = {
    "if": {
        "required": ["tool_choice"],
        "properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
    },
    "then": {
        "required": ["tools"],
        "properties": {"tools": {"type": "array", "minItems": 1}},
    },
}


def top_logprobs_need(flag: dict[str, Any]) -> dict[str, Any]:
    """`top_logprobs` above 0 needs `flag` (a schema the body must then match)."""
    return {
        "if": {
            "required": ["top_logprobs"],
            "properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
        },
        "then": flag,
    }


# ---------------------------------------------------------------------------------------------
# the plain forms the services use


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool
    # The Responses `namespace` tool this function came in (None for a top-level function).
    namespace: str | None = None

    def wire(self) -> dict[str, Any]:
        """As the Responses API echoes a function tool."""
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict,
        }


@dataclass(frozen=True)
class CustomSpec:
    """A Responses `custom` tool: its input is free text (`syntax` "text") or a sentence of
    `definition` ("lark": llguidance's Lark syntax; "regex": a whole-match regular expression)."""

    name: str
    description: str | None
    syntax: Literal["text", "lark", "regex"] = "text"
    definition: str | None = None
    namespace: str | None = None
    # Where the request put its grammar (`tools[2].format.definition`), for errors.
    param: str = field(default="tools", compare=False)

    def wire(self) -> dict[str, Any]:
        """As the Responses API echoes a custom tool."""
        fmt: dict[str, Any] = {"type": "text"}
        if self.syntax != "text":
            fmt = {"type": "grammar", "syntax": self.syntax, "definition": self.definition}
        return {
            "type": "custom",
            "name": self.name,
            "description": self.description,
            "format": fmt,
        }


@dataclass(frozen=True)
class ToolsSpec:
    """A request's tools and how they may be called: `choice` is "auto", "none", "required"
    or a tool's name; `max_calls` None for no bound. `customs` are the Responses API's
    custom tools."""

    functions: tuple[FunctionSpec, ...]
    choice: str = "auto"
    parallel: bool = True
    max_calls: int | None = None
    customs: tuple[CustomSpec, ...] = ()

    @property
    def active(self) -> bool:
        """Whether the model may call anything at all."""
        return (
            bool(self.functions or self.customs) and self.choice != "none" and self.max_calls != 0
        )

    def to_json(self) -> dict[str, Any]:
        out = {
            "functions": [f.__dict__ for f in self.functions],
            "choice": self.choice,
            "parallel": self.parallel,
            "max_calls": self.max_calls,
        }
        if self.customs:
            out["customs"] = [c.__dict__ for c in self.customs]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ToolsSpec:
        return cls(
            tuple(FunctionSpec(**f) for f in data["functions"]),
            data["choice"],
            data["parallel"],
            data["max_calls"],
            tuple(CustomSpec(**c) for c in data.get("customs", ())),
        )


@dataclass(frozen=True)
class FormatSpec:
    """A structured-output format: "json_schema" (with `schema`) or "json_object"."""

    type: Literal["json_schema", "json_object"]
    schema: dict[str, Any] | None = None
    strict: bool = False
    name: str | None = None
    description: str | None = None
    # Where the request put it (`text.format`, `response_format.json_schema`), for errors.
    param: str = field(default="text.format", compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "schema": self.schema,
            "strict": self.strict,
            "name": self.name,
            "description": self.description,
            "param": self.param,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FormatSpec:
        return cls(**data)

    def responses_wire(self) -> dict[str, Any]:
        """As the Responses API echoes it in `text.format`."""
        if self.type == "json_object":
            return {"type": "json_object"}
        return {
            "type": "json_schema",
            "name": self.name,
            "schema": self.schema,
            "strict": self.strict,
            "description": self.description,
        }


# ---------------------------------------------------------------------------------------------
# Responses API shapes


def _function_tools_only(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type", "function") != "function":
        raise refuse(
            "unsupported_parameter",
            f"'{{param}}' is a {str(value.get('type'))!r} tool; only function tools "
            "('type': 'function') are supported by this service.",
        )
    return value


def _responses_tool_kinds(value: Any) -> Any:
    kinds = ("function", "custom", "namespace")
    if isinstance(value, dict) and value.get("type", "function") not in kinds:
        raise refuse(
            "unsupported_parameter",
            f"'{{param}}' is a {str(value.get('type'))!r} tool; only function and custom tools "
            "(alone or in a 'namespace' tool) are supported by this service.",
        )
    return value


def _namespaced_tool_kinds(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type", "function") not in ("function", "custom"):
        raise refuse(
            "unsupported_parameter",
            f"'{{param}}' is a {str(value.get('type'))!r} tool; a namespace holds function and "
            "custom tools only.",
        )
    return value


def _tool_kind(value: Any) -> str | None:
    return value.get("type") if isinstance(value, dict) else None


class FunctionTool(Body):
    """A function tool of `POST /responses` (`strict` defaults to true, as in the OpenAI API)."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: JSONSchema | None = Field(
        None, description="The JSON Schema of the arguments (an object with no properties if null)."
    )
    strict: bool | None = Field(
        None, description="Arguments follow `parameters` exactly (default true)."
    )
    # What the openai SDK may send beside, accepted only when they change nothing.
    allowed_callers: Annotated[Any, Neutral(["direct"])] = None
    defer_loading: Annotated[Any, Neutral(False)] = None
    async_: Annotated[Any, Neutral(False)] = Field(None, alias="async")
    output_schema: Annotated[Any, Neutral()] = None

    def spec(self, namespace: str | None = None) -> FunctionSpec:
        return FunctionSpec(
            self.name,
            self.description,
            self.parameters,
            True if self.strict is None else self.strict,
            namespace,
        )

    def specs(self) -> list[FunctionSpec]:
        return [self.spec()]

    def customs(self) -> list[CustomSpec]:
        return []

    def echo(self) -> dict[str, Any]:
        return self.spec().wire()


class TextInput(Body):
    """A custom tool's input is free text."""

    type: Literal["text"]


class GrammarInput(Body):
    """A custom tool's input is a sentence of a grammar: `lark` (llguidance's Lark syntax, as
    OpenAI's) or `regex` (Rust `regex` syntax, matched whole)."""

    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]


class CustomTool(Body):
    """A `custom` tool of `POST /responses`: the model writes text for it instead of JSON
    arguments; with a grammar `format` the text is constrained to the grammar's sentences."""

    type: Literal["custom"]
    name: FunctionName
    description: str | None = None
    format: Annotated[TextInput | GrammarInput, Field(discriminator="type")] | None = Field(
        None, description="`{'type': 'text'}` (the default) or a grammar."
    )
    allowed_callers: Annotated[Any, Neutral(["direct"])] = None
    defer_loading: Annotated[Any, Neutral(False)] = None
    async_: Annotated[Any, Neutral(False)] = Field(None, alias="async")

    def custom_spec(self, namespace: str | None = None) -> CustomSpec:
        if isinstance(self.format, GrammarInput):
            return CustomSpec(
                self.name, self.description, self.format.syntax, self.format.definition, namespace
            )
        return CustomSpec(self.name, self.description, namespace=namespace)

    def specs(self) -> list[FunctionSpec]:
        return []

    def customs(self) -> list[CustomSpec]:
        return [self.custom_spec()]

    def echo(self) -> dict[str, Any]:
        return self.custom_spec().wire()


def _namespaced_kind(value: Any) -> str | None:
    kind = value.get("type", "function") if isinstance(value, dict) else None
    return kind if kind in ("function", "custom") else None


class NamespaceTool(Body):
    """A Responses `namespace` tool: function and custom tools grouped under a name (Codex
    sends one). The model is offered the tools by their own names; a call of one carries
    `namespace`, and a call sent back as input may carry it too."""

    type: Literal["namespace"]
    name: FunctionName
    description: str = Field(description="Shown to the model with the namespace's tools.")
    tools: Annotated[
        list[
            Annotated[
                Annotated[FunctionTool, Tag("function")] | Annotated[CustomTool, Tag("custom")],
                Discriminator(
                    _namespaced_kind,
                    custom_error_type="invalid_value",
                    custom_error_message="'{param}' must be a function tool or a custom tool",
                ),
                BeforeValidator(_namespaced_tool_kinds),
            ]
        ],
        Field(min_length=1, max_length=MAX_TOOLS),
    ]

    def _described(self, description: str | None) -> str:
        # The model sees the tools only, so each says what its namespace is for.
        return f"{self.description}\n\n{description}" if description else self.description

    def specs(self) -> list[FunctionSpec]:
        return [
            replace(spec, description=self._described(spec.description))
            for spec in (
                tool.spec(self.name) for tool in self.tools if isinstance(tool, FunctionTool)
            )
        ]

    def customs(self) -> list[CustomSpec]:
        return [self.custom_of(tool) for tool in self.tools if isinstance(tool, CustomTool)]

    def custom_of(self, tool: CustomTool) -> CustomSpec:
        spec = tool.custom_spec(self.name)
        return replace(spec, description=self._described(spec.description))

    def echo(self) -> dict[str, Any]:
        return {
            "type": "namespace",
            "name": self.name,
            "description": self.description,
            "tools": [tool.echo() for tool in self.tools],
        }


ResponsesTool = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[CustomTool, Tag("custom")]
    | Annotated[NamespaceTool, Tag("namespace")],
    Discriminator(
        _tool_kind,
        custom_error_type="invalid_value",
        custom_error_message="'{param}' must be a function tool, a custom tool or a namespace tool",
    ),
    BeforeValidator(_responses_tool_kinds),
]

ResponsesTools = Annotated[list[ResponsesTool], Field(max_length=MAX_TOOLS)]


def flat_functions(tools: list[FunctionTool | CustomTool | NamespaceTool]) -> list[FunctionSpec]:
    """Every function of `tools`, namespaces flattened, in order."""
    return [spec for tool in tools for spec in tool.specs()]


def flat_customs(tools: list[FunctionTool | CustomTool | NamespaceTool]) -> list[CustomSpec]:
    """Every custom tool of `tools`, namespaces flattened, in order, each knowing where the
    request put it (`param`)."""
    out = []
    for i, tool in enumerate(tools):
        if isinstance(tool, CustomTool):
            out.append(replace(tool.custom_spec(), param=f"tools[{i}].format.definition"))
        elif isinstance(tool, NamespaceTool):
            for j, inner in enumerate(tool.tools):
                if isinstance(inner, CustomTool):
                    spec = tool.custom_of(inner)
                    out.append(replace(spec, param=f"tools[{i}].tools[{j}].format.definition"))
    return out


def _function_choice_only(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type", "function") != "function":
        raise refuse(
            "unsupported_parameter",
            f"'{{param}}' of type {str(value.get('type'))!r} is not supported; use 'auto', "
            "'none', 'required' or {'type': 'function', 'name': ...}.",
        )
    return value


class FunctionChoice(Body):
    type: Literal["function"]
    name: str


class CustomChoice(Body):
    """`tool_choice: {"type": "custom", "name": ...}`: a call of that custom tool."""

    type: Literal["custom"]
    name: str


def _allowed_kinds(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "custom":
        return value
    return _function_choice_only(value)


def _allowed_kind(value: Any) -> str | None:
    return "custom" if isinstance(value, dict) and value.get("type") == "custom" else "function"


class AllowedTools(Body):
    """`tool_choice: {"type": "allowed_tools", ...}`: the model may call only these functions
    (`mode` `auto`: or answer in text; `required`: at least one call)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: Annotated[
        list[
            Annotated[
                Annotated[FunctionChoice, Tag("function")] | Annotated[CustomChoice, Tag("custom")],
                Discriminator(_allowed_kind),
                BeforeValidator(_allowed_kinds),
            ]
        ],
        Field(min_length=1, max_length=MAX_TOOLS),
    ]


def _responses_choice_kinds(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") in ("allowed_tools", "custom"):
        return value
    return _function_choice_only(value)


def _choice_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        kind = value.get("type")
        return kind if kind in ("allowed_tools", "custom") else "function"
    return None


ResponsesToolChoice = Annotated[
    Annotated[Literal["auto", "none", "required"], Tag("string")]
    | Annotated[FunctionChoice, Tag("function")]
    | Annotated[CustomChoice, Tag("custom")]
    | Annotated[AllowedTools, Tag("allowed_tools")],
    Discriminator(
        _choice_kind,
        custom_error_type="invalid_value",
        custom_error_message="'{param}' must be 'auto', 'none', 'required', a function or "
        "custom tool choice object or an allowed_tools object",
    ),
    BeforeValidator(_responses_choice_kinds),
]


class FormatText(Body):
    type: Literal["text"]


class FormatJSONObject(Body):
    type: Literal["json_object"]


class FormatJSONSchema(Body):
    """`text.format` of type `json_schema` (strict defaults to false, as in the OpenAI API)."""

    type: Literal["json_schema"]
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    schema_: JSONSchema = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[
    Annotated[FormatText, Tag("text")]
    | Annotated[FormatJSONObject, Tag("json_object")]
    | Annotated[FormatJSONSchema, Tag("json_schema")],
    Field(discriminator="type"),
]


def responses_format(
    value: FormatText | FormatJSONObject | FormatJSONSchema | None,
) -> FormatSpec | None:
    if value is None or isinstance(value, FormatText):
        return None
    if isinstance(value, FormatJSONObject):
        return FormatSpec("json_object", param="text.format")
    return FormatSpec(
        "json_schema",
        value.schema_,
        bool(value.strict),
        value.name,
        value.description,
        param="text.format",
    )


# ---------------------------------------------------------------------------------------------
# Chat Completions shapes


class ChatFunction(Body):
    name: FunctionName
    description: str | None = None
    parameters: JSONSchema | None = None
    strict: bool | None = Field(
        None, description="Arguments follow `parameters` exactly (default false, as in the API)."
    )

    def spec(self) -> FunctionSpec:
        return FunctionSpec(self.name, self.description, self.parameters, bool(self.strict))


class ChatTool(Body):
    type: Literal["function"]
    function: ChatFunction


ChatTools = Annotated[
    list[Annotated[ChatTool, BeforeValidator(_function_tools_only)]],
    Field(max_length=MAX_TOOLS),
]


class ChatFunctionName(Body):
    name: str


class ChatFunctionChoice(Body):
    type: Literal["function"]
    function: ChatFunctionName


ChatToolChoice = Annotated[
    Annotated[Literal["auto", "none", "required"], Tag("string")]
    | Annotated[
        Annotated[ChatFunctionChoice, BeforeValidator(_function_choice_only)], Tag("object")
    ],
    by_json_type("'auto', 'none', 'required' or a function choice object"),
]


class ChatJSONSchema(Body):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    schema_: JSONSchema | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ChatFormatJSONSchema(Body):
    type: Literal["json_schema"]
    json_schema: ChatJSONSchema


ChatResponseFormat = Annotated[
    Annotated[FormatText, Tag("text")]
    | Annotated[FormatJSONObject, Tag("json_object")]
    | Annotated[ChatFormatJSONSchema, Tag("json_schema")],
    Field(discriminator="type"),
]


def chat_format(
    value: FormatText | FormatJSONObject | ChatFormatJSONSchema | None,
) -> FormatSpec | None:
    if value is None or isinstance(value, FormatText):
        return None
    if isinstance(value, FormatJSONObject):
        return FormatSpec("json_object", param="response_format")
    schema = value.json_schema
    return FormatSpec(
        "json_schema",
        schema.schema_ if schema.schema_ is not None else {"type": "object"},
        bool(schema.strict),
        schema.name,
        schema.description,
        param="response_format.json_schema",
    )


# ---------------------------------------------------------------------------------------------
# log-probabilities on the wire


class TopLogprob(WireObject):
    token: str
    bytes: list[int]
    logprob: float


class Logprob(WireObject):
    """One generated token's log-probability and its most likely alternatives (the shape of
    the Responses `output_text.logprobs` and of Chat's `logprobs.content`)."""

    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob]


def logprob_entry(
    token: str, token_bytes: list[int], logprob: float, top: list[tuple[str, list[int], float]]
) -> dict[str, Any]:
    """A log-probability entry as stored and sent (finite floats only: JSON has no -inf)."""
    return {
        "token": token,
        "bytes": list(token_bytes),
        "logprob": _finite(logprob),
        "top_logprobs": [
            {"token": t, "bytes": list(b), "logprob": _finite(lp)} for t, b, lp in top
        ],
    }


# The smallest log-probability sent: a token the distribution gives no weight at all
# (-inf) is reported as this, as OpenAI reports -9999.0.
MIN_LOGPROB = -9999.0


def _finite(value: float) -> float:
    if value != value or value < MIN_LOGPROB:  # NaN or -inf
        return MIN_LOGPROB
    return float(value)
