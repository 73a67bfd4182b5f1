"""The JupyterLab sidebar (labextension/) in a real browser: `jupyter lab` with the installed
extension, driven by Playwright on Debian's headless Chromium (nothing is downloaded).

1. The panel shows the service and the models; a background task appears, is followed through
   its event stream (also across a hide/show of the panel, which reconnects with
   `Last-Event-ID`), and its state changes live to `completed`; its event log opens.
2. A task is cancelled from the panel.
3. A model is registered from a path typed into the panel; a bad path shows the server's error.
4. A pairing request started by a separate process (tests/pairing_client.py) raises a
   notification while the panel is closed, is approved from the panel with narrowed scopes,
   and that process receives its token and calls the service; the client is then revoked.
5. Task rows say what each task is: the start of its prompt, and its outcome in the notebook
   widgets' words and colours (completed green, incomplete with its reason amber, cancelled
   grey); finished tasks past the newest page come page by page ("Older tasks").
6. A webhook endpoint added in the panel against a real receiver on loopback: its secret is
   shown once, a delivery is counted; a dead letter is redelivered; errors are shown as text.

Screenshots go to `test-artifacts/labextension/`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from labbrowser import (  # the two fixtures override pytest-jupyter's
    SIDEBAR,
    jp_asyncio_loop,  # noqa: F401
    jp_server_cleanup,  # noqa: F401
    lab_page,
    require_browser,
)
from labserver import LabServer
from serverproc import TOKEN
from webhookreceiver import Receiver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "labextension"
# Records every state a task row shows, in order, so a test can tell a live change from a jump.
STATE_RECORDER = """() => {
  window.__lmspStates = {};
  const record = row => {
    const id = row.dataset.taskId, state = row.dataset.state;
    const seen = (window.__lmspStates[id] = window.__lmspStates[id] || []);
    if (seen[seen.length - 1] !== state) seen.push(state);
  };
  new MutationObserver(changes => {
    for (const c of changes) {
      const nodes = c.type === 'attributes' ? [c.target] : [...c.addedNodes];
      for (const n of nodes) {
        if (n.nodeType !== 1) continue;
        if (n.matches('.jp-LMSP-task')) record(n);
        n.querySelectorAll('.jp-LMSP-task').forEach(record);
      }
    }
  }).observe(document.body, {
    subtree: true, childList: true, attributes: true, attributeFilter: ['data-state']
  });
  document.querySelectorAll('.jp-LMSP-task').forEach(record);
}"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, test_model_dir: Path) -> Iterator[LabServer]:
    require_browser()
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    root = tmp_path_factory.mktemp("sidebar")
    with LabServer(
        root,
        models={"tiny": test_model_dir},
        engine_token_delay=0.03,
        # Webhook deliveries retried at once and dead after two attempts (test 6).
        webhook_max_attempts=2,
        webhook_backoff=0.05,
        webhook_backoff_max=0.1,
        webhook_poll_interval=0.1,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def page(lab: LabServer) -> Iterator[Any]:
    with lab_page(lab.url, TOKEN, 1400, 900, STATE_RECORDER) as page:
        yield page


def shot(page: Any, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def panel_visible(page: Any) -> bool:
    return page.locator(SIDEBAR).is_visible()


def show_panel(page: Any) -> None:
    """Click the sidebar's tab in JupyterLab's left bar (a second click would close it)."""
    if not panel_visible(page):
        page.locator(f'.jp-SideBar.jp-mod-left li[data-id="{SIDEBAR[1:]}"]').click()
    page.locator(SIDEBAR).wait_for(state="visible")


def hide_panel(page: Any) -> None:
    """Close the sidebar by switching the left area to the file browser."""
    page.locator('.jp-SideBar.jp-mod-left li[data-id="filebrowser"]').click()
    page.locator(SIDEBAR).wait_for(state="hidden")


def task_row(page: Any, task_id: str) -> Any:
    return page.locator(f'{SIDEBAR} .jp-LMSP-task[data-task-id="{task_id}"]')


def start_background(lab: LabServer, text: str, tokens: int) -> dict[str, Any]:
    with lab.client() as c:
        r = c.post(
            "/responses",
            json={"input": text, "background": True, "max_output_tokens": tokens, "temperature": 0},
        )
        assert r.status_code == 202, r.text
        return r.json()


def utf16_len(text: str) -> int:
    """A string's length as JavaScript counts it."""
    return len(text.encode("utf-16-le")) // 2


def test_service_models_and_a_task_followed_live_to_completed(lab: LabServer, page: Any):
    from playwright.sync_api import expect

    show_panel(page)
    panel = page.locator(SIDEBAR)
    expect(panel.locator("[data-field=protocol]")).to_have_text("lmsp/1.0")
    expect(panel.locator("[data-field=default_model]")).to_have_text("tiny")
    expect(panel.locator("[data-field=worker] .jp-LMSP-state")).to_have_attribute(
        "data-state", "ready", timeout=30_000
    )
    with lab.client() as c:
        service = c.get("/service").json()
        tiny = c.get("/models/tiny").json()
    expect(panel.locator("[data-field=id]")).to_have_text(service["id"])
    model = panel.locator('.jp-LMSP-modelRow[data-model-id="tiny"]')
    expect(model.locator(".jp-LMSP-digest")).to_have_text(tiny["digest"][: len("sha256:") + 12])
    expect(model.locator(".jp-LMSP-state")).to_have_text(tiny["state"])

    response = start_background(lab, "Watch me run.", 200)
    task_id = response["task_id"]
    row = task_row(page, task_id)
    # Followed through its event stream while it runs.
    expect(row).to_have_attribute("data-mode", "stream", timeout=20_000)
    expect(row).to_have_attribute("data-state", "running", timeout=20_000)
    page.wait_for_function(
        f"""() => Number(document.querySelector('[data-task-id="{task_id}"]')
              ?.dataset.chars) > 0"""
    )
    shot(page, "1-task-running")
    # Close and reopen the panel mid-run: the stream is dropped and resumed from the last
    # event seen (Last-Event-ID); nothing may be lost or counted twice.
    hide_panel(page)
    time.sleep(1.0)
    show_panel(page)
    expect(row).to_have_attribute("data-state", "completed", timeout=60_000)
    expect(row.locator(".jp-LMSP-progress")).to_have_text("200 tokens")
    shot(page, "2-task-completed")
    states = page.evaluate("() => window.__lmspStates")[task_id]
    assert "running" in states and states[-1] == "completed", states
    assert states.index("running") < states.index("completed"), states

    with lab.client() as c:
        done = c.get(f"/responses/{response['id']}").json()
        task = c.get(f"/tasks/{task_id}").json()
    text = "".join(part["text"] for item in done["output"] for part in item["content"])
    assert int(row.get_attribute("data-chars")) == utf16_len(text)

    # The task's event log opens in the main area with every event, in order.
    row.locator("[data-action=open-log]").click()
    log = page.locator(f'.jp-LMSP-log[data-task-id="{task_id}"]')
    expect(log).to_have_attribute("data-state", "completed", timeout=20_000)
    rows = log.locator("tbody tr")
    expect(rows).to_have_count(task["last_sequence_number"] + 1)
    types = rows.evaluate_all("rs => rs.map(r => r.dataset.type)")
    # It stopped at max_output_tokens: the task is `completed`, the response `incomplete`.
    assert types[0] == "response.created" and types[-1] == "response.incomplete", types
    numbers = rows.evaluate_all("rs => rs.map(r => Number(r.cells[0].textContent))")
    assert numbers == list(range(task["last_sequence_number"] + 1))
    # Above the folded events, the text they assemble: the stored response's text.
    assert log.locator(".jp-LMSP-logText").text_content() == text
    expect(log.locator(".jp-LMSP-logEvents > summary")).to_have_text(
        f"{task['last_sequence_number'] + 1} events"
    )
    shot(page, "3-event-log")
    page.evaluate("() => window.jupyterapp.commands.execute('application:close-all')")


def test_activity_sparklines_from_the_metrics(lab: LabServer, page: Any):
    """The Activity section reads GET /lmsp/v1/metrics on each refresh: a generation shows as
    throughput and a time to first token in the sparklines; nothing was recovered at start."""
    from playwright.sync_api import expect

    show_panel(page)
    panel = page.locator(f"{SIDEBAR} [data-section=activity]")
    expect(panel.locator("[data-field=recovered]")).to_have_text("nothing to recover")
    response = start_background(lab, "Count my tokens.", 150)
    with lab.client() as c:
        deadline = time.monotonic() + 60
        while c.get(f"/tasks/{response['task_id']}").json()["state"] != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.1)
    # A later interval of the sparkline holds the generation's tokens and first token.
    page.wait_for_function(
        """() => {
          const rate = document.querySelector('[data-section=activity] [data-field=throughput]');
          const ttft = document.querySelector('[data-section=activity] [data-field=ttft]');
          return rate && ttft && / ms$/.test(ttft.textContent.trim()) &&
            Number(rate.textContent.trim()) >= 0 &&
            document.querySelectorAll('[data-section=activity] polyline').length >= 1;
        }""",
        timeout=30_000,
    )
    spark = panel.locator("[data-sparkline=throughput]")
    assert int(spark.get_attribute("data-points")) >= 1
    expect(panel.locator("[data-field=queue]")).to_have_text("0 waiting, 0 running")
    shot(page, "activity")


def test_the_queue_line_follows_transitions_not_the_refresh(lab: LabServer, page: Any):
    """The Activity section's queue line ("N waiting, M running") is read again on each
    transition the lifecycle stream brings (issue 40: it lagged the task rows by up to a
    refresh period). With the periodic refresh stopped (it skips while the document is hidden),
    the line still follows a task to running and back."""
    from playwright.sync_api import expect

    show_panel(page)
    expect(page.locator(".jp-LMSP-sidebar")).to_have_attribute(
        "data-task-list", "lifecycle", timeout=20_000
    )
    queue = page.locator(f"{SIDEBAR} [data-section=activity] [data-field=queue]")
    expect(queue).to_have_text("0 waiting, 0 running", timeout=30_000)
    page.evaluate(
        "() => Object.defineProperty(document, 'visibilityState',"
        " {configurable: true, get: () => 'hidden'})"
    )
    try:
        response = start_background(lab, "Queue line.", 200)
        expect(queue).to_have_text("0 waiting, 1 running", timeout=60_000)
        row = task_row(page, response["task_id"])
        expect(row).to_have_attribute("data-state", "completed", timeout=60_000)
        expect(queue).to_have_text("0 waiting, 0 running", timeout=30_000)
    finally:
        # The document's own getter again (from its prototype): the refresh resumes.
        page.evaluate("() => delete document.visibilityState")


def test_new_tasks_arrive_through_the_lifecycle_stream_without_polling(lab: LabServer, page: Any):
    """While the panel is shown, the task list is listed once and then follows GET /lifecycle:
    a task created elsewhere appears and reaches its end with no request to list /tasks."""
    from playwright.sync_api import expect

    show_panel(page)
    expect(page.locator(".jp-LMSP-sidebar")).to_have_attribute(
        "data-task-list", "lifecycle", timeout=20_000
    )
    listed: list[str] = []

    def on_request(request: Any) -> None:
        if "/lmsp/v1/tasks?" in request.url:
            listed.append(request.url)

    page.on("request", on_request)
    try:
        response = start_background(lab, "Arrive by lifecycle.", 20)
        row = task_row(page, response["task_id"])
        expect(row).to_have_attribute("data-state", "completed", timeout=60_000)
        # Several refresh periods (2.5 s) passed while it ran: the other sections were
        # refreshed, the task list was not.
        time.sleep(3.0)
    finally:
        page.remove_listener("request", on_request)
    assert listed == [], listed


def test_cancel_from_the_panel(lab: LabServer, page: Any):
    from playwright.sync_api import expect

    show_panel(page)
    response = start_background(lab, "Cancel me later.", 1000)
    row = task_row(page, response["task_id"])
    expect(row).to_have_attribute("data-state", "running", timeout=20_000)
    row.locator("[data-action=cancel]").click()
    expect(row).to_have_attribute("data-state", "cancelled", timeout=20_000)
    expect(row.locator("[data-action=cancel]")).to_be_disabled()
    shot(page, "4-task-cancelled")
    with lab.client() as c:
        task = c.get(f"/tasks/{response['task_id']}").json()
        assert task["state"] == "cancelled"
        assert c.get(f"/responses/{response['id']}").json()["status"] == "cancelled"
    states = page.evaluate("() => window.__lmspStates")[response["task_id"]]
    assert states[-1] == "cancelled" and "running" in states, states


def test_register_a_model_from_a_path(lab: LabServer, page: Any, test_model_dir: Path):
    from playwright.sync_api import expect

    show_panel(page)
    panel = page.locator(SIDEBAR)
    source = panel.locator(".jp-LMSP-register input[name=source]")

    missing = lab.root / "no-such-model"
    source.fill(str(missing))
    panel.locator("[data-action=register]").click()
    with lab.client() as c:
        refused = c.post("/models", json={"source": str(missing)})
    assert refused.status_code >= 400
    # Whatever the server says (404 today; 405 before registration existed) is shown as is.
    expect(panel.locator(".jp-LMSP-error")).to_have_text(refused.json()["error"]["message"])

    copy = lab.root / "imports" / "tiny-copy"
    shutil.copytree(test_model_dir, copy)
    source.fill(str(copy))
    panel.locator("[data-action=register]").click()
    expect(panel.locator(".jp-LMSP-info")).to_contain_text(f"Registering {copy}")
    row = panel.locator('.jp-LMSP-modelRow[data-model-id="tiny-copy"]')
    expect(row).to_be_visible(timeout=30_000)
    with lab.client() as c:
        registered = c.get("/models/tiny-copy").json()
    expect(row.locator(".jp-LMSP-digest")).to_have_text(registered["digest"][:19])
    shot(page, "5-model-registered")


def test_pairing_from_a_separate_process_approved_in_the_panel(lab: LabServer, page: Any):
    from playwright.sync_api import expect

    hide_panel(page)
    script = Path(__file__).with_name("pairing_client.py")
    api = f"{lab.url}lmsp/v1"
    scopes = "responses:write,responses:read,models:read"
    proc = subprocess.Popen(
        [sys.executable, str(script), api, "notes-app", scopes],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        first = json.loads(proc.stdout.readline())
        code = first["user_code"]
        # The panel is closed: a JupyterLab notification tells the user.
        toast = page.locator(".jp-toast-message", has_text=code)
        expect(toast).to_be_visible(timeout=20_000)
        shot(page, "6-pairing-notification")
        page.locator(".Toastify__toast", has_text=code).get_by_role("button", name="Review").click()
        card = page.locator(f'{SIDEBAR} .jp-LMSP-pairing[data-user-code="{code}"]')
        expect(card).to_be_visible()
        expect(card.locator(".jp-LMSP-clientName")).to_have_text("notes-app")
        # Narrow the grant: no models:read.
        card.locator('input[data-scope="models:read"]').uncheck()
        shot(page, "7-pairing-request")
        card.locator("[data-action=approve]").click()
        expect(card).to_have_count(0)
        out, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["scopes"] == ["responses:read", "responses:write"]
    assert result["status"] in ("completed", "incomplete")
    expect(page.locator(".jp-toast-message", has_text=code)).to_have_count(0)

    client_row = page.locator(
        f'{SIDEBAR} .jp-LMSP-clientRow[data-client-id="{result["client_id"]}"]'
    )
    expect(client_row).to_be_visible(timeout=10_000)
    expect(client_row).to_contain_text("notes-app")
    expect(client_row).to_contain_text(re.compile(r"used \d+s ago"))  # its openai SDK call
    expect(client_row).to_contain_text("responses:read responses:write")
    shot(page, "8-client-paired")

    client_row.locator("[data-action=revoke]").click()
    page.locator(".jp-Dialog").get_by_role("button", name="Revoke").click()
    expect(client_row).to_have_count(0, timeout=10_000)
    with lab.client() as c:
        clients = c.get("/clients").json()["data"]
    assert result["client_id"] not in {c["id"] for c in clients}  # revoked ones are not listed


# A forced call of a custom tool whose input is five digits (a regex grammar): the random test
# model's answer ends `completed`, not at its token limit.
FORCED_CALL = {
    "tools": [
        {
            "type": "custom",
            "name": "zip_code",
            "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]{5}"},
        }
    ],
    "tool_choice": {"type": "custom", "name": "zip_code"},
    "max_output_tokens": 200,
}
LONG_PROMPT = (
    "Summarise the history of lighthouses on the Norwegian coast, from the first coal fires "
    "to the automated stations of today"
)


def wait_task(lab: LabServer, task_id: str) -> dict[str, Any]:
    """The task once it has ended (waiting on its event stream's end, not on a clock)."""
    with lab.client() as c:
        with c.stream("GET", f"/tasks/{task_id}/events?stream=true") as r:
            for _ in r.iter_lines():
                pass
        return c.get(f"/tasks/{task_id}").json()


def test_task_rows_say_what_each_task_is_and_older_ones_page(lab: LabServer, page: Any):
    from playwright.sync_api import expect

    show_panel(page)
    with lab.client() as c:
        r = c.post(
            "/responses",
            json={"input": "Pick a letter.", "background": True, "temperature": 0, **FORCED_CALL},
        )
        assert r.status_code == 202, r.text
        completed = r.json()
    incomplete = start_background(lab, LONG_PROMPT, 3)
    cancelled = start_background(lab, "Cancel   me\n  soon, please.", 2000)
    row = task_row(page, cancelled["task_id"])
    expect(row).to_have_attribute("data-state", "running", timeout=30_000)
    with lab.client() as c:
        assert c.post(f"/tasks/{cancelled['task_id']}/cancel", json={}).status_code == 200
    tasks = {
        "completed": wait_task(lab, completed["task_id"]),
        "incomplete": wait_task(lab, incomplete["task_id"]),
        "cancelled": wait_task(lab, cancelled["task_id"]),
    }
    assert (
        tasks["completed"]["state"] == "completed" and not tasks["completed"]["incomplete_reason"]
    )
    assert tasks["incomplete"]["incomplete_reason"] == "max_output_tokens"
    assert tasks["cancelled"]["state"] == "cancelled"
    # The wire's excerpt: whitespace collapsed, a long prompt cut at a word with '…'.
    assert tasks["cancelled"]["prompt_excerpt"] == "Cancel me soon, please."
    cut = tasks["incomplete"]["prompt_excerpt"]
    assert len(cut) <= 80 and cut.endswith("…") and LONG_PROMPT.startswith(cut[:-1].rstrip())
    assert LONG_PROMPT[len(cut) - 1] == " "  # cut between words
    # Each row: its excerpt, its outcome's words, the colour class of that outcome.
    expected = {
        "completed": ("completed", "Pick a letter."),
        "incomplete": ("incomplete: max_output_tokens", cut),
        "cancelled": ("cancelled", "Cancel me soon, please."),
    }
    colours = {}
    for cls, (word, excerpt) in expected.items():
        row = task_row(page, tasks[cls]["id"])
        expect(row).to_have_attribute("data-outcome", cls, timeout=30_000)
        expect(row.locator(".jp-LMSP-state")).to_have_text(word)
        expect(row.locator(".jp-LMSP-excerpt")).to_have_text(excerpt)
        expect(row.locator(".jp-LMSP-took")).to_contain_text("s")
        colours[cls] = row.locator(".jp-LMSP-state").evaluate(
            "e => getComputedStyle(e).backgroundColor"
        )
    assert len(set(colours.values())) == 3, colours  # green, amber, grey: all different
    expect(task_row(page, tasks["incomplete"]["id"]).locator(".jp-LMSP-progress")).to_have_text(
        "3 tokens"
    )
    shot(page, "8-task-outcomes")

    # More tasks than the newest page (20) holds: the older ones come with "Older tasks".
    with lab.client() as c:
        listed = c.get("/tasks?limit=100").json()["data"]
    for i in range(max(0, 21 - len(listed))):
        wait_task(lab, start_background(lab, f"Filler task {i}.", 1)["task_id"])
    with lab.client() as c:
        every = [t["id"] for t in c.get("/tasks?limit=100").json()["data"]]
    panel = page.locator(SIDEBAR)
    expect(panel.locator(".jp-LMSP-task")).to_have_count(20, timeout=30_000)
    more = panel.locator("[data-action=older-tasks]")
    more.click()
    expect(panel.locator(".jp-LMSP-task")).to_have_count(min(len(every), 40), timeout=30_000)
    shown = panel.locator(".jp-LMSP-task").evaluate_all("rs => rs.map(r => r.dataset.taskId)")
    assert shown == every[:40]  # newest first, each once, the second page after the first
    expect(panel.locator(".jp-LMSP-tasks .jp-LMSP-count")).to_have_text(
        f"0 unfinished · {len(shown)} finished"
    )
    if len(every) <= 40:
        expect(more).to_have_count(0)
    task_row(page, every[-1]).scroll_into_view_if_needed()
    shot(page, "9-older-tasks")


def test_webhook_endpoint_added_in_the_panel(lab: LabServer, page: Any):
    from playwright.sync_api import expect

    show_panel(page)
    panel = page.locator(SIDEBAR)
    section = panel.locator(".jp-LMSP-webhooks")
    form = section.locator(".jp-LMSP-webhookForm")
    # The service's refusal is shown as its text.
    form.locator("input[name=webhook-url]").fill("ftp://example.org/hook")
    form.locator("[data-action=add-webhook]").click()
    expect(section.locator(".jp-LMSP-error")).to_contain_text("http")
    section.locator(".jp-LMSP-error").scroll_into_view_if_needed()
    shot(page, "10-webhook-refused")

    receiver = Receiver()
    dead_end = Receiver(lambda _id, _n: 500)
    try:
        form.locator("input[name=webhook-url]").fill(receiver.url)
        form.locator("input[value='response.incomplete']").check()
        form.locator("[data-action=add-webhook]").click()
        secret_box = section.locator(".jp-LMSP-secret")
        expect(secret_box).to_be_visible(timeout=20_000)
        expect(section.locator(".jp-LMSP-error")).to_have_count(0)
        expect(secret_box.locator(".jp-LMSP-secretNote")).to_contain_text("shown once")
        secret = secret_box.locator(".jp-LMSP-secretValue").text_content()
        assert secret and secret.startswith("whsec_")
        endpoint_id = secret_box.get_attribute("data-endpoint-id")
        row = section.locator(f'.jp-LMSP-webhook[data-endpoint-id="{endpoint_id}"]')
        expect(row.locator(".jp-LMSP-url")).to_have_text(receiver.url)
        expect(row).to_contain_text("completed · incomplete")
        expect(section.locator("[data-action=copy-secret]")).to_be_visible()
        secret_box.scroll_into_view_if_needed()
        shot(page, "11-webhook-secret-once")
        receiver.secret = secret
        section.locator("[data-action=forget-secret]").click()
        expect(secret_box).to_have_count(0)
        assert secret not in panel.inner_text()  # once only: the list never shows it

        task = start_background(lab, "Tell the receiver.", 3)
        wait_task(lab, task["task_id"])
        assert receiver.wait_accepted(1, 60), receiver.receipts
        assert receiver.bad == []
        expect(row).to_have_attribute("data-delivered", "1", timeout=30_000)
        expect(row.locator("[data-count=delivered]")).to_have_text("1 delivered")
        row.scroll_into_view_if_needed()
        shot(page, "12-webhook-delivered")

        # An endpoint whose receiver answers 500: after two attempts, a dead letter.
        with lab.client() as c:
            r = c.post("/webhooks", json={"url": dead_end.url, "events": ["response.incomplete"]})
            assert r.status_code == 201, r.text
            dead_end.secret = r.json()["secret"]
            dead_id = r.json()["id"]
        wait_task(lab, start_background(lab, "Nobody listens.", 3)["task_id"])
        dead_row = section.locator(f'.jp-LMSP-webhook[data-endpoint-id="{dead_id}"]')
        expect(dead_row).to_have_attribute("data-dead", "1", timeout=60_000)
        letter = dead_row.locator(".jp-LMSP-deadLetter")
        expect(letter).to_have_count(1)
        expect(letter).to_contain_text("incomplete · 2 attempts · 500")
        letter.scroll_into_view_if_needed()
        shot(page, "13-webhook-dead-letter")
        dead_end.answer = lambda _id, _n: 200  # the receiver is back: redeliver
        letter.locator("[data-action=redeliver]").click()
        expect(dead_row).to_have_attribute("data-delivered", "1", timeout=60_000)
        expect(dead_row).to_have_attribute("data-dead", "0")
        expect(letter).to_have_count(0)
        assert len(dead_end.accepted) == 1 and dead_end.bad == []

        # Deleted from the panel: gone from the service too.
        for endpoint in (endpoint_id, dead_id):
            section.locator(
                f'.jp-LMSP-webhook[data-endpoint-id="{endpoint}"] [data-action=delete-webhook]'
            ).click()
        expect(section.locator(".jp-LMSP-webhook")).to_have_count(0, timeout=20_000)
        with lab.client() as c:
            assert c.get("/webhooks").json()["data"] == []
    finally:
        receiver.close()
        dead_end.close()


def test_labextension_is_listed_enabled():
    """`pip install` is the only step: the prebuilt extension is in this environment's
    share/jupyter/labextensions and JupyterLab lists it as enabled."""
    jupyter = Path(sys.executable).with_name("jupyter")
    out = subprocess.run(
        [str(jupyter), "labextension", "list"], capture_output=True, text=True, timeout=120
    )
    listing = out.stdout + out.stderr
    line = next((x for x in listing.splitlines() if "jupyter-lmsp-labextension" in x), "")
    assert "enabled" in line and "OK" in line, listing
