"""JSON schemas for the structured-output corpus test (tests/test_constrained.py).

They cover objects, nested arrays, enums, `anyOf`/`oneOf`/`allOf`, `$ref` (with `$defs`,
`definitions` and recursion), string patterns and formats, numeric bounds, and
`additionalProperties: false`. Every string, array and object is bounded, so that even the
random-weight test model (which never "wants" to close a string) finishes each output within
a few hundred tokens; the grammar, not the model, is what is being tested.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def obj(properties: Schema, required: list[str] | None = None, **extra: Any) -> Schema:
    """A closed object: only `properties`, all required unless said otherwise."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


WORD = {"type": "string", "maxLength": 6}
SMALL = {"type": "integer", "minimum": 0, "maximum": 99}

CORPUS: dict[str, Schema] = {
    "person": obj({"name": WORD, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "enum": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "matrix": obj(
        {
            "rows": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                },
            }
        }
    ),
    "any_of": obj({"value": {"anyOf": [WORD, SMALL, {"type": "boolean"}]}}),
    "ref_defs": {
        "$defs": {
            "point": obj({"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": SMALL})
        },
        **obj({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}),
    },
    "definitions": {
        "definitions": {"tag": {"enum": ["x", "y", "z"]}},
        **obj({"tags": {"type": "array", "maxItems": 3, "items": {"$ref": "#/definitions/tag"}}}),
    },
    "pattern": obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
    "date": obj({"day": {"type": "string", "format": "date"}}),
    "date_time": obj({"at": {"type": "string", "format": "date-time"}}),
    "time": obj({"at": {"type": "string", "format": "time"}}),
    "uuid": obj({"id": {"type": "string", "format": "uuid"}}),
    "ipv4": obj({"host": {"type": "string", "format": "ipv4"}}),
    "exclusive_bounds": obj(
        {"n": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}}
    ),
    "multiple_of": obj({"n": {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5}}),
    "number_range": obj({"x": {"type": "number", "minimum": -1.5, "maximum": 2.5}}),
    "bool_null": obj({"ok": {"type": "boolean"}, "none": {"type": "null"}}),
    "const": obj({"kind": {"const": "fixed"}, "version": {"const": 2}}),
    "array_of_objects": obj(
        {"items": {"type": "array", "maxItems": 2, "items": obj({"id": SMALL, "label": WORD})}}
    ),
    "tuple": obj(
        {
            "pair": {
                "type": "array",
                "prefixItems": [WORD, SMALL],
                "items": False,
                "minItems": 2,
            }
        }
    ),
    "min_max_items": obj(
        {"picks": {"type": "array", "minItems": 2, "maxItems": 3, "items": {"enum": [1, 2, 3]}}}
    ),
    "optional": obj({"must": SMALL, "maybe": WORD}, required=["must"]),
    "nested": obj({"a": obj({"b": obj({"c": {"enum": ["deep"]}})})}),
    "one_of": obj(
        {"v": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}}
    ),
    "all_of": {
        "allOf": [
            obj({"a": SMALL, "b": {"type": "boolean"}}),
            {"properties": {"a": {"multipleOf": 2}}},
        ]
    },
    "mixed_enum": obj({"e": {"enum": [1, "one", None, True]}}),
    "recursive": {
        "$defs": {
            "node": obj(
                {
                    "v": {"type": "integer", "minimum": 0, "maximum": 9},
                    "kids": {"type": "array", "maxItems": 1, "items": {"$ref": "#/$defs/node"}},
                },
                required=["v"],
            )
        },
        "$ref": "#/$defs/node",
    },
    "length_bounds": obj({"s": {"type": "string", "minLength": 2, "maxLength": 4}}),
    "enum_array": obj(
        {"days": {"type": "array", "maxItems": 3, "items": {"enum": ["mon", "tue", "wed"]}}}
    ),
    "pattern_properties": {
        "type": "object",
        "patternProperties": {"^[a-c]$": SMALL},
        "additionalProperties": False,
        "maxProperties": 2,
    },
    "top_level_array": {"type": "array", "maxItems": 3, "items": SMALL},
    "top_level_enum": {"enum": ["yes", "no", "maybe"]},
    "nullable": obj({"note": {"type": ["string", "null"], "maxLength": 5}}),
    "email": obj({"mail": {"type": "string", "format": "email", "maxLength": 16}}),
    "bounded_negative": obj({"t": {"type": "integer", "minimum": -50, "maximum": -10}}),
}
