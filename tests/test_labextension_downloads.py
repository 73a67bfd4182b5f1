"""The sidebar shows a model download's progress (issue 39), in a real browser: `jupyter lab`
with the installed extension on Debian's headless Chromium (tests/labbrowser.py), downloading
from a Hugging Face hub served on loopback (tests/loopbackhub.py) a model made here
(tests/bigmodel.py, ~32 MB in two shards). Nothing is fetched from outside.

The hub holds the second shard part way (its gate), so the download is caught in its middle
without timing anything: the Models section shows its stage, percent, bytes of the total,
files and rate, as the task's last `task.progress` event says; once the gate opens, the row
says the model was registered and the model is listed. A source the hub does not have shows
the error. Screenshots go to `test-artifacts/labextension-downloads/`.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bigmodel import GATE, SHARD2, write_big_model
from labbrowser import (  # the two fixtures override pytest-jupyter's
    SIDEBAR,
    jp_asyncio_loop,  # noqa: F401
    jp_server_cleanup,  # noqa: F401
    lab_page,
    require_browser,
)
from labserver import LabServer
from loopbackhub import LoopbackHub
from serverproc import TOKEN

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "labextension-downloads"
REPO = "lmsp-test/big"
# Records every stage and percent a registration row shows, in order ("downloading 42%").
PERCENT_RECORDER = """() => {
  window.__lmspPercents = [];
  const record = () => {
    const row = document.querySelector('.jp-LMSP-registration');
    const percent = row?.querySelector('.jp-LMSP-percent');
    const seen = window.__lmspPercents;
    const now = percent ? `${row.dataset.stage} ${percent.textContent}` : null;
    if (now && seen[seen.length - 1] !== now) seen.push(now);
  };
  new MutationObserver(record).observe(document.body, {
    subtree: true, childList: true, characterData: true
  });
}"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, test_model_dir: Path) -> Iterator[LoopbackHub]:
    big = write_big_model(tmp_path_factory.mktemp("big") / "big", test_model_dir)
    with LoopbackHub({REPO: big}) as served:
        yield served


@pytest.fixture(scope="module")
def lab(
    tmp_path_factory: pytest.TempPathFactory, test_model_dir: Path, hub: LoopbackHub
) -> Iterator[LabServer]:
    require_browser()
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    root = tmp_path_factory.mktemp("downloads-lab")
    with LabServer(
        root, models={"tiny": test_model_dir}, env=hub.client_env(root / "hf-home")
    ) as server:
        yield server


@pytest.fixture(scope="module")
def page(lab: LabServer) -> Iterator[Any]:
    # Narrow, as a sidebar is: the figures must fit its width.
    with lab_page(lab.url, TOKEN, 1100, 800, PERCENT_RECORDER) as page:
        page.locator(f'.jp-SideBar.jp-mod-left li[data-id="{SIDEBAR[1:]}"]').click()
        page.locator(SIDEBAR).wait_for(state="visible")
        yield page


def shot(page: Any, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def register(page: Any, source: str) -> Any:
    """Type `source` into the Models section's form and submit it; the registration's row."""
    panel = page.locator(SIDEBAR)
    panel.locator(".jp-LMSP-register input[name=source]").fill(source)
    panel.locator("[data-action=register]").click()
    return panel.locator(".jp-LMSP-registration").first


def shown(row: Any) -> dict[str, Any]:
    """What the row shows, read at one instant."""
    return dict(
        row.evaluate(
            """r => ({
              bytesDone: Number(r.dataset.bytesDone),
              stage: r.dataset.stage,
              percent: r.querySelector('.jp-LMSP-percent')?.textContent,
              bytes: r.querySelector('.jp-LMSP-bytes')?.textContent,
              files: r.querySelector('.jp-LMSP-files')?.textContent,
              rate: r.querySelector('.jp-LMSP-rate')?.textContent,
              bar: r.querySelector('[role=progressbar]')?.getAttribute('aria-valuenow'),
            })"""
        )
    )


def progress_events(lab: LabServer, task_id: str) -> list[dict[str, Any]]:
    with lab.client() as c:
        r = c.get(f"/tasks/{task_id}/events", params={"limit": 1000})
        assert r.status_code == 200, r.text
        return [e for e in r.json()["data"] if e["type"] == "task.progress"]


def test_a_download_shows_its_progress_then_the_registered_model(
    lab: LabServer, page: Any, hub: LoopbackHub
) -> None:
    from playwright.sync_api import expect

    hub.close_gate(REPO, SHARD2, GATE)
    try:
        row = register(page, f"hf://{REPO}")
        expect(row).to_have_attribute("data-stage", "downloading", timeout=60_000)
        task_id = row.get_attribute("data-task-id")
        assert hub.gate_reached.wait(240), "the download never reached the hub's gate"
        # Held at the gate, the download stops telling; the row shows what its last event
        # says (the row may still be a step behind while the last events arrive).
        page.wait_for_function(
            """() => Number(document.querySelector('.jp-LMSP-registration')
                  ?.dataset.bytesDone) > 0"""
        )
        for _ in range(200):
            now = shown(row)
            told = [e for e in progress_events(lab, task_id) if e["stage"] == "downloading"]
            if told and told[-1]["bytes_done"] == now["bytesDone"]:
                break
            page.wait_for_timeout(100)
        last = told[-1]
        assert last["bytes_done"] == now["bytesDone"], (last, now)
        assert 0 < last["fraction"] < 1
        percent = math.floor(last["fraction"] * 100)
        assert now["percent"] == f"{percent}%" and now["bar"] == str(percent)
        assert now["files"] == f"{last['files_done']}/{last['files_total']} files"
        assert now["bytes"].endswith(f" of {hub.size(REPO) / 1e6:.1f} MB"), now
        assert now["rate"].endswith("/s"), now
        expect(row.locator("[data-field=registration-state]")).to_have_text("downloading")
        shot(page, "1-download-in-progress")
    finally:
        hub.gate = None
        hub.release.set()

    expect(row).to_have_attribute("data-outcome", "registered", timeout=120_000)
    expect(row.locator("[data-field=registered]")).to_have_text("registered as big")
    model_row = page.locator(f'{SIDEBAR} .jp-LMSP-modelRow[data-model-id="big"]')
    expect(model_row).to_be_visible(timeout=30_000)
    # The download's figures stay, complete, under the outcome; no rate once it is over.
    expect(row.locator(".jp-LMSP-files")).to_have_text(
        f"{len(hub.repos[REPO])}/{len(hub.repos[REPO])} files"
    )
    expect(row.locator(".jp-LMSP-rate")).to_have_count(0)
    shot(page, "2-download-registered")
    # Shown live: each stage's percent only grew, and the download was seen part way.
    seen = [p.split(" ") for p in page.evaluate("() => window.__lmspPercents")]
    stages = {stage: [int(p.rstrip("%")) for s, p in seen if s == stage] for stage, _ in seen}
    assert all(v == sorted(v) for v in stages.values()), seen
    assert any(0 < p < 100 for p in stages["downloading"]), seen
    with lab.client() as c:
        assert c.get("/models/big").json()["state"] == "available"

    row.locator("[data-action=dismiss]").click()
    expect(page.locator(f'.jp-LMSP-registration[data-task-id="{task_id}"]')).to_have_count(0)


def test_a_download_that_fails_shows_the_error(lab: LabServer, page: Any) -> None:
    from playwright.sync_api import expect

    row = register(page, "hf://lmsp-test/absent")
    expect(row).to_have_attribute("data-outcome", "failed", timeout=60_000)
    task_id = row.get_attribute("data-task-id")
    with lab.client() as c:
        task = c.get(f"/tasks/{task_id}").json()
    assert task["state"] == "failed"
    expect(row.locator(".jp-LMSP-error")).to_have_text(
        f"{task['error']['message']} ({task['error']['code']})"
    )
    expect(row.locator("[data-field=registration-state]")).to_have_text("failed")
    shot(page, "3-download-failed")
