"""The TaskWatcher in a real browser: JupyterLab in headless Chromium (Debian's, driven by
Playwright; nothing is downloaded) opens a notebook whose cell starts a background response and
shows it. The kernel finds its server by itself (runtime file), as a user's kernel would.

1. The text grows in the page while the task runs, the state reaches `completed`, and the text
   shown is exactly the stored response's text (nothing doubled, nothing missing).
2. A second notebook with a long generation: pressing the widget's Cancel button ends it
   `cancelled`.
3. A TaskBoard lists the tasks (a completed and a cancelled one of its own, whichever tests ran
   before it), filters them by state, and opens a row as a TaskWatcher.
4. (Last: it kills the server.) A running task's watcher and sidebar row, the server killed
   with SIGKILL and started again on the same port: the watcher, whose kernel can no longer
   reach it, says "reconnecting" / "server unavailable" and then, following from the browser,
   shows the resumed task to its end with exactly the stored text; the sidebar row ends too.

Screenshots go to `test-artifacts/browser/`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from labbrowser import (  # the two fixtures override pytest-jupyter's
    chromium_page,
    jp_asyncio_loop,  # noqa: F401
    jp_server_cleanup,  # noqa: F401
    require_browser,
)
from labserver import LabServer
from serverproc import TOKEN

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "browser"
# Only the widgets of the notebook in the visible tab.
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"
WATCHER = f"{PANEL} .lmsp-watcher"
BOARD = f"{PANEL} .lmsp-board"
# The board's rows per page (small, so that the test's tasks fill more than one).
BOARD_PAGE = 1

# The cell a user would write: connect (the kernel's own server), start, show.
CELL = """\
from jupyter_lmsp.client import connect

lmsp = connect()
job = lmsp.start_response(
    "Tell me a story about a lighthouse.", max_output_tokens={tokens}, temperature=0, seed=3
)
job"""


def notebook(source: str) -> dict[str, Any]:
    return {
        "cells": [
            {
                "cell_type": "code",
                "execution_count": None,
                "id": "start",
                "metadata": {},
                "outputs": [],
                "source": source,
            }
        ],
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, test_model_dir: Path) -> Iterator[LabServer]:
    require_browser()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    server = LabServer(
        tmp_path_factory.mktemp("lab"), models={"tiny": test_model_dir}, engine_token_delay=0.04
    )
    (server.notebooks / "watch.ipynb").write_text(json.dumps(notebook(CELL.format(tokens=80))))
    (server.notebooks / "cancel.ipynb").write_text(json.dumps(notebook(CELL.format(tokens=2000))))
    board = "from jupyter_lmsp.widgets import TaskBoard\n\nTaskBoard(page_size=PAGE)"
    board = board.replace("PAGE", str(BOARD_PAGE))
    (server.notebooks / "board.ipynb").write_text(json.dumps(notebook(board)))
    (server.notebooks / "restart.ipynb").write_text(
        json.dumps(
            notebook(CELL.format(tokens=400).replace("seed=3", "seed=3, on_restart='resume'"))
        )
    )
    with server:
        yield server


@pytest.fixture(scope="module")
def page(lab: LabServer) -> Iterator[Any]:
    with chromium_page(1280, 900) as page:
        yield page


def open_and_run(page: Any, lab: LabServer, name: str, selector: str = WATCHER) -> None:
    """Open `name` (loading JupyterLab first, unless an earlier test has), wait for its kernel
    to be connected and idle, run all its cells."""
    if not page.evaluate("() => window.jupyterapp !== undefined"):
        page.goto(f"{lab.url}lab/tree/{name}?token={TOKEN}")
        page.wait_for_function("() => window.jupyterapp !== undefined", timeout=120_000)
    else:
        # Awaited, but returning nothing: the panel it resolves to cannot be serialised.
        page.evaluate(
            "async name => {"
            " await window.jupyterapp.commands.execute('docmanager:open', {path: name}); }",
            name,
        )
    page.wait_for_function(
        """name => {
            const w = window.jupyterapp.shell.currentWidget;
            if (!w || !w.sessionContext || !w.context || w.context.path !== name) return false;
            const ctx = w.sessionContext;
            const kernel = ctx.session && ctx.session.kernel;
            return ctx.isReady && kernel && kernel.connectionStatus === 'connected'
                && kernel.status === 'idle';
        }""",
        arg=name,
        timeout=120_000,
    )
    # Not awaited: the promise resolves only when the cells are done.
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    page.wait_for_selector(selector, timeout=120_000)


def watcher_view(page: Any) -> dict[str, str]:
    return page.evaluate(
        """sel => {
            const w = document.querySelector(sel);
            const get = c => (w.querySelector(c) || {}).textContent || '';
            return {state: w.dataset.state || '', outcome: get('.lmsp-state'),
                    text: get('.lmsp-text'), task: get('.lmsp-id'), seq: get('.lmsp-seq'),
                    tokens: get('.lmsp-tokens'), rate: get('.lmsp-rate'),
                    connection: w.dataset.connection || '', shown: get('.lmsp-conn')};
        }""",
        WATCHER,
    )


def test_watcher_shows_text_growing_until_completed(page, lab):
    open_and_run(page, lab, "watch.ipynb")
    lengths: list[int] = []
    deadline = time.monotonic() + 120
    view = watcher_view(page)
    while view["state"] != "completed":
        assert view["state"] in ("", "queued", "loading", "running"), view
        assert time.monotonic() < deadline, f"never completed: {view}"
        lengths.append(len(view["text"]))
        time.sleep(0.1)
        view = watcher_view(page)
    page.wait_for_timeout(300)  # let the final trait update paint
    view = watcher_view(page)
    page.screenshot(path=str(ARTIFACTS / "watcher-completed.png"), full_page=True)

    growth = sorted({n for n in lengths if n > 0})
    assert len(growth) >= 3, f"the text did not visibly grow: {lengths}"
    assert lengths == sorted(lengths), "the text shrank while running"
    with lab.client() as c:
        task = c.get(f"/tasks/{view['task']}").json()
        response = c.get(f"/responses/{task['response_id']}").json()
    assert task["state"] == "completed"
    stored = "".join(part["text"] for item in response["output"] for part in item["content"])
    assert view["text"] == stored
    assert view["seq"] == f"seq {task['last_sequence_number']}"
    assert view["tokens"] == f"{response['usage']['output_tokens']} tokens"
    assert view["rate"].endswith("tok/s") and not view["rate"].startswith("–")


def test_cancel_button_cancels_the_task(page, lab):
    open_and_run(page, lab, "cancel.ipynb")
    page.wait_for_function(
        "sel => (document.querySelector(sel + ' .lmsp-text') || {}).textContent",
        arg=WATCHER,
        timeout=120_000,
    )
    page.click(f"{WATCHER} .lmsp-cancel")
    page.wait_for_function(
        "sel => document.querySelector(sel + ' .lmsp-state').textContent === 'cancelled'",
        arg=WATCHER,
        timeout=60_000,
    )
    page.wait_for_timeout(300)
    page.screenshot(path=str(ARTIFACTS / "watcher-cancelled.png"), full_page=True)
    view = watcher_view(page)
    with lab.client() as c:
        task = c.get(f"/tasks/{view['task']}").json()
        events = c.get(f"/tasks/{view['task']}/events", params={"limit": 1000}).json()["data"]
    assert task["state"] == "cancelled"
    assert events[-1]["type"] == "response.cancelled"
    assert "response.cancelling" in [e["type"] for e in events]
    # The Cancel button is gone once the task is over; the text so far stays.
    assert page.locator(f"{WATCHER} .lmsp-cancel").is_hidden()
    assert view["text"]


def make_board_tasks(lab: LabServer) -> tuple[str, str]:
    """A completed and a cancelled task of the board test's own (the board must show them
    whichever of the other tests ran before it): their ids."""
    with lab.client() as c:
        done = c.post("/responses", json={"input": "a", "max_output_tokens": 3}).json()
        assert c.get(f"/tasks/{done['task_id']}").json()["state"] == "completed", done
        long = c.post(
            "/responses", json={"input": "b", "background": True, "max_output_tokens": 2000}
        ).json()
        deadline = time.monotonic() + 120
        while c.get(f"/tasks/{long['task_id']}").json()["state"] != "running":
            assert time.monotonic() < deadline, "the long task never ran"
            time.sleep(0.05)
        assert c.post(f"/tasks/{long['task_id']}/cancel").is_success
        while c.get(f"/tasks/{long['task_id']}").json()["state"] != "cancelled":
            assert time.monotonic() < deadline, "the long task was never cancelled"
            time.sleep(0.05)
        return done["task_id"], long["task_id"]


def test_board_lists_filters_and_opens_tasks(page, lab):
    completed, cancelled_here = make_board_tasks(lab)
    with lab.client() as c:
        listed = c.get("/tasks", params={"limit": 100}).json()["data"]
    assert {completed, cancelled_here} <= {t["id"] for t in listed}
    open_and_run(page, lab, "board.ipynb", selector=BOARD)
    rows = f"{BOARD} tr.lmsp-row"
    ids = [t["id"] for t in listed]
    assert len(ids) > BOARD_PAGE
    page.wait_for_function(
        "a => { const rs = [...document.querySelectorAll(a.sel)];"
        " return rs.length === a.ids.length && rs.every((r, i) => r.dataset.taskId === a.ids[i]); }",
        arg={"sel": rows, "ids": ids[:BOARD_PAGE]},
        timeout=30_000,
    )
    # Newest first, like the service, a page at a time: the next page holds the next ones.
    assert page.text_content(f"{BOARD} .lmsp-board-page") == f"1–{BOARD_PAGE} of {len(ids)}"
    page.click(f"{BOARD} .lmsp-board-next")
    shown = page.eval_on_selector_all(rows, "rs => rs.map(r => r.dataset.taskId)")
    assert shown == ids[BOARD_PAGE : 2 * BOARD_PAGE]

    cancelled = [t["id"] for t in listed if t["state"] == "cancelled"]
    assert cancelled[0] == cancelled_here  # the newest cancelled task
    page.select_option(f"{BOARD} select.lmsp-board-filter", "cancelled")
    page.wait_for_function(
        "a => { const rs = [...document.querySelectorAll(a.sel)];"
        " return rs.length === a.n"
        " && rs.every(r => r.querySelector('.lmsp-state').textContent === 'cancelled'); }",
        arg={"sel": rows, "n": min(BOARD_PAGE, len(cancelled))},
        timeout=30_000,
    )
    page.click(f"{rows} .lmsp-open")  # the first row: the newest cancelled task
    page.wait_for_function(
        "sel => (document.querySelector(sel + ' .lmsp-state') || {}).textContent === 'cancelled'",
        arg=WATCHER,
        timeout=30_000,
    )
    assert watcher_view(page)["task"] == cancelled_here
    page.wait_for_timeout(300)
    page.screenshot(path=str(ARTIFACTS / "board.png"), full_page=True)


def test_watcher_and_sidebar_follow_a_task_across_sigkill_and_restart(page, lab):
    import psutil

    open_and_run(page, lab, "restart.ipynb")
    page.wait_for_function(
        "sel => { const w = document.querySelector(sel);"
        " return w && w.dataset.state === 'running'"
        " && (w.querySelector('.lmsp-text') || {}).textContent; }",
        arg=WATCHER,
        timeout=120_000,
    )
    task_id = watcher_view(page)["task"]
    page.evaluate("() => window.jupyterapp.commands.execute('lmsp:open-sidebar')")
    row = f'.jp-LMSP-task[data-task-id="{task_id}"]'
    page.wait_for_selector(row, timeout=30_000)
    # The row tells the task apart: its short id and its caller beside the model.
    assert page.text_content(f"{row} .jp-LMSP-shortId") == task_id[-6:]
    assert page.text_content(f"{row} .jp-LMSP-owner").strip(" ·")
    assert lab.proc is not None
    kernels = psutil.Process(lab.proc.pid).children(recursive=True)
    try:
        lab.kill()  # SIGKILL: nothing runs on the way down; the kernel is orphaned
        page.wait_for_function(
            "sel => ['reconnecting', 'server unavailable']"
            ".includes(document.querySelector(sel).dataset.connection)",
            arg=WATCHER,
            timeout=60_000,
        )
        # The sidebar's row says so too.
        page.wait_for_selector(f'{row}[data-mode="reconnecting"] .jp-LMSP-reconnecting')
        gone = watcher_view(page)
        assert gone["state"] == "running" and gone["shown"] in (
            "reconnecting",
            "server unavailable",
        )
        page.screenshot(path=str(ARTIFACTS / "restart-1-server-gone.png"), full_page=True)

        lab.start()  # the same port, token and data folder: the task resumes
        page.wait_for_function(
            "sel => ['completed', 'failed', 'cancelled']"
            ".includes(document.querySelector(sel).dataset.state)",
            arg=WATCHER,
            timeout=180_000,
        )
        page.wait_for_function(
            "r => ['completed', 'failed', 'cancelled'].includes("
            "(document.querySelector(r) || {dataset: {}}).dataset.state)",
            arg=row,
            timeout=60_000,
        )
        page.wait_for_timeout(300)
        assert page.locator(f"{row} .jp-LMSP-reconnecting").count() == 0
        # The Tasks badge says what it counts: nothing left unfinished, the rest finished.
        page.wait_for_function(
            "() => /^0 unfinished · [1-9][0-9]* finished$/.test("
            "document.querySelector('.jp-LMSP-tasks .jp-LMSP-count').textContent)",
            timeout=30_000,
        )
        page.screenshot(path=str(ARTIFACTS / "restart-2-resumed-to-the-end.png"), full_page=True)
        view = watcher_view(page)
        with lab.client() as c:
            task = c.get(f"/tasks/{task_id}").json()
            response = c.get(f"/responses/{task['response_id']}").json()
        assert task["state"] == view["state"] == "completed", (task, view)
        assert task["attempts"] == 1  # the run interrupted by the kill, taken up again
        stored = "".join(part["text"] for item in response["output"] for part in item["content"])
        assert view["text"] == stored
        assert view["seq"] == f"seq {task['last_sequence_number']}"
        # The badge says the response's true outcome (incomplete when it hit its limit).
        if response["status"] == "incomplete":
            reason = response["incomplete_details"]["reason"]
            assert view["outcome"] == f"incomplete: {reason}"
        else:
            assert view["outcome"] == "completed"
    finally:
        for process in kernels:  # the killed server's kernel, which nothing else stops
            with contextlib.suppress(psutil.Error):
                process.kill()
