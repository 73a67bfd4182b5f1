"""Responses: creating one (a task that generates it), reading it, its input items, cancelling
and deleting it (LMSP B5).

The coroutines here are what the handlers call: their transactions run off the IOLoop
(`ServiceContext.offload`), and what acts on the loop (publishing the committed events, handing
the task to the runner) happens after the commit.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..auth.scopes import Caller
from ..protocol.errors import LMSPError, invalid, not_found, unauthenticated
from ..protocol.ids import new_id
from ..protocol.objects import input_items, response_object
from ..protocol.output import Attempt
from ..protocol.params import TaskParams
from ..protocol.response_object import InputItemList, ResponseDeleted
from ..protocol.responses import CreateResponseRequest
from ..protocol.states import TERMINAL_STATES, TaskState
from ..store import queries, rules
from ..store.quotas import Connection
from ..store.records import new_record
from ..store.tables import Model, Response, Task
from . import conversations, embeddings, generation, metrics, truncation
from .admission import Plan
from .context import ServiceContext
from .conversation import conversation_of, input_messages_of
from .fairqueue import Tier
from .follow import TaskEventStream, spec_view
from .idempotency import KeyedRequest
from .response_spec import ResponseSpec, spec_of, stored_request
from .summaries import open_compactions, seal_reasoning


async def create_response(
    ctx: ServiceContext,
    request: CreateResponseRequest | ResponseSpec,
    caller: Caller,
    keyed: KeyedRequest | None = None,
    location_prefix: str = "",
) -> dict[str, Any]:
    """Commit the response and its task (queued), hand the task to the runner, and return the
    response object as committed. The caller may answer 202 as soon as this returns.

    Before that, admission (`services.admission`): what the generation asks for must be
    enforceable (`generation.check`: a schema the grammar compiler cannot take is a 400
    pointing into it), the prompt is counted and must fit the model's context window (400
    `context_length_exceeded`, naming the input), the output limit is capped at what the
    window leaves, and a paired client must be within its quotas (429), checked in the
    transaction that creates the task.

    With an idempotency key, its result is written in the same transaction: the 202 body for a
    background response that is not streamed, otherwise a link to the response (a repeat gets
    its final form, or its events again).

    The conversation (earlier turns and this input) is stored once, in the response's
    `request`; the task's `params` hold only how to generate.
    """
    spec = spec_of(request) if isinstance(request, CreateResponseRequest) else request
    # Compaction items' summaries opened: the conversation stored and run holds them as text.
    spec.messages = open_compactions(ctx.sealer, spec.messages)
    if spec.generation.max_reasoning_tokens is None and ctx.max_reasoning_tokens is not None:
        # The owner's thinking budget (`LMSPExtension.max_reasoning_tokens`) when none is asked.
        spec.generation = dataclasses.replace(
            spec.generation, max_reasoning_tokens=ctx.max_reasoning_tokens
        )
    await ctx.admission.run(generation.check, spec.generation)
    model, context = await ctx.offload(_model_and_context, ctx, spec, caller)
    # The grammar compiled with the model's tokenizer, in a child killed at a deadline
    # (`services.grammar_gate`): what would fail at run time is a 400 now.
    compiled = await ctx.admission.check_grammar(
        caller, model, spec.generation.engine_format(), spec.generation.engine_tools()
    )
    if compiled.part is not None and compiled.issue is not None:
        generation.refuse(spec.generation, compiled.part, compiled.issue)
    # With `truncation: "auto"`, the oldest messages that do not fit are left out.
    plan, conversation, spec.messages = await truncation.fit(ctx, model, spec, context)
    admit = ctx.admission.quota(caller, plan.budget, spec.output_param)
    task_id = new_id("task")
    tier = Tier.of(spec.service_tier)
    # A free slot is taken now: the create's transaction claims the task too (see
    # `_commit_response`), and its job goes to the worker as soon as that commits.
    reserved = ctx.runner.reservations.reserve(task_id, caller.id, spec.generation.n, tier)
    admitted = _Admitted(model, conversation, plan, admit, task_id, reserved)
    try:
        committed, body = await ctx.offload(
            _commit_response, ctx, spec, caller, keyed, location_prefix, admitted
        )
    except BaseException:
        if reserved and not admitted.handed:
            # It failed before its transaction (or never ran: the server is stopping).
            ctx.runner.reservations.release(task_id)
        raise
    metrics.task_created("response", committed.task.model)
    body = _outgoing(ctx, spec.echo, body)
    if not reserved:
        ctx.runner.publish(committed)
        ctx.runner.submit(committed.task.id, caller.id, spec.generation.n, tier)
    return body


@dataclass
class _Admitted:
    """What admission decided for a new response: its model, conversation and plan, and the
    quota check its transaction runs."""

    model: Model
    conversation: list[dict[str, Any]]
    plan: Plan
    admit: Callable[[Connection], None] | None
    task_id: str
    # The runner gave the task a slot (`Reservations.reserve`): the create claims it.
    reserved: bool = False
    # The reserved task's create began (`Reservations.create`, which gives the slot back itself
    # should it fail); until then a failure leaves that to `create_response`.
    handed: bool = False


def _model_and_context(
    ctx: ServiceContext, spec: ResponseSpec, caller: Caller
) -> tuple[Model, list[dict[str, Any]]]:
    model = ctx.catalog.resolve(spec.model)
    embeddings.refuse_chat(model)
    return (
        model,
        context_before(ctx, spec.previous_response_id, caller)
        + conversation_context(ctx, spec.conversation_id, caller),
    )


def _commit_response(
    ctx: ServiceContext,
    spec: ResponseSpec,
    caller: Caller,
    keyed: KeyedRequest | None,
    location_prefix: str,
    admitted: _Admitted,
) -> tuple[rules.Committed, dict[str, Any]]:
    now = time.time()
    response_id = new_id("resp")
    task_id = admitted.task_id
    # Every response has a seed, so every run (a resumed one too) is reproducible.
    seed = spec.seed if spec.seed is not None else secrets.randbits(31)
    echoed = stored_request(spec, seed)
    stored = {
        **echoed,
        "conversation": admitted.conversation,
        "input_count": len(spec.messages),
    }
    # Records, not table models (`new_record`): what a create builds is only read after.
    response = new_record(
        Response,
        id=response_id,
        task_id=task_id,
        owner=caller.id,
        model=admitted.model.id,
        request=json.dumps(stored),
        previous_response_id=spec.previous_response_id,
        conversation_id=spec.conversation_id,
        store=spec.store,
        created_at=now,
    )
    task = new_record(
        Task,
        id=task_id,
        kind="response",
        state=TaskState.QUEUED,
        on_restart=spec.on_restart,
        owner=caller.id,
        model=admitted.model.id,
        response_id=response_id,
        # Held by this server's runner from the transaction that creates it (LMSP B12), or,
        # without a local worker, by none: a standalone worker claims it.
        runner_id=ctx.runner.holder_id,
        # What the shared queue's claims route by (standalone workers prefer their keys).
        cache_key=spec.cache_key,
        params=TaskParams(
            max_tokens=admitted.plan.max_tokens,
            temperature=echoed["temperature"],
            top_p=echoed["top_p"],
            seed=seed,
            presence_penalty=echoed["presence_penalty"],
            frequency_penalty=echoed["frequency_penalty"],
            prompt_tokens=admitted.plan.prompt_tokens,
            # What the task holds of its caller's quota while unfinished.
            budget=admitted.plan.budget,
            service_tier=spec.service_tier,
            **spec.generation.params(),
        ).dump(),
        created_at=now,
        updated_at=now,
    )
    record = None
    if keyed is not None:
        if spec.background and not spec.stream:
            body = response_object(response, task)
            record = keyed.result(
                202, body, {"Location": f"{location_prefix}/responses/{response_id}"}
            )
        else:
            record = keyed.result(None, response_id=response_id)

    def create() -> rules.Committed:
        return rules.create_task(ctx.db, task, response, idempotency=record, admit=admitted.admit)

    if not admitted.reserved:
        committed = create()
    else:
        # Claimed in the same transaction (`services.reservations`).
        admitted.handed = True
        committed = ctx.runner.reservations.create(task_id, create)
    # The body is the response its `response.created` event holds (built from the same rows
    # in the same state), not a second one built again.
    return committed, dict(committed.events[0]["response"])


def context_before(
    ctx: ServiceContext, previous_response_id: str | None, caller: Caller
) -> list[dict[str, Any]]:
    """The conversation a follow-up turn continues: the earlier turns' messages and answers
    (an answer's function calls as the assistant's `tool_calls`)."""
    if previous_response_id is None:
        return []
    found = queries.get_response(ctx.db, previous_response_id)
    if found is None or not caller.can_see(found[0].owner) or _gone(*found):
        raise not_found("response", previous_response_id, param="previous_response_id")
    response, task = found
    if TaskState(task.state) not in TERMINAL_STATES:
        raise invalid(
            f"The response '{previous_response_id}' has not finished yet.",
            param="previous_response_id",
            code="previous_response_not_finished",
        )
    context = conversation_of(response, task)
    choice_of = Attempt.load(task.snapshot).choice_of()
    output = [item for item in json.loads(response.output) if choice_of.get(item.get("id"), 0) == 0]
    context.append(answer_message(output))
    return context


def conversation_context(
    ctx: ServiceContext, conversation_id: str | None, caller: Caller
) -> list[dict[str, Any]]:
    """The items of the conversation a response belongs to, as the messages before its input
    (compaction items and sealed reasoning opened)."""
    if conversation_id is None:
        return []
    return open_compactions(ctx.sealer, conversations.history(ctx.db, conversation_id, caller))


def answer_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output (one choice's items) as the assistant message of a later turn:
    its text, its thinking (`reasoning_content`) and its function and custom tool calls."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item.get("type") == "reasoning":
            thinking = "".join(part.get("text", "") for part in item.get("content") or [])
            message["reasoning_content"] = message.get("reasoning_content", "") + thinking
        elif item.get("type") == "message":
            message["content"] += "".join(part.get("text", "") for part in item.get("content", []))
        elif item.get("type") == "function_call":
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "name": item["name"], "arguments": item["arguments"]}
            )
        elif item.get("type") == "custom_tool_call":
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "name": item["name"], "input": item["input"]}
            )
    return message


def _gone(response: Response, task: Task) -> bool:
    """A `store: false` response that has finished: it was not stored, so it cannot be
    retrieved or continued (while it runs it is as durable as any task)."""
    return not response.store and TaskState(task.state) in TERMINAL_STATES


def _find(
    ctx: ServiceContext, response_id: str, caller: Caller, *, created: bool = False
) -> tuple[Response, Task]:
    """The response and its task, if this caller may see them (others' are simply absent).
    A finished `store: false` response is absent too, except to the request that created it
    (`created`: its own answer, its stream, a keyed repeat of it)."""
    found = queries.get_response(ctx.db, response_id)
    if found is None or not caller.can_see(found[0].owner) or (not created and _gone(*found)):
        raise not_found("response", response_id)
    return found


def get_response(
    ctx: ServiceContext, response_id: str, caller: Caller, *, created: bool = False
) -> dict[str, Any]:
    response, task = _find(ctx, response_id, caller, created=created)
    return _outgoing(ctx, json.loads(response.request), response_object(response, task))


def _outgoing(ctx: ServiceContext, request: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """A response object as it leaves: its reasoning items' thinking sealed when the request
    included `reasoning.encrypted_content` (the stored object keeps the plain text)."""
    sealer = _sealer_for(ctx, request)
    if sealer is None or not body.get("output"):
        return body
    return {**body, "output": sealer(body["output"])}


def _sealer_for(
    ctx: ServiceContext, request: dict[str, Any]
) -> Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None:
    if not request.get("seal_reasoning") or ctx.sealer is None:
        return None
    sealer = ctx.sealer
    return lambda items: seal_reasoning(sealer, items)


def replay_state(ctx: ServiceContext, response_id: str, caller: Caller) -> tuple[bool, bool, bool]:
    """For a repeated keyed create: (finished, streamed, background) of the first one's
    response."""
    response, task = _find(ctx, response_id, caller, created=True)
    request = json.loads(response.request)
    return (
        TaskState(task.state) in TERMINAL_STATES,
        bool(request.get("stream")),
        bool(request.get("background")),
    )


async def cancel_response(ctx: ServiceContext, response_id: str, caller: Caller) -> dict[str, Any]:
    _, task = await ctx.offload(_find, ctx, response_id, caller)
    committed = await ctx.offload(rules.request_cancel, ctx.db, task.id)
    ctx.runner.cancelled(committed)
    assert committed.response is not None
    body = response_object(committed.response, committed.task)
    return _outgoing(ctx, json.loads(committed.response.request), body)


def delete_response(ctx: ServiceContext, response_id: str, caller: Caller) -> dict[str, Any]:
    """Delete a finished response with its task and events; an unfinished one must be
    cancelled first (its task may not be deleted while unfinished, section 11.2)."""
    _, task = _find(ctx, response_id, caller)
    if not rules.delete_finished_task(ctx.db, task.id):
        raise LMSPError(
            400,
            "response_not_finished",
            f"The response '{response_id}' is still {task.state}; cancel it before deleting it.",
        )
    return ResponseDeleted(id=response_id).wire()


def abandoned_with_its_client(request: CreateResponseRequest) -> bool:
    """Whether the response stops when the client that created it goes away before it
    finished: a streamed one that is not a background task (nobody is left to read its
    stream; Codex and curl leave that way), and a plain one that is not stored (nobody could
    ever read it). Background work goes on, and so does a plain stored response (its client
    may retrieve it later)."""
    if request.background:
        return False
    return bool(request.stream) or not request.stored


async def abandon(ctx: ServiceContext, response: dict[str, Any]) -> None:
    """Its client went away (`abandoned_with_its_client`): cancel the task, as
    `POST /responses/{id}/cancel` would; one that has finished is left as it is."""
    committed = await ctx.offload(rules.request_cancel, ctx.db, response["task_id"])
    ctx.runner.cancelled(committed)


async def discard_unstored(ctx: ServiceContext, response: dict[str, Any]) -> None:
    """Once the request that created a `store: false` response has its answer (or its stream's
    end), the response's rows go: its task, events and response. One still running (its client
    left midway) is left to finish; retention removes it then like any finished task."""
    if response.get("store") is False:
        await ctx.offload(rules.delete_finished_task, ctx.db, response["task_id"])


def list_input_items(
    ctx: ServiceContext,
    response_id: str,
    caller: Caller,
    *,
    after: str | None = None,
    limit: int = 20,
    order: str = "desc",
) -> dict[str, Any]:
    response, task = _find(ctx, response_id, caller)
    messages = input_messages_of(response, task)
    items = input_items(response.id, messages)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise invalid(f"No input item '{after}' in this response.", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return InputItemList.model_validate(
        {
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    ).wire()


async def response_events(
    ctx: ServiceContext, response_id: str, caller: Caller, after: int = -1, *, created: bool = False
) -> TaskEventStream:
    """The response's events as the OpenAI-shaped streams show them (`follow.spec_view`);
    `created` for the stream of the request that created it (see `_find`)."""
    response, task = await ctx.offload(_find, ctx, response_id, caller, created=created)
    request = json.loads(response.request)
    return TaskEventStream(
        ctx.db,
        ctx.bus,
        task.id,
        after,
        idle=ctx.keepalive_interval,
        caller=caller.id,
        offload=ctx.offload,
        view=spec_view(
            request.get("namespaces"), from_start=after < 0, seal=_sealer_for(ctx, request)
        ),
    )


async def wait_for_response(
    ctx: ServiceContext, response_id: str, caller: Caller
) -> dict[str, Any]:
    """The finished response object, once its task reached a terminal state."""
    events = await response_events(ctx, response_id, caller, created=True)
    try:
        async for _ in events:
            pass
    finally:
        await events.aclose()
    if events.revoked:
        raise unauthenticated("The access token was revoked.")
    return await ctx.offload(get_response, ctx, response_id, caller, created=True)
