"""What a JSON schema (or a custom tool's grammar) may cost to compile, checked by counting.

llguidance's compile time grows much faster than a schema's size in a few places: an
object's `patternProperties` (N=200 patterns took 0.4-0.9 s, N=550 tens of seconds), many
properties in one object (its "any other key" lexeme excludes each name: 3,000 took 2-3.5 s
with the demo model's tokenizer), very wide `anyOf` (a row of the grammar holds at most
2,000 items, llguidance's `max_items_in_row`, or the job fails at run time). So before any
compiler runs, a schema is walked once, in time linear in its size, and refused when it
passes one of the limits below (`SchemaLimitExceeded`, a 400 that names the limit and where).
What passes is then compiled with the model's tokenizer under a deadline
(`engine.grammar_check`), which bounds what counting cannot foresee.

The limits are generous for real schemas (OpenAI's structured outputs allow 5,000
properties in all and 10 levels of nesting; its function tools are far smaller), and each
is named in the error so a client knows what to change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .grammars import GrammarIssue, ResponseFormat, ToolSpec
from .schema_walk import subschemas

# name: (limit, what it counts). Names appear in error messages and docs/protocol.md.
LIMITS: dict[str, tuple[int, str]] = {
    "schema_bytes": (131_072, "bytes of the schema as JSON"),
    "subschemas": (10_000, "sub-schemas in all"),
    "depth": (32, "levels of nesting"),
    "properties": (5_000, "properties in all"),
    "object_properties": (1_000, "properties of one object"),
    "patterns": (64, "regular expressions (pattern, patternProperties, propertyNames)"),
    "pattern_bytes": (16_384, "bytes of regular expressions in all"),
    "branches": (500, "branches of one anyOf / oneOf / allOf"),
    "enum_values": (1_000, "values of one enum"),
    "refs": (1_000, "$ref keywords"),
    "grammar_bytes": (65_536, "bytes of a custom tool's grammar"),
}


@dataclass(frozen=True)
class SchemaLimitExceeded(Exception):
    """`limit` (a key of `LIMITS`) was passed at `path` (in the schema): `found` > allowed."""

    limit: str
    found: int
    path: tuple[str | int, ...] = ()

    @property
    def allowed(self) -> int:
        return LIMITS[self.limit][0]

    @property
    def reason(self) -> str:
        subject = "the grammar" if self.limit == "grammar_bytes" else "the schema"
        return (
            f"{subject} exceeds the limit '{self.limit}': at most {self.allowed} "
            f"{LIMITS[self.limit][1]}, found {self.found}"
        )

    def __str__(self) -> str:
        return self.reason


def check_limits(fmt: ResponseFormat | None, tools: ToolSpec | None) -> GrammarIssue | None:
    """The first limit a request's format or tools pass, as a `GrammarIssue` whose path has
    the form `grammars.check_response_format` / `check_tools` give; None if within them all."""
    try:
        if fmt is not None and fmt.schema is not None:
            prefix: tuple[str | int, ...] = ("schema",)
            check_schema_size(fmt.schema)
        for i, tool in enumerate(tools.tools if tools is not None else ()):
            prefix = ("tools", i, "parameters")
            if tool.parameters is not None:
                check_schema_size(tool.parameters)
        for i, custom in enumerate(tools.customs if tools is not None else ()):
            prefix = ("tools", (len(tools.tools) if tools else 0) + i)
            check_grammar_size(custom.definition)
    except SchemaLimitExceeded as exc:
        return GrammarIssue(exc.reason, (*prefix, *exc.path))
    return None


def check_schema_size(schema: Any) -> None:
    """Raise `SchemaLimitExceeded` if `schema` passes one of `LIMITS` (linear in its size)."""
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:
        raise SchemaLimitExceeded("depth", LIMITS["depth"][0] + 1) from None
    size = len(text.encode())
    if size > LIMITS["schema_bytes"][0]:
        raise SchemaLimitExceeded("schema_bytes", size)
    _Walk().visit(schema, (), 0)


def check_grammar_size(definition: str | None) -> None:
    """Raise `SchemaLimitExceeded` if a custom tool's grammar text is too long."""
    size = len((definition or "").encode())
    if size > LIMITS["grammar_bytes"][0]:
        raise SchemaLimitExceeded("grammar_bytes", size, ("format", "definition"))


class _Walk:
    def __init__(self) -> None:
        self.counts = dict.fromkeys(LIMITS, 0)

    def bump(self, limit: str, by: int, path: tuple[str | int, ...]) -> None:
        self.counts[limit] += by
        if self.counts[limit] > LIMITS[limit][0]:
            raise SchemaLimitExceeded(limit, self.counts[limit], path)

    def pattern(self, regex: Any, path: tuple[str | int, ...]) -> None:
        self.bump("patterns", 1, path)
        self.bump("pattern_bytes", len(str(regex).encode()), path)

    def visit(self, node: Any, path: tuple[str | int, ...], depth: int) -> None:
        # An explicit stack would do too; the depth limit keeps this recursion shallow.
        if not isinstance(node, dict):
            return
        if depth > LIMITS["depth"][0]:
            raise SchemaLimitExceeded("depth", depth, path)
        self.bump("subschemas", 1, path)
        if "$ref" in node:
            self.bump("refs", 1, (*path, "$ref"))
        if "pattern" in node:
            self.pattern(node["pattern"], (*path, "pattern"))
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) > LIMITS["enum_values"][0]:
            raise SchemaLimitExceeded("enum_values", len(enum), (*path, "enum"))
        props = node.get("properties")
        if isinstance(props, dict):
            if len(props) > LIMITS["object_properties"][0]:
                raise SchemaLimitExceeded("object_properties", len(props), (*path, "properties"))
            self.bump("properties", len(props), (*path, "properties"))
        patterned = node.get("patternProperties")
        if isinstance(patterned, dict):
            for key in patterned:
                self.pattern(key, (*path, "patternProperties", key))
        for key in ("anyOf", "oneOf", "allOf"):
            value = node.get(key)
            if isinstance(value, list) and len(value) > LIMITS["branches"][0]:
                raise SchemaLimitExceeded("branches", len(value), (*path, key))
        for step, child in subschemas(node):
            self.visit(child, (*path, *step), depth + 1)
