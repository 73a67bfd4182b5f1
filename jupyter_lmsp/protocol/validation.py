"""From bytes and query strings to validated models, and from validation errors to LMSP errors.

This is the one place where a malformed request becomes a 400: `parse_json` turns a body into a
JSON value (refusing what JSON parsers disagree on or choke on: nesting beyond `MAX_DEPTH`,
integers longer than Python converts, lone surrogates, NaN), `validate` runs a model over it,
and `lmsp_error` maps pydantic's errors to LMSP's `code` and `param`:

| pydantic error | LMSP `code` |
| --- | --- |
| a field of the body is missing | `missing_required_parameter` |
| an undeclared field | `unknown_parameter` |
| a scalar of the wrong JSON type (`"8"` for an integer) | `invalid_type` |
| a `Neutral` field with another value | `unsupported_parameter` |
| anything a model raises with `fields.refuse(code, …)` | that code |
| any other constraint, a wrong shape (not a list, a part missing) | `invalid_value` |

`param` is the path of the offending value in the body (`input[2].content[0]`); a model's
own validator names the whole parameter (`refuse(..., param="store")`) or, for a nested
model, one of its fields (`refuse(..., field="content")`, under the model's path). When a body
has several errors, the first `unsupported_*` one is reported (the service cannot do what was
asked, which matters more than a typo), else the first in the model's declaration order.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any, TypeVar, get_args

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core.core_schema import ErrorType

from .errors import LMSPError, invalid

M = TypeVar("M", bound=BaseModel)

# Deeper than any request needs (a Responses input is ~5 levels); a JSON Schema for tools or
# text formats is a few levels more. Python's own parser would raise RecursionError at ~1000.
MAX_DEPTH = 64
# Python refuses to convert longer integer strings (sys.int_info.default_max_str_digits).
MAX_INT_DIGITS = 4300

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class _BadJSON(ValueError):
    pass


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _BadJSON(f"an integer has more than {MAX_INT_DIGITS} digits")
    return int(text)


def _parse_float(text: str) -> float | int:
    value = float(text)
    if not math.isfinite(value):
        raise _BadJSON(f"the number {text[:40]} is out of range")
    # JSON has one number type: 8.0 is an integer to JSON Schema, and so to us.
    return int(value) if value.is_integer() else value


def _parse_constant(name: str) -> Any:
    raise _BadJSON(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> Any:
    """The JSON value of a request body, or a 400 `invalid_json` (or `invalid_value` for a
    string that is not Unicode, naming where)."""
    if not raw:
        raise invalid("The request body is empty; a JSON object is expected.", code="invalid_json")
    try:
        value = json.loads(
            raw, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant
        )
    except RecursionError:
        raise _too_deep() from None
    except (UnicodeDecodeError, ValueError) as e:
        raise invalid(f"The request body is not valid JSON: {e}", code="invalid_json") from None
    _check_value(value, (), 0)
    return value


def _too_deep() -> LMSPError:
    return invalid(
        f"The request body is nested more than {MAX_DEPTH} levels deep.", code="invalid_json"
    )


def _check_value(value: Any, path: tuple[str | int, ...], depth: int) -> None:
    """Refuse nesting beyond MAX_DEPTH and strings holding lone surrogates (valid JSON escapes,
    but not Unicode: nothing downstream could store or tokenize them)."""
    if isinstance(value, str):
        if _LONE_SURROGATE.search(value):
            raise _not_unicode(path)
    elif isinstance(value, dict):
        if depth >= MAX_DEPTH:
            raise _too_deep()
        for key, item in value.items():
            if _LONE_SURROGATE.search(key):
                raise _not_unicode(path)
            _check_value(item, (*path, key), depth + 1)
    elif isinstance(value, list):
        if depth >= MAX_DEPTH:
            raise _too_deep()
        for i, item in enumerate(value):
            _check_value(item, (*path, i), depth + 1)


def _not_unicode(path: tuple[str | int, ...]) -> LMSPError:
    param = render_path(path) or None
    return invalid(
        f"'{param or 'the body'}' holds a lone surrogate (an escape such as \\ud800 that is "
        "not a Unicode character).",
        param=param,
    )


def validate(model: type[M], value: Any) -> M:
    """`value` (a parsed JSON body) as `model`, or a 400 saying what is wrong and where."""
    if not isinstance(value, dict):
        raise invalid("The request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise lmsp_error(e, value) from None


def validate_query(model: type[M], arguments: Mapping[str, list[str]]) -> M:
    """Query arguments as `model`: a list field takes every value (and comma-separated ones),
    any other field the last; an empty value counts as absent."""
    data: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        values = [v for v in arguments.get(field.alias or name, []) if v != ""]
        if not values:
            continue
        if _is_list(field.annotation):
            data[name] = [part for v in values for part in v.split(",") if part]
        else:
            data[name] = values[-1]
    try:
        return model.model_validate(data)
    except ValidationError as e:
        # A query parameter is named by its name alone (`state`, not `state[1]`).
        raise lmsp_error(e, data, flat=True) from None


def validate_value(adapter: TypeAdapter[Any], value: Any, param: str) -> Any:
    """One value (a header) through `adapter`, reported under `param`."""
    try:
        return adapter.validate_python(value)
    except ValidationError as e:
        raise lmsp_error(e, {param: value}, prefix=(param,)) from None


def _is_list(annotation: Any) -> bool:
    origin = getattr(annotation, "__origin__", None)
    if origin is list:
        return True
    return any(_is_list(arg) for arg in getattr(annotation, "__args__", ()))


_PYDANTIC_ERRORS = frozenset(get_args(ErrorType))
# A scalar of the wrong kind; a wrong shape (a string for a list) is an invalid value.
_TYPE_ERRORS = frozenset(
    {
        "int_type",
        "int_parsing",
        "int_parsing_size",
        "int_from_float",
        "float_type",
        "float_parsing",
        "string_type",
        "bool_type",
        "bool_parsing",
    }
)


def lmsp_error(
    error: ValidationError, data: Any, prefix: tuple[str | int, ...] = (), flat: bool = False
) -> LMSPError:
    """The LMSP error for pydantic's `error` about `data` (see the table at the top)."""
    details = error.errors(include_url=False)
    chosen = next((d for d in details if d["type"].startswith("unsupported_")), details[0])
    path = _data_path(data, (*prefix, *chosen["loc"]), missing=chosen["type"] == "missing")
    if flat:
        path = path[:1]
    ctx = chosen.get("ctx") or {}
    if ctx.get("field") is not None:
        # A nested model's own validator names one of its fields, relative to where it is.
        path = (*path, ctx["field"])
    param = ctx.get("param") or render_path(path) or None
    kind = chosen["type"]
    name = param or "the body"
    if kind == "missing":
        # A field of the body itself; a part missing deeper is a malformed value.
        code = "missing_required_parameter" if len(path) <= 1 else "invalid_value"
        return invalid(f"'{name}' is required.", param=param, code=code)
    if kind == "extra_forbidden":
        return invalid(f"Unknown parameter: '{name}'.", param=param, code="unknown_parameter")
    message = str(chosen["msg"]).replace("{param}", name)
    if kind not in _PYDANTIC_ERRORS:
        # Raised through fields.refuse: its type is the LMSP code, its message is ready.
        return LMSPError(400, kind, _sentence(message), param=param)
    if kind in _TYPE_ERRORS:
        return invalid(
            f"Invalid type for '{name}': {_lower_first(message)}.", param=param, code="invalid_type"
        )
    return invalid(f"Invalid value for '{name}': {_lower_first(message)}.", param=param)


def _sentence(message: str) -> str:
    return message if message.endswith((".", "?", "!")) else message + "."


def _lower_first(message: str) -> str:
    message = message.rstrip(".")
    return message[:1].lower() + message[1:]


def _data_path(data: Any, loc: tuple[str | int, ...], *, missing: bool) -> tuple[str | int, ...]:
    """The part of pydantic's `loc` that leads through `data` itself: union members and
    validator names in it (`'array'`, `'function-after[…]'`) are not keys of the body."""
    path: list[str | int] = []
    current = data
    for i, step in enumerate(loc):
        found, current = _step(current, step)
        if found or (i == len(loc) - 1 and missing and isinstance(current, dict)):
            path.append(step)
    return tuple(path)


def _step(value: Any, step: str | int) -> tuple[bool, Any]:
    """(True, value[step]) when `step` is a key or index of `value`, else (False, value)."""
    if isinstance(value, dict) and isinstance(step, str) and step in value:
        return True, value[step]
    if isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value):
        return True, value[step]
    return False, value


def render_path(path: tuple[str | int, ...]) -> str:
    """`("input", 2, "content")` → `input[2].content`."""
    out = ""
    for step in path:
        if isinstance(step, int):
            out += f"[{step}]"
        else:
            out += f".{step}" if out else step
    return out
