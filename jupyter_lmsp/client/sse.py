"""A small Server-Sent Events parser (the subset LMSP uses: `id`, `event`, `data`, comments).

It works on decoded lines, so it can be fed from `httpx.Response.iter_lines()` or from a list
in a test.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class SSEMessage:
    id: str | None
    event: str | None
    data: str

    def json(self) -> Any:
        return json.loads(self.data)


def parse_sse(lines: Iterable[str]) -> Iterator[SSEMessage]:
    """Messages from SSE lines: fields accumulate until a blank line dispatches them.

    Comment lines (`: keep-alive`) are skipped; a message without `data` is dropped, as the
    SSE specification says.
    """
    event_id: str | None = None
    event: str | None = None
    data: list[str] = []
    for raw in lines:
        line = raw.rstrip("\r\n")
        if line == "":
            if data:
                yield SSEMessage(event_id, event, "\n".join(data))
            event, data = None, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
        elif name == "id":
            event_id = value
    if data:
        yield SSEMessage(event_id, event, "\n".join(data))
