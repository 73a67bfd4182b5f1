"""Where a JSON schema holds sub-schemas, named once for every walk over a schema.

JSON Schema (2020-12 and its older names) keeps sub-schemas under three kinds of keyword: one
sub-schema (`not`, `items`, ...), a list of them (`anyOf`, `prefixItems`, ...) or a map of names
to them (`properties`, `$defs`, ...); `items` is one or a list depending on the draft. The walks
that read (`schema_limits`: the admission limits; `grammars`: locating a compile error) use
`subschemas`; those that rewrite (`json_numbers.bounded_numbers`, `grammars.closed_objects`) use
`map_subschemas`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

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
# Definitions first: a walk that stops at the first failing sub-schema then names the
# definition rather than each place that refers to it.
SUBSCHEMA_MAPS = ("$defs", "definitions", "properties", "patternProperties", "dependentSchemas")


def subschemas(node: dict[str, Any]) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    """Each direct sub-schema of `node` with the steps from `node` to it (`("properties",
    "name")`, `("anyOf", 2)`, `("not",)`): maps, then lists, then single sub-schemas. A child
    may be any JSON value (a boolean schema, or a malformed one): callers decide."""
    for key in SUBSCHEMA_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            for name, child in value.items():
                yield (key, name), child
    for key in SUBSCHEMA_LISTS:
        value = node.get(key)
        if isinstance(value, list):
            for i, child in enumerate(value):
                yield (key, i), child
    for key in SUBSCHEMA_ONE:
        value = node.get(key)
        if isinstance(value, dict):
            yield (key,), value


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
