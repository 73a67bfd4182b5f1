"""The widgets' logic, in Python: following a task across dropped connections (reconnect from
the last sequence number, gaps filled, repeats dropped), the reducer that turns events into
what a TaskWatcher shows, the TaskWatcher and TaskBoard themselves against a scripted fake
service, and then against a real server that is killed and restarted mid-task, and a real
kernel that is restarted mid-task.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serverproc import TOKEN, ServerProcess

from jupyter_lmsp.client import APIError, Client, Event, Task
from jupyter_lmsp.client.errors import SequenceGapError
from jupyter_lmsp.client.follow import EventFollower
from jupyter_lmsp.widgets import TaskBoard, TaskWatcher, WatcherState

# -- a scripted event source -------------------------------------------------------------------


def response_obj(status: str, text: str = "", output_tokens: int | None = None) -> dict:
    output = []
    if text:
        output = [
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": text}],
            }
        ]
    usage = None if output_tokens is None else {"input_tokens": 3, "output_tokens": output_tokens}
    return {
        "id": "resp_1",
        "model": "tiny",
        "status": status,
        "output": output,
        "usage": usage,
        "completed_at": 1000,
    }


def task_log(text_pieces: list[str], end: str = "response.completed") -> list[dict]:
    """A complete, well-formed event log whose deltas are `text_pieces`."""
    text = "".join(text_pieces)
    kinds: list[dict] = [
        {"type": "response.created", "response": response_obj("queued")},
        {"type": "response.loading", "response": response_obj("queued")},
        {"type": "response.in_progress", "response": response_obj("in_progress")},
        {"type": "response.output_item.added", "output_index": 0, "item": {"status": "x"}},
        {"type": "response.content_part.added", "output_index": 0},
        *(
            {"type": "response.output_text.delta", "output_index": 0, "delta": p}
            for p in text_pieces
        ),
        {"type": "response.output_text.done", "output_index": 0, "text": text},
        {
            "type": end,
            "response": response_obj(
                end.split(".")[1].replace("cancelled", "cancelled"), text, len(text_pieces)
            ),
        },
    ]
    return [dict(e, sequence_number=i) for i, e in enumerate(kinds)]


class Script:
    """One scripted connection: the events it delivers, then how it ends."""

    def __init__(self, events: list[dict], then: BaseException | None = None, block=False):
        self.events = events
        self.then = then
        self.block = block


class FakeStream:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.closed = threading.Event()

    def __iter__(self) -> Iterator[dict]:
        for e in self.script.events:
            if self.closed.is_set():
                raise httpx.ReadError("closed")
            yield e
        if self.script.block:
            self.closed.wait(10)
            raise httpx.ReadError("closed")
        if self.script.then is not None:
            raise self.script.then

    def close(self) -> None:
        self.closed.set()


class FakeSource:
    """Connections follow `scripts` in order; pages come from `log` (the stored events)."""

    def __init__(self, log: list[dict], scripts: list[Script | BaseException]) -> None:
        self.log = log
        self.scripts = list(scripts)
        self.stream_calls: list[int] = []
        self.page_calls: list[int] = []

    def stream(self, after: int) -> FakeStream:
        self.stream_calls.append(after)
        script = self.scripts.pop(0) if self.scripts else Script(self.after(after))
        if isinstance(script, BaseException):
            raise script
        return FakeStream(script)

    def after(self, seq: int) -> list[dict]:
        return [e for e in self.log if e["sequence_number"] > seq]

    def page(self, after: int, limit: int) -> tuple[list[dict], bool]:
        self.page_calls.append(after)
        rest = self.after(after)
        return rest[:limit], len(rest) > limit


def follow(source: FakeSource, **kw: Any) -> tuple[EventFollower, list[int]]:
    follower = EventFollower(source, backoff=(0.0, 0.0), **kw)
    return follower, [e.sequence_number for e in follower]


LOG = task_log(["Once", " upon", " a", " time", "."])
N = len(LOG)


# -- EventFollower -----------------------------------------------------------------------------


def test_follower_delivers_a_log_once():
    source = FakeSource(LOG, [Script(LOG)])
    follower, seqs = follow(source)
    assert seqs == list(range(N))
    assert follower.done and follower.reconnects == 0 and source.stream_calls == [-1]


def test_follower_reconnects_from_the_last_sequence_number_and_drops_repeats():
    # The first connection dies after event 4; the second overlaps (it resends 2..4).
    source = FakeSource(
        LOG, [Script(LOG[:5], httpx.RemoteProtocolError("peer closed")), Script(LOG[2:])]
    )
    statuses: list[str] = []
    follower, seqs = follow(source, on_status=lambda s, _d: statuses.append(s))
    assert seqs == list(range(N))
    assert source.stream_calls == [-1, 4]
    assert follower.reconnects == 1 and follower.duplicates_dropped == 3
    assert statuses[0] == "connecting" and "reconnecting" in statuses and statuses[-1] == "done"


def test_follower_fills_a_gap_from_the_stored_log():
    source = FakeSource(LOG, [Script(LOG[:3] + LOG[6:])])
    follower, seqs = follow(source)
    assert seqs == list(range(N))
    assert follower.gaps_filled == 1 and source.page_calls == [2]
    assert follower.reconnects == 0


def test_follower_reconnects_when_the_log_cannot_fill_a_gap():
    source = FakeSource(LOG[:3], [Script(LOG[:3] + LOG[6:]), Script(LOG[3:])])
    follower, seqs = follow(source)
    assert seqs == list(range(N))
    assert source.stream_calls == [-1, 2] and follower.reconnects == 1


def test_follower_reconnects_when_a_stream_ends_early_or_the_server_is_down():
    source = FakeSource(
        LOG,
        [
            Script(LOG[:4]),  # ends without the terminal event
            httpx.ConnectError("connection refused"),  # the server is restarting
            APIError(503, {"error": {"code": "unavailable", "message": "starting"}}),
            Script(LOG[4:]),
        ],
    )
    follower, seqs = follow(source)
    assert seqs == list(range(N))
    assert source.stream_calls == [-1, 3, 3, 3] and follower.reconnects == 3


def test_follower_raises_what_retrying_cannot_fix():
    source = FakeSource(LOG, [APIError(404, {"error": {"code": "not_found", "message": "gone"}})])
    with pytest.raises(APIError) as e:
        follow(source)
    assert e.value.status == 404


def test_follower_gives_up_after_max_downtime():
    source = FakeSource(LOG, [httpx.ConnectError("down")] * 1000)
    follower = EventFollower(source, backoff=(0.01, 0.01), max_downtime=0.1)
    with pytest.raises(httpx.ConnectError):
        list(follower)


def test_follower_close_interrupts_a_blocked_stream():
    source = FakeSource(LOG, [Script(LOG[:3], block=True)])
    follower = EventFollower(source, backoff=(0.0, 0.0))
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.extend(e.sequence_number for e in follower))
    thread.start()
    # Close once the three events are through and the stream blocks, not after a guess.
    deadline = time.monotonic() + 10
    while len(seen) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    follower.close()
    thread.join(5)
    assert not thread.is_alive()
    assert seen == [0, 1, 2] and not follower.done


def test_follower_starts_after_a_given_sequence_number():
    source = FakeSource(LOG, [])
    _, seqs = follow(source, after=5)
    assert seqs == list(range(6, N)) and source.stream_calls == [5]


# -- WatcherState ------------------------------------------------------------------------------


def events(log: list[dict]) -> list[Event]:
    return [Event.from_wire(e) for e in log]


def test_state_follows_the_lifecycle_and_the_text():
    state = WatcherState(task_id="task_1", max_events=4)
    seen_states = []
    for e in events(LOG):
        assert state.apply(e)
        seen_states.append(state.state)
    assert seen_states[:3] == ["queued", "loading", "running"]
    assert state.state == "completed" and state.status == "completed"
    assert state.text == "Once upon a time."
    assert state.tokens == 5 and state.output_tokens == 5  # the exact count from usage
    assert [line.sequence_number for line in state.recent] == list(range(N - 4, N))
    assert state.recent[-1].type == "response.completed"
    traits = state.to_traits()
    assert traits["last_sequence_number"] == N - 1 and traits["tokens_exact"]
    assert [e["seq"] for e in traits["events"]] == list(range(N - 4, N))


def test_state_ignores_repeats_and_refuses_gaps():
    state = WatcherState(task_id="task_1")
    evs = events(LOG)
    for e in evs[:7]:
        state.apply(e)
    text = state.text
    assert not state.apply(evs[5]) and not state.apply(evs[6])
    assert state.text == text  # nothing doubled
    with pytest.raises(SequenceGapError):
        state.apply(evs[9])
    assert state.text == text and state.last_sequence_number == 6


def test_state_estimates_tokens_until_the_exact_count_arrives():
    state = WatcherState(task_id="task_1", count_tokens=len)  # a token per character
    for e in events(LOG)[:-1]:
        state.apply(e)
    assert state.tokens == len("Once upon a time.") and state.output_tokens is None
    state.apply(events(LOG)[-1])
    assert state.tokens == 5


def test_state_measures_tokens_per_second_over_live_events():
    state = WatcherState(task_id="task_1", count_tokens=lambda s: 1, live_after=-1)
    t = 100.0
    for e in events(LOG):
        state.apply(e, now=t)
        t += 0.5
    # 5 tokens from the first event (t=100) to the terminal one (t=100 + 0.5 * (N - 1)).
    assert state.tokens_per_second() == pytest.approx(5 / (0.5 * (N - 1)))


def test_state_of_a_task_finished_before_watching_averages_over_its_life():
    task = {
        "id": "task_1",
        "state": "completed",
        "created_at": 10.0,
        "finished_at": 20.0,
        "last_sequence_number": N - 1,
    }
    state = WatcherState.from_task(task)
    for e in events(LOG):
        state.apply(e)
    assert state.tokens_per_second() == pytest.approx(0.5)
    assert state.elapsed() == pytest.approx(10.0)


def test_state_shows_only_the_last_attempt_after_a_retry():
    log = task_log(["first", " try"])[:7]  # interrupted mid-generation
    log += [
        {"type": "response.output_text.done", "output_index": 0, "text": "first try"},
        {"type": "response.queued", "response": response_obj("queued")},
        {"type": "response.in_progress", "response": response_obj("in_progress")},
        {"type": "response.output_item.added", "output_index": 1, "item": {}},
        {"type": "response.output_text.delta", "output_index": 1, "delta": "second"},
        {"type": "response.completed", "response": response_obj("completed", "second", 1)},
    ]
    log = [dict(e, sequence_number=i) for i, e in enumerate(log)]
    state = WatcherState(task_id="task_1")
    texts = []
    for e in events(log):
        state.apply(e)
        texts.append(state.text)
    assert "first try" in texts and state.text == "second"
    assert state.state == "completed"


def test_state_shows_function_calls_and_the_output_format():
    """The items a tool-calling attempt makes (protocol.output, as the store writes them): the
    text before the calls, then each call with its arguments as they stream and at the end."""
    from jupyter_lmsp.protocol.output import (
        Attempt,
        Batch,
        CallArguments,
        CallBegin,
        CallEnd,
        ChoiceEnd,
        Text,
    )

    attempt, opened = Attempt.begin(Attempt({}), "1", 3, eager=False)
    steps = [
        Batch({}, [Text(0, "Let me look.")]),
        Batch({}, [CallBegin(0, 0, "get_weather"), CallArguments(0, 0, '{"city": ')]),
        Batch({}, [CallArguments(0, 0, '"Oslo"}'), CallEnd(0, 0, '{"city": "Oslo"}')]),
        Batch({}, [ChoiceEnd(0, "stop")]),
    ]
    produced = [e for batch in steps for e in attempt.apply(batch)]
    final = response_obj("completed")
    final["output"] = attempt.output()
    final["text"] = {"format": {"type": "text"}}
    log = [
        {"type": "response.created", "response": response_obj("queued")},
        {"type": "response.in_progress", "response": response_obj("in_progress")},
        *opened,
        *produced,
        {"type": "response.completed", "response": final},
    ]
    log = [dict(e, sequence_number=i) for i, e in enumerate(log)]
    state = WatcherState(task_id="task_1")
    seen = []
    for e in events(log):
        state.apply(e)
        seen.append([(c["name"], c["arguments"], c["status"]) for c in state.calls])
    assert [("get_weather", '{"city": ', "in_progress")] in seen  # arguments as they stream
    assert state.text == "Let me look."  # a call does not wipe the text before it
    assert state.calls == [
        {
            "id": state.calls[0]["id"],
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
            "status": "completed",
        }
    ]
    traits = state.to_traits()
    assert traits["calls"] == state.calls and traits["format"] == "text"
    assert any(line.detail.startswith("call get_weather") for line in state.recent)

    structured = response_obj("completed", '{"a": 1}', 4)
    structured["text"] = {"format": {"type": "json_schema", "name": "s", "schema": {}}}
    state = WatcherState(task_id="task_2")
    for i, e in enumerate([{"type": "response.created"}, {"type": "response.completed"}]):
        state.apply(Event.from_wire(dict(e, sequence_number=i, response=structured)))
    assert state.format == "json_schema" and state.text == '{"a": 1}' and state.calls == []


# -- TaskWatcher and TaskBoard on a fake service ------------------------------------------------


class FakeClient:
    """What the widgets use of `Client`, over scripted sources."""

    def __init__(self, log: list[dict], scripts: list[Script | BaseException]) -> None:
        self.log = log
        self.source = FakeSource(log, scripts)
        self.cancelled: list[str] = []
        self.task = {
            "id": "task_1",
            "kind": "response",
            "state": "queued",
            "model": "tiny",
            "response_id": "resp_1",
            "created_at": time.time(),
            "finished_at": None,
            "last_sequence_number": -1,
        }

    def task_id_of(self, target: Any) -> str:
        if isinstance(target, str):
            return target
        return getattr(target, "task_id", None) or target.id

    def get_task(self, task_id: str) -> Task:
        return Task.from_wire(self.task)

    def model(self, model_id: str) -> Any:
        raise APIError(404, {})

    def follow(self, task_id: str, after: int = -1, **kw: Any) -> EventFollower:
        return EventFollower(self.source, after, backoff=(0.0, 0.0), **kw)

    def cancel_task(self, task_id: str) -> Task:
        self.cancelled.append(task_id)
        return Task.from_wire(dict(self.task, state="cancelling"))

    def tasks(self, states: list[str] | None = None, limit: int | None = None) -> list[Task]:
        rows = [
            dict(self.task, id=f"task_{i}", state=s) for i, s in enumerate(["running", "failed"])
        ]
        return [Task.from_wire(r) for r in rows if not states or r["state"] in states]


def test_watcher_shows_one_clean_text_across_drops_gaps_and_repeats():
    scripts: list[Script | BaseException] = [
        Script(LOG[:6], httpx.RemoteProtocolError("server went away")),
        httpx.ConnectError("refused"),
        Script(LOG[3:8] + LOG[9:10]),  # repeats 3..5, then skips 8
        Script(LOG[7:]),
    ]
    client = FakeClient(LOG, scripts)
    w = TaskWatcher("task_1", client=client)  # type: ignore[arg-type]
    w.wait(10)
    assert w.state == "completed" and w.connection == "done"
    assert w.text == "Once upon a time."
    assert w.last_sequence_number == N - 1
    assert w.reconnects == 3
    assert [e["seq"] for e in w.events] == list(range(N - 8, N))
    assert w.tokens == 5 and w.tokens_exact
    assert w.follower is not None and w.follower.duplicates_dropped >= 3
    w.close()


def test_watcher_cancel_button_message_cancels_the_task():
    client = FakeClient(LOG, [Script(LOG[:6], block=True)])
    w = TaskWatcher("task_1", client=client)  # type: ignore[arg-type]
    deadline = time.monotonic() + 5
    while w.state != "running" and time.monotonic() < deadline:
        time.sleep(0.02)
    w._on_frontend_msg(w, {"type": "cancel"}, [])  # what the view's Cancel button sends
    assert client.cancelled == ["task_1"]
    w.close()
    assert w._finished.wait(5)
    with pytest.raises(RuntimeError):
        w.wait(0)  # closed before the task ended


def test_a_displayed_object_opens_its_watcher_with_its_model(monkeypatch):
    """The first state message (what a notebook saved at once keeps) already names the model
    and the response, when the watcher comes from a Task or Response object's display."""
    from jupyter_lmsp.client import Response

    client = FakeClient(LOG, [Script(LOG)])
    opened: list[dict] = []
    real_open = TaskWatcher.open

    def recording_open(self: TaskWatcher) -> None:
        opened.append(self.get_state())
        real_open(self)

    monkeypatch.setattr(TaskWatcher, "open", recording_open)
    task = Task.from_wire(client.task)
    response = Response.from_wire(dict(response_obj("queued"), task_id="task_1"))
    for obj in (task, response):
        obj.client = client  # type: ignore[assignment]
        w = obj.watch(start=False)
        assert isinstance(w, TaskWatcher) and w.task_id == "task_1"
        w.close()
    assert [(s["model"], s["response_id"]) for s in opened] == [("tiny", "resp_1")] * 2


def test_board_filters_and_opens_rows():
    client = FakeClient(LOG, [Script(LOG)])
    board = TaskBoard(client, interval=0.05)  # type: ignore[arg-type]
    board.wait_for_poll()
    assert [r["state"] for r in board.table.rows] == ["running", "failed"]
    board.state_filter = "failed"
    board.wait_for_poll()
    assert [r["id"] for r in board.table.rows] == ["task_1"]
    with pytest.raises(Exception, match="unknown task state"):
        board.state_filter = "sleeping"
    board._on_frontend_msg(board.table, {"type": "open", "task_id": "task_1"}, [])
    assert board.watcher is not None and board.detail.children == (board.watcher,)
    assert board.table.selected == "task_1"
    board.watcher.wait(10)
    assert board.watcher.state == "completed"
    board.close()


# -- a real server, killed and restarted under a watcher ----------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_watcher_survives_a_server_restart(lmsp_data):
    server = ServerProcess(lmsp_data, engine_token_delay=0.03, snapshot_interval=0.02).start()
    client = Client(server.url, TOKEN)
    try:
        job = client.start_response(
            "Tell me a story.", max_output_tokens=150, temperature=0, on_restart="resume"
        )
        w = TaskWatcher(job, client=client)
        deadline = time.monotonic() + 60
        while w.last_sequence_number < 15:
            assert time.monotonic() < deadline, w.connection_detail
            time.sleep(0.02)
        server.kill()
        deadline = time.monotonic() + 10
        while w.connection != "reconnecting":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        before = w.text
        restarted = ServerProcess(lmsp_data)
        restarted.port = server.port  # same address: the watcher reconnects by itself
        restarted.start()
        try:
            w.wait(90)
            final = client.get_response(job.id)
            stored = client.all_events(job.task_id)
            assert w.state == "completed" and w.reconnects >= 1
            assert w.text.startswith(before) and w.text == final.output_text
            assert w.last_sequence_number == stored[-1].sequence_number
            deltas = "".join(e.delta for e in stored)
            assert deltas == final.output_text  # the log itself: no repeat, no gap
            assert w.tokens == final.usage.output_tokens
            w.close()
        finally:
            restarted.stop()
    finally:
        client.close()
        server.stop()


# -- a real kernel, restarted under a watcher ---------------------------------------------------


def run_in_kernel(kc: Any, code: str, timeout: float = 60) -> str:
    out: list[str] = []

    def output(msg: dict) -> None:
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("\n".join(msg["content"]["traceback"]))

    reply = kc.execute_interactive(code, timeout=timeout, output_hook=output)
    assert reply["content"]["status"] == "ok", "".join(out)
    return "".join(out)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_new_watcher_after_a_kernel_restart_shows_the_whole_task(lmsp_data, monkeypatch):
    from jupyter_client.manager import start_new_kernel

    server = ServerProcess(lmsp_data, engine_token_delay=0.03).start()
    monkeypatch.setenv("LMSP_URL", server.url)
    monkeypatch.setenv("LMSP_TOKEN", TOKEN)
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        out = run_in_kernel(
            kc,
            "import time\n"
            "from jupyter_lmsp.client import connect\n"
            "from jupyter_lmsp.widgets import TaskWatcher\n"
            "lmsp = connect()\n"
            "job = lmsp.start_response('Hello', max_output_tokens=120, temperature=0)\n"
            "w = TaskWatcher(job)\n"
            "while w.last_sequence_number < 10: time.sleep(0.02)\n"
            "print('TASK', job.task_id, w.state)\n",
        )
        task_id = out.split("TASK ")[1].split()[0]
        assert out.split()[-1] == "running"
        km.restart_kernel(now=True)
        kc.wait_for_ready(timeout=60)
        out = run_in_kernel(
            kc,
            "from jupyter_lmsp.widgets import TaskWatcher\n"
            f"w = TaskWatcher({task_id!r}).wait(90)\n"
            "print(w.state, w.last_sequence_number, repr(w.text))\n",
            timeout=120,
        )
        with Client(server.url, TOKEN) as client:
            task = client.get_task(task_id)
            text = task.response().output_text
        assert out.strip() == f"completed {task.last_sequence_number} {text!r}"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        server.stop()
