"""One event -> task state map (protocol.states.EVENT_STATES), read by every consumer.

The JupyterLab sidebar's `taskstate.ts` takes the map from the generated TypeScript (the OpenAPI
document's `*EventType` enums as values); this test compiles that module with the extension's
own TypeScript compiler, runs it with node on every event type there is, and fails if its
answers differ from the Python map, or from what the Python client and the notebook widgets
say. It also checks the OpenAPI document carries the map as it is.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from prerequisites import require

from jupyter_lmsp.client.objects import (
    TERMINAL_RESPONSE_STATUSES,
    TERMINAL_TASK_STATES,
    Event,
)
from jupyter_lmsp.protocol.events import event_types
from jupyter_lmsp.protocol.openapi import event_state_schemas
from jupyter_lmsp.protocol.responses import RESPONSE_STATUSES
from jupyter_lmsp.protocol.states import (
    EVENT_STATES,
    TERMINAL_EVENT_TYPES,
    TERMINAL_STATES,
    TaskState,
)
from jupyter_lmsp.widgets.state import EVENT_STATES as WIDGET_EVENT_STATES
from jupyter_lmsp.widgets.state import WatcherState

LABEXT = Path(__file__).resolve().parent.parent / "labextension"
TSC = LABEXT / "node_modules" / ".bin" / "tsc"

# Every event type of the union, the map's keys, and names that are no event.
TYPES = sorted(set(event_types()) | set(EVENT_STATES) | {"task.in_progress", "lmsp.closed", ""})


def python_answers() -> dict[str, dict]:
    return {t: {"state": EVENT_STATES.get(t), "terminal": t in TERMINAL_EVENT_TYPES} for t in TYPES}


def test_the_sidebar_map_is_the_python_map(tmp_path):
    node = shutil.which("node")
    require(node is not None and TSC.exists(), "node and the labextension's node_modules")
    # taskstate.ts and what it imports (the generated types), as CommonJS node can require.
    subprocess.run(
        [
            str(TSC),
            "--outDir",
            str(tmp_path),
            "--module",
            "commonjs",
            "--target",
            "ES2022",
            "--strict",
            "--skipLibCheck",
            "--rootDir",
            str(LABEXT / "src"),
            str(LABEXT / "src" / "taskstate.ts"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    script = (
        "const t = require(process.argv[1]);"
        "const types = JSON.parse(process.argv[2]);"
        "const out = {};"
        "for (const type of types) {"
        "  out[type] = {state: t.stateAfterEvent(type), terminal: t.isTerminalEvent(type)};"
        "}"
        "console.log(JSON.stringify({events: out, terminal: [...t.TERMINAL_STATES].sort()}));"
    )
    ran = subprocess.run(
        [str(node), "-e", script, str(tmp_path / "taskstate.js"), json.dumps(TYPES)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    sidebar = json.loads(ran.stdout)
    assert sidebar["events"] == python_answers()
    assert sidebar["terminal"] == sorted(TERMINAL_STATES)


def test_the_document_carries_the_map():
    schemas = event_state_schemas()
    from_document = {
        t: TaskState(name.removesuffix("EventType").lower())
        for name, schema in schemas.items()
        if name != "TerminalEventType"
        for t in schema["enum"]
    }
    assert from_document == EVENT_STATES
    assert set(schemas["TerminalEventType"]["enum"]) == TERMINAL_EVENT_TYPES


def test_the_client_and_the_widgets_read_the_same_map():
    assert WIDGET_EVENT_STATES == EVENT_STATES
    assert TERMINAL_TASK_STATES == TERMINAL_STATES
    # A response is finished in every status but these two.
    assert set(RESPONSE_STATUSES) - {"queued", "in_progress"} == TERMINAL_RESPONSE_STATUSES
    for number, t in enumerate(TYPES):
        assert Event.from_wire({"type": t, "sequence_number": 0}).terminal == (
            t in TERMINAL_EVENT_TYPES
        ), t
        # A watcher moves to the map's state on each lifecycle event (from a fresh state,
        # so a terminal one does not freeze it).
        watcher = WatcherState(task_id="task_x", state="running")
        watcher.apply(Event.from_wire({"type": t, "sequence_number": 0}), now=float(number))
        assert watcher.state == EVENT_STATES.get(t, "running"), t
