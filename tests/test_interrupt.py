"""Abandoning a step part-way (`engine.interrupt`): a cancel that arrives during a forward
pass, when it cancels every job of the batch, stops the pass at the next checkpoint instead of
waiting for its end; the slot goes to the next job, nothing generated is lost, and what the
rows had read before the step stays in the prompt cache (and is right).

The model, the scheduler and the worker are the real ones, in this process; only when the
cancel arrives is arranged: the test's worker sends it down the real pipe from the first
checkpoint it reaches after the cancelled job has produced some tokens (or read part of its
prompt), as if the server's message had come at that moment.
"""

from __future__ import annotations

import threading
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
from schedrun import CHAT, add, collect, job, run_one, scheduler

from jupyter_lmsp.engine.interrupt import (
    Checkpoints,
    StepAbandoned,
    checkpoint_layers,
    install_checkpoints,
)
from jupyter_lmsp.engine.messages import (
    CancelJob,
    GenerateJob,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobStarted,
    JobTokens,
    Shutdown,
    SlotsWanted,
    StepTokens,
)
from jupyter_lmsp.engine.speculative import OFF
from jupyter_lmsp.engine.worker import CHECK_ALWAYS_FROM, Worker, encode_chat

LONG = [{"role": "user", "content": "Tell me everything about lighthouses. " * 40}]


@pytest.fixture()
def tiny(test_model_dir: Path) -> tuple[Any, Any]:
    """A fresh load: checkpoints installed on it must not leak into other tests' models."""
    from mlx_lm import load

    return load(str(test_model_dir))


def test_checkpoint_layers_split_the_stack_in_thirds() -> None:
    assert checkpoint_layers(30) == [9, 19]
    assert checkpoint_layers(2) == [0]
    assert checkpoint_layers(1) == []


def test_a_pass_that_goes_on_is_unchanged(tiny: tuple[Any, Any]) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = tiny
    x = mx.array([list(range(5, 45))])
    before = model(x, cache=make_prompt_cache(model))
    checkpoints = Checkpoints()
    assert install_checkpoints(model, checkpoints) == 1
    asked: list[int] = []
    checkpoints.ask = lambda: asked.append(1) is None and False
    after = model(x, cache=make_prompt_cache(model))
    assert mx.array_equal(before, after).item()  # bit for bit
    assert len(asked) == 1
    # A pass shorter than min_positions is not checked (nor evaluated early).
    checkpoints.min_positions = 41
    model(x, cache=make_prompt_cache(model))
    assert len(asked) == 1
    # Without `ask`, nothing is checked.
    checkpoints.ask, checkpoints.min_positions = None, 1
    model(x, cache=make_prompt_cache(model))
    assert len(asked) == 1
    # The parameters are the model's own, unchanged in name and number.
    assert "layers" in model.parameters()["model"]


def test_an_abandoned_pass_stops_at_its_checkpoint(tiny: tuple[Any, Any]) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = tiny
    install_checkpoints(model, Checkpoints(ask=lambda: True))
    cache = make_prompt_cache(model)
    with pytest.raises(StepAbandoned):
        model(mx.array([list(range(5, 45))]), cache=cache)
    # The first layer read the 40 positions; the second never ran.
    assert [layer.offset for layer in cache] == [40, 0]


@pytest.mark.parametrize("speculation", ["default", "off"])
@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_the_scheduler_drops_an_abandoned_step_and_keeps_what_was_read(
    tiny: tuple[Any, Any], when: str, speculation: str
) -> None:
    model, tok = tiny
    kwargs: dict[str, Any] = {"cache_bytes": 1 << 30, "prefill_step": 16}
    if speculation == "off":
        kwargs["speculation"] = OFF
    sched = scheduler(**kwargs)
    checkpoints = Checkpoints()
    install_checkpoints(model, checkpoints)
    results: dict = {}
    add(sched, model, tok, results, [job("a", messages=LONG, max_tokens=200)])
    prompt = encode_chat(tok, LONG)
    steps = 3 if when == "prefill" else len(prompt) // 16 + 6
    for _ in range(steps):
        collect(results, sched.step())
    delivered = results[("a", 0)].tokens
    assert (delivered == []) == (when == "prefill")
    checkpoints.ask = lambda: True
    with pytest.raises(StepAbandoned):
        sched.step()
    checkpoints.ask = None
    assert sched.abandon() == [("a", len(delivered))]
    assert not sched.active and sched.job_ids() == []
    # What the row had read is cached, and right: a job on the same context decodes what a
    # run without any cache decodes.
    again = GenerateJob(
        job_id="again", model_path="", messages=LONG, max_tokens=12, resume_token_ids=delivered
    )
    cached, updates = sched.add(again, "m", model, tok, prompt)
    if when == "prefill":
        assert cached == 3 * 16  # the three chunks read before the abandoned one
    else:
        assert cached == len(prompt)
    out: dict = {}
    collect(out, updates)
    while sched.active:
        collect(out, sched.step())
    reference = run_one(model, tok, again)
    assert out[("again", 0)].tokens == reference.tokens
    assert out[("again", 0)].text == reference.text


class _CancelMidPass(Worker):
    """The real worker, but the cancel of `victim` reaches the pipe while a pass is in flight:
    sent from the first checkpoint after the victim has `after_tokens` tokens (or, with -1,
    from its second prefill chunk), followed by `then` (what the server sends behind it)."""

    def __init__(
        self,
        conn: Connection,
        parent: Connection,
        victim: str,
        after_tokens: int,
        then: list[object],
    ) -> None:
        super().__init__(
            conn, max_batch_size=1, prefill_step=16, gather_window=0.0, gather_limit=0.0
        )
        self.parent, self.victim, self.after_tokens, self.then = parent, victim, after_tokens, then
        self.sent = False
        self.checks = 0

    def _abandon_requested(self) -> bool:
        running = self._running.get(self.victim)
        if running is not None and not self.sent:
            self.checks += 1
            produced = running.outboxes[0].output_tokens
            due = self.checks >= 2 if self.after_tokens < 0 else produced >= self.after_tokens
            if due:
                for message in [CancelJob(self.victim), *self.then]:
                    self.parent.send(message)
                self.sent = True
        return super()._abandon_requested()


@pytest.mark.parametrize(
    ("when", "waiting"),
    [("prefill", "worker"), ("decode", "worker"), ("decode", "server")],
)
def test_a_cancel_during_a_pass_frees_the_slot_at_the_next_checkpoint(
    test_model_dir: Path, when: str, waiting: str
) -> None:
    """The next job waits in the worker's queue (sent while the batch was full), or in the
    server's (the worker was told `SlotsWanted`; the job follows the cancel down the pipe, as
    the runner sends it)."""
    from mlx_lm import load

    model_path = str(test_model_dir)
    victim = GenerateJob("victim", model_path, LONG, max_tokens=200)
    following = GenerateJob("next", model_path, CHAT, max_tokens=12)
    first: list[object]
    if waiting == "worker":
        first, then = [victim, following], []
    else:
        first, then = [SlotsWanted(1), victim], [SlotsWanted(0), following]
    parent, child = Pipe()
    worker = _CancelMidPass(child, parent, "victim", -1 if when == "prefill" else 5, then)
    received: list[object] = []

    def server() -> None:
        """The server's side: reads everything, shuts the worker down when `next` is done
        (or when the victim was never cancelled and ended by itself: the test then fails)."""
        while True:
            message = parent.recv()
            received.extend(message.rows if isinstance(message, StepTokens) else [message])
            if isinstance(message, JobFinished | JobFailed) and (
                message.job_id == "next" or (message.job_id == "victim" and not worker.sent)
            ):
                parent.send(Shutdown())
                return

    for message in first:
        parent.send(message)
    reader = threading.Thread(target=server, daemon=True)
    reader.start()
    worker.serve()
    reader.join(10)

    assert worker.abandoned_steps == 1
    kinds = [(type(m).__name__, getattr(m, "job_id", None)) for m in received]
    cancelled = kinds.index(("JobCancelled", "victim"))
    assert kinds.index(("JobStarted", "next")) > cancelled  # the slot went to `next` after
    victim_tokens = [
        t
        for m in received
        if isinstance(m, JobTokens) and m.job_id == "victim"
        for t in m.token_ids
    ]
    end = received[cancelled]
    assert isinstance(end, JobCancelled) and end.output_tokens == len(victim_tokens)
    assert (victim_tokens == []) == (when == "prefill")
    # `next` decodes exactly what it decodes alone.
    model, tok = load(model_path)
    alone = run_one(model, tok, GenerateJob("next", "", CHAT, max_tokens=12))
    next_tokens = [
        t for m in received if isinstance(m, JobTokens) and m.job_id == "next" for t in m.token_ids
    ]
    assert next_tokens == alone.tokens
    started = [m for m in received if isinstance(m, JobStarted) and m.job_id == "victim"]
    assert started and started[0].input_tokens > 100


def test_decode_steps_are_checked_only_when_a_cancel_would_hand_over_a_slot(
    tiny: tuple[Any, Any],
) -> None:
    """Checking a decode step part-way costs it a little: it is done only while a job waits
    for a row and the batch holds one job (on this CPU backend); long passes always are."""
    model, tok = tiny
    parent, child = Pipe()
    worker = Worker(child, max_batch_size=2)
    results: dict = {}
    add(worker._scheduler, model, tok, results, [job("one", max_tokens=50)])

    def checked_from() -> int:
        worker._checkpoints_for_step()
        assert worker._checkpoints.ask is not None
        return worker._checkpoints.min_positions

    assert checked_from() == CHECK_ALWAYS_FROM  # nobody waits
    worker._handle(SlotsWanted(1))
    assert checked_from() == 1  # a task waits in the server's queue
    worker._handle(SlotsWanted(0))
    assert checked_from() == CHECK_ALWAYS_FROM
    worker._handle(GenerateJob("queued", "", CHAT, max_tokens=5))
    assert checked_from() == 1  # a job waits in the worker's queue
    add(worker._scheduler, model, tok, results, [job("two", max_tokens=50)])
    assert checked_from() == CHECK_ALWAYS_FROM  # a cancel of one would not free the batch
    worker._loader.close()  # its thread and wake-up pipe (serve() closes them when it ends)
    parent.close()


def test_the_worker_is_told_only_when_whether_any_task_waits_changes() -> None:
    """The server's side of `SlotsWanted`: a burst of creates (the queue growing one by one)
    sends one message, not one per create; emptying the queue sends the other."""
    from jupyter_lmsp.engine.client import EngineClient
    from jupyter_lmsp.engine.worker_session import WorkerSession

    client = EngineClient(lambda message: None)
    session = WorkerSession()  # not launched: what is sent stays in its outbox
    client._session = session
    for count in (1, 2, 3, 4, 3, 2, 1, 0, 0, 5, 0):
        client.tell_slots_wanted(count)
    sent = []
    while not session.outbox.empty():
        sent.append(session.outbox.get())
    assert sent == [SlotsWanted(1), SlotsWanted(0), SlotsWanted(5), SlotsWanted(0)]
    assert client.slots_wanted == 0
    client.tell_slots_wanted(7)
    assert client.slots_wanted == 7  # the count is kept for a worker started later
