"""A response to create, as both APIs describe it (`ResponseSpec`): its conversation, how to
sample, what the generation asks for and what the response object echoes; `spec_of` reads a
`POST /responses` body into one (services.chat reads a chat completion's), and `stored_request`
is what a response stores of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..protocol.responses import CreateResponseRequest
from ..protocol.states import RestartPolicy
from .generation import Generation


@dataclass
class ResponseSpec:
    """A response to create, from either API: its input as chat messages (`conversation`),
    how to sample, what the generation asks for (`generation`), and what the response object
    echoes of the request besides (`echo`: `tools`, `tool_choice`, `text_format`, …)."""

    messages: list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    background: bool = False
    store: bool = True
    previous_response_id: str | None = None
    # The conversation the response belongs to (its items come before the input).
    conversation_id: str | None = None
    # "auto": drop the oldest messages before the input when the prompt does not fit.
    truncation: str = "disabled"
    metadata: dict[str, str] | None = None
    on_restart: RestartPolicy = RestartPolicy.FAIL
    generation: Generation = field(default_factory=Generation)
    # The queue tier asked for: "priority" or "flex" (None: the default).
    service_tier: str | None = None
    echo: dict[str, Any] = field(default_factory=dict)
    # The request's `prompt_cache_key`: the task's `cache_key`, which standalone workers'
    # claims route by (`rules.claim_tasks`).
    cache_key: str | None = None
    # The request's names for the input and the output limit, in errors.
    input_param: str = "input"
    output_param: str = "max_output_tokens"


def spec_of(request: CreateResponseRequest) -> ResponseSpec:
    """A `POST /responses` body as a `ResponseSpec`."""
    fmt = request.format_spec()
    tools = request.tools_spec()
    echo: dict[str, Any] = {}
    if request.tools:
        echo["tools"] = [tool.echo() for tool in request.tools]
        if namespaces := request.namespaces():
            echo["namespaces"] = namespaces
    if request.tool_choice is not None:
        choice = request.tool_choice
        echo["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump()
    if request.parallel_tool_calls is not None:
        echo["parallel_tool_calls"] = request.parallel_tool_calls
    if request.max_tool_calls is not None:
        echo["max_tool_calls"] = request.max_tool_calls
    if fmt is not None:
        echo["text_format"] = fmt.responses_wire()
    if request.top_logprobs is not None:
        echo["top_logprobs"] = request.top_logprobs
    if request.stop is not None:
        echo["stop"] = request.stop_sequences()
    if request.text is not None and request.text.verbosity is not None:
        echo["verbosity"] = request.text.verbosity
    if request.truncation == "auto":
        echo["truncation"] = "auto"
    tier = request.service_tier if request.service_tier in ("priority", "flex") else None
    if request.include and "reasoning.encrypted_content" in request.include:
        # Reasoning items go out with their thinking sealed (`services.summaries`).
        echo["seal_reasoning"] = True
    if request.reasoning is not None:
        summary = request.reasoning.summary or request.reasoning.generate_summary
        echo["reasoning"] = {"effort": request.reasoning.effort, "summary": summary}
    # Stored with the response; all but client_metadata are echoed (as OpenAI does).
    for label in ("user", "safety_identifier", "prompt_cache_key", "client_metadata"):
        if (value := getattr(request, label)) is not None:
            echo[label] = value
    return ResponseSpec(
        messages=request.messages(),
        model=request.model,
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        stream=bool(request.stream),
        background=bool(request.background),
        store=request.stored,
        previous_response_id=request.previous_response_id,
        conversation_id=request.conversation_id,
        truncation=request.truncation or "disabled",
        metadata=request.metadata,
        on_restart=request.restart_policy,
        generation=Generation(
            stop=request.stop_sequences(),
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs or 0,
            format=fmt,
            tools=tools,
            effort=request.reasoning.effort if request.reasoning is not None else None,
            max_reasoning_tokens=request.max_reasoning_tokens,
            keep_alive=request.keep_alive,
        ),
        service_tier=tier,
        echo=echo,
        cache_key=request.prompt_cache_key,
    )


def stored_request(spec: ResponseSpec, seed: int) -> dict[str, Any]:
    """What the response object echoes back, and what the task needs to run again (its
    conversation is stored beside, see `services.conversation`)."""
    return {
        "instructions": spec.instructions,
        "max_output_tokens": spec.max_output_tokens,
        "temperature": 1.0 if spec.temperature is None else spec.temperature,
        "top_p": 1.0 if spec.top_p is None else spec.top_p,
        "presence_penalty": spec.presence_penalty or 0.0,
        "frequency_penalty": spec.frequency_penalty or 0.0,
        "seed": seed,
        "stream": spec.stream,
        "background": spec.background,
        "metadata": spec.metadata or {},
        **({"service_tier": spec.service_tier} if spec.service_tier else {}),
        **spec.echo,
    }
