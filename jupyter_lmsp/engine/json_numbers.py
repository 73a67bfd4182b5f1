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

from typing import Any

from .schema_walk import map_subschemas

INTEGER_BOUND = 10**18
NUMBER_BOUND = 1e18
NUMBER_STEP = 1e-10


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
