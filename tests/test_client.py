"""`jupyter_lmsp.client`: finding the server (explicit, environment, runtime files, the kernel's
parent), the SSE parser, error bodies, and the whole API against a real server — typed objects,
streaming, background tasks, cancel, lists, following, idempotency, the openai SDK, and the
program's side of pairing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from serverproc import TOKEN, ServerProcess, with_test_model

from jupyter_lmsp.client import (
    APIError,
    Client,
    Event,
    Response,
    ServerNotFoundError,
    Task,
    find_server,
    request_pairing,
    wait_for_pairing_token,
)
from jupyter_lmsp.client.discovery import choose_server, normalize_url
from jupyter_lmsp.client.sse import parse_sse

# -- discovery --------------------------------------------------------------------------------


@pytest.fixture
def no_env(monkeypatch):
    for name in ("LMSP_URL", "LMSP_TOKEN", "JPY_PARENT_PID"):
        monkeypatch.delenv(name, raising=False)


def write_runtime_file(folder, pid: int, port: int, token: str) -> None:
    info = {
        "url": f"http://127.0.0.1:{port}/base/",
        "token": token,
        "pid": pid,
        "root_dir": "/tmp",
        "sock": "",
    }
    (folder / f"jpserver-{pid}.json").write_text(json.dumps(info))


def test_normalize_url():
    assert normalize_url("http://h:1") == "http://h:1/"
    assert normalize_url("http://h:1/base/") == "http://h:1/base/"
    assert normalize_url("http://h:1/base/lmsp/v1/") == "http://h:1/base/"
    assert normalize_url(" http://h:1/lmsp/v1 ") == "http://h:1/"


def test_explicit_url_wins_over_environment(monkeypatch):
    monkeypatch.setenv("LMSP_URL", "http://env:1/lmsp/v1")
    monkeypatch.setenv("LMSP_TOKEN", "envtoken")
    info = find_server("http://explicit:2", "tok")
    assert (info.url, info.token, info.source) == ("http://explicit:2/", "tok", "explicit")
    info = find_server()
    assert (info.url, info.token, info.source) == ("http://env:1/", "envtoken", "environment")
    assert info.api_url == "http://env:1/lmsp/v1"


def test_runtime_file_of_the_parent_server_is_chosen(tmp_path, monkeypatch, no_env):
    # Two live servers (pids of live processes): this process and its parent.
    write_runtime_file(tmp_path, os.getpid(), 1111, "mine")
    write_runtime_file(tmp_path, os.getppid(), 2222, "parents")
    info = find_server(runtime_dirs=[str(tmp_path)])
    assert info.source == "runtime-file"
    assert (info.url, info.token, info.pid) == (
        "http://127.0.0.1:2222/base/",
        "parents",
        os.getppid(),
    )
    # jupyter_client's JPY_PARENT_PID names the server that launched a kernel.
    monkeypatch.setenv("JPY_PARENT_PID", str(os.getpid()))
    info = find_server(runtime_dirs=[str(tmp_path)])
    assert (info.token, info.pid) == ("mine", os.getpid())


def test_choose_server_rules():
    a, b = {"pid": 10, "url": "a"}, {"pid": 20, "url": "b"}
    assert choose_server([a, b], [5, 20, 1]) is b
    assert choose_server([a], [5]) is a  # the only one running
    assert choose_server([a, b], [5]) is None  # ambiguous


def test_no_server_or_ambiguous_servers_are_errors(tmp_path, no_env):
    with pytest.raises(ServerNotFoundError, match="No running Jupyter server"):
        find_server(runtime_dirs=[str(tmp_path)])
    # Two live pids, neither an ancestor of this process.
    others = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in "ab"]
    try:
        for i, p in enumerate(others):
            write_runtime_file(tmp_path, p.pid, 3000 + i, "x")
        with pytest.raises(ServerNotFoundError, match="Several Jupyter servers"):
            find_server(runtime_dirs=[str(tmp_path)])
    finally:
        for p in others:
            p.kill()
            p.wait()


# -- SSE and errors ---------------------------------------------------------------------------


def test_parse_sse():
    lines = [
        ": keep-alive",
        "",
        "id: 0",
        "event: response.created",
        'data: {"type": "response.created",',
        'data:  "sequence_number": 0}',
        "",
        "event: ignored-without-data",
        "",
        "id: 1",
        'data: {"type": "x", "sequence_number": 1}',
    ]
    msgs = list(parse_sse(lines))
    assert [(m.id, m.event) for m in msgs] == [("0", "response.created"), ("1", None)]
    assert msgs[0].json() == {"type": "response.created", "sequence_number": 0}
    assert msgs[1].json()["sequence_number"] == 1


def test_api_error_reads_the_lmsp_error_body():
    e = APIError(
        404,
        {"error": {"type": "not_found_error", "code": "not_found", "message": "No such task."}},
    )
    assert (e.status, e.code, e.type, e.message) == (
        404,
        "not_found",
        "not_found_error",
        "No such task.",
    )
    assert not e.retryable and APIError(503, "busy").retryable and APIError(429, {}).retryable
    assert "404 not_found: No such task." in str(e)


def test_objects_print_as_text_outside_a_kernel():
    r = Response.from_wire({"id": "resp_1", "status": "completed", "model": "m", "output": []})
    assert r._repr_mimebundle_() == {"text/plain": repr(r)}
    assert Event.from_wire({"type": "response.completed", "sequence_number": 3}).terminal


# -- against a real server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, test_model_dir):
    data = tmp_path_factory.mktemp("clientserver")
    with_test_model(data, test_model_dir)
    proc = ServerProcess(data, engine_token_delay=0.01).start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def lmsp(server):
    with Client(server.url, TOKEN) as client:
        yield client


slow = pytest.mark.slow  # these start a real server (module-scoped)


@slow
def test_service_and_models(lmsp):
    service = lmsp.service()
    assert service.protocol == "lmsp/1.0" and service.default_model == "tiny"
    (model,) = lmsp.models()
    assert model.id == "tiny" and model.path and lmsp.model("tiny").id == "tiny"


@slow
def test_plain_and_streamed_responses(lmsp):
    r = lmsp.create_response("Hello", max_output_tokens=8, temperature=0, metadata={"k": "v"})
    assert isinstance(r, Response) and r.finished and r.client is lmsp
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage is not None and r.usage.output_tokens <= 8 and r.metadata == {"k": "v"}
    assert r.task_id and r.refresh().output_text == r.output_text

    evs = list(lmsp.stream_response("Hello", max_output_tokens=8, temperature=0))
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    assert evs[0].type == "response.created" and evs[-1].terminal
    assert "".join(e.delta for e in evs) == evs[-1].response.output_text == r.output_text
    assert "".join(lmsp.stream_text("Hello", max_output_tokens=8, temperature=0)) == r.output_text


@slow
def test_background_task_wait_follow_and_events(lmsp):
    job = lmsp.start_response("Story", max_output_tokens=30)
    assert job.status == "queued" and job.background and job.task_id
    task = lmsp.get_task(job.task_id)
    assert isinstance(task, Task) and task.response_id == job.id
    done = job.wait(timeout=60)
    assert done.finished and done.output_text
    assert lmsp.wait(job.task_id).finished  # by task id, returns the Task

    stored = lmsp.all_events(job.task_id)
    assert [e.sequence_number for e in stored] == list(range(len(stored)))
    page = lmsp.events(job.task_id, after=2, limit=3)
    assert [e.sequence_number for e in page.data] == [3, 4, 5] and page.has_more
    tail = list(lmsp.follow(job.task_id, after=len(stored) - 3))
    assert [e.sequence_number for e in tail] == [len(stored) - 2, len(stored) - 1]


@slow
def test_cancel_and_task_lists(lmsp):
    job = lmsp.start_response("A long essay", max_output_tokens=2000)
    while lmsp.get_task(job.task_id).state == "queued":
        time.sleep(0.02)
    assert lmsp.cancel_task(job.task_id).state in ("cancelling", "cancelled")
    assert lmsp.wait(job, timeout=60).status == "cancelled"
    assert job.cancel().status == "cancelled"  # cancelling a finished one is no error

    cancelled = lmsp.tasks("cancelled")
    assert job.task_id in [t.id for t in cancelled] and {t.state for t in cancelled} == {
        "cancelled"
    }
    everything = lmsp.tasks()
    assert len(lmsp.tasks(limit=2)) == 2 and len(everything) >= 3
    assert [t.id for t in lmsp.tasks(["completed", "cancelled"])] == [
        t.id for t in everything if t.state in ("completed", "cancelled")
    ]


@slow
def test_idempotent_start_and_errors(lmsp):
    a = lmsp.start_response("Same", max_output_tokens=4, idempotency_key="client-test-1")
    b = lmsp.start_response("Same", max_output_tokens=4, idempotency_key="client-test-1")
    assert a.id == b.id
    with pytest.raises(APIError) as e:
        lmsp.get_task("task_missing")
    assert e.value.status == 404 and e.value.code
    with pytest.raises(APIError) as e:
        lmsp.create_response("x", temperature="hot")  # type: ignore[arg-type]
    assert e.value.status == 400 and e.value.param == "temperature"
    with Client(lmsp.url, "wrong") as bad, pytest.raises(APIError) as e:
        bad.service()
    assert e.value.status == 401


@slow
def test_openai_client(lmsp):
    # Closed on the way out: an open one keeps its pooled connection to the module's server
    # until the collector finds it, and the ResourceWarning then fails whichever test is
    # running (test_pairing_from_the_programs_side's teardown, once in three full runs).
    with lmsp.openai_client(max_retries=0) as oa:
        r = oa.responses.create(model="tiny", input="Hi", max_output_tokens=5, temperature=0)
    assert (
        r.output_text == lmsp.create_response("Hi", max_output_tokens=5, temperature=0).output_text
    )


@slow
def test_a_kernel_of_the_server_finds_it_by_its_runtime_file(server):
    """A process whose JPY_PARENT_PID is the server (as jupyter_client sets it for kernels) and
    that shares its runtime folder connects with no URL or token given."""
    env = {k: v for k, v in os.environ.items() if k not in ("LMSP_URL", "LMSP_TOKEN")}
    env.update(
        JUPYTER_RUNTIME_DIR=str(server.data_dir / "runtime"),
        JPY_PARENT_PID=str(server.proc.pid),
        JUPYTER_PLATFORM_DIRS="1",
    )
    code = (
        "from jupyter_lmsp.client import connect\n"
        "c = connect()\n"
        "print(c.server.source, c.service().id)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    with Client(server.url, TOKEN) as c:
        assert out.stdout.split() == ["runtime-file", c.service().id]


@slow
def test_pairing_from_the_programs_side(server, lmsp):
    request = request_pairing(server.url, "client test", ["responses:read", "responses:write"])
    assert request.user_code and request.interval >= 1
    assert request.user_code in [p.user_code for p in lmsp.pairings()]
    approved = lmsp.approve_pairing(request.user_code, scopes=["responses:read"])
    assert approved.status == "approved"
    token = wait_for_pairing_token(server.url, request, timeout=30)
    assert token.scopes == ["responses:read"]

    paired = Client.paired(server.url, token.access_token)
    with pytest.raises(APIError) as e:
        paired.create_response("Hi", max_output_tokens=2)
    assert e.value.status == 403  # narrowed to read-only
    assert token.client_id in [c.id for c in lmsp.clients()]
    lmsp.revoke_client(token.client_id)
    with pytest.raises(APIError) as e:
        paired.tasks()
    assert e.value.status == 401
    paired.close()
