"""JSON numbers under a grammar, bounded to what a float64 or an int64 holds (issue 43).

A JSON schema's `number` or `integer` allows any number of digits, and a small model at
temperature 0 can fall into writing them forever: the demo model wrote
`"population_millions": 3143322223333333333333…` until `max_output_tokens`, so the openai SDK's
`responses.parse` got no object. Whitespace is bounded already (`grammars.JSON_WHITESPACE`);
this bounds numbers the same way, before the schema is compiled: a number or integer without
its own bounds gets `minimum` / `maximum` of ±10^18 (at most 19 integer digits; llguidance's
ranges stop working at 2^63), and a number without a `multipleOf` gets 10^-10 (at most 10
digits after the point; llguidance builds exact decimal ranges up to that). Bounds or a
`multipleOf` the schema states itself are kept as they are. A bounded number is written
without an exponent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

INTEGER_BOUND = 10**18
NUMBER_BOUND = 1e18
NUMBER_STEP = 1e-10

# The keywords whose value is one sub-schema, a list of them, or a map of them (JSON Schema
# 2020-12 and its older names): the walks over a schema (here, `grammars.closed_objects`).
SUBSCHEMA_ONE = (
    "items",
    "additionalItems",
    "additionalProperties",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
)
SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def map_subschemas(
    schema: dict[str, Any], f: Callable[[Any], Any], one: tuple[str, ...] = SUBSCHEMA_ONE
) -> dict[str, Any]:
    """A copy of `schema` with `f` applied to each of its direct sub-schemas (those under the
    keywords of `one`, and every member of its lists and maps of sub-schemas)."""
    out = dict(schema)
    for key in one:
        if isinstance(out.get(key), dict):
            out[key] = f(out[key])
    for key in SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [f(child) for child in out[key]]
    for key in SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: f(child) for name, child in out[key].items()}
    return out


def bounded_numbers(schema: Any) -> Any:
    """`schema` with every `number` / `integer` sub-schema bounded (see the module
    docstring); other parts, and the input, unchanged."""
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, bounded_numbers)
    kind = out.get("type")
    if kind not in ("number", "integer") or "enum" in out or "const" in out:
        return out
    integer = kind == "integer"
    bound: float = INTEGER_BOUND if integer else NUMBER_BOUND
    if "minimum" not in out and "exclusiveMinimum" not in out:
        out["minimum"] = -bound
    if "maximum" not in out and "exclusiveMaximum" not in out:
        out["maximum"] = bound
    if not integer and "multipleOf" not in out:
        out["multipleOf"] = NUMBER_STEP
    return out
