"""What a generation asks of the engine beyond its prompt and sampling: stop sequences,
log-probabilities, several choices, a structured-output format and function tools (LMSP B11,
issues 14 and 15). One code path for both APIs: `services.responses` and `services.chat` turn
their requests into a `Generation`, which is checked when the request arrives (`check`: a
schema the grammar compiler cannot take is a 400 whose `param` points into it), stored in the
task's `params` (`protocol.params.TaskParams`), and made into the worker's `GenerateJob` when
the task runs (`job_for`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..engine.grammars import (
    CustomTool,
    FunctionTool,
    GrammarIssue,
    ResponseFormat,
    ToolSpec,
)
from ..engine.messages import ChoiceResume, GenerateJob
from ..engine.schema_limits import check_limits
from ..protocol.errors import LMSPError, invalid
from ..protocol.output import Attempt
from ..protocol.params import TaskParams
from ..protocol.tools import FormatSpec, ToolsSpec
from ..protocol.validation import render_path
from ..store.tables import Model, Response, Task
from .conversation import stored_messages


@dataclass(frozen=True)
class Generation:
    """A request's generation features, in the form both APIs share."""

    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    format: FormatSpec | None = None
    tools: ToolsSpec | None = None
    # Where the request put its tools' fields: Responses `tools[i].parameters`, Chat
    # `tools[i].function.parameters`.
    chat: bool = False
    # Reasoning (issue 37): the effort ("none" .. "xhigh", None: the template's default) and
    # the most tokens a choice thinks before its block is closed (None: no limit).
    effort: str | None = None
    max_reasoning_tokens: int | None = None
    # Seconds the model stays loaded once idle after this request (issue 39, Ollama's
    # `keep_alive`; None: the worker's). Not a feature of the text, but carried with them so
    # it is stored in the task's params and a restarted task's job has it too.
    keep_alive: float | None = None

    @property
    def effort_param(self) -> str:
        """Where the request put its effort."""
        return "reasoning_effort" if self.chat else "reasoning.effort"

    @property
    def calls(self) -> bool:
        """Whether the model may call a tool (a function or a custom tool)."""
        return self.tools is not None and self.tools.active

    def params(self) -> dict[str, Any]:
        """What the task's `params` hold of it (only what differs from the defaults)."""
        out: dict[str, Any] = {}
        if self.stop:
            out["stop"] = list(self.stop)
        if self.logprobs:
            out["logprobs"] = True
            out["top_logprobs"] = self.top_logprobs
        if self.n != 1:
            out["n"] = self.n
        if self.format is not None:
            out["format"] = self.format.to_json()
        if self.tools is not None:
            out["tools"] = self.tools.to_json()
        if self.effort is not None:
            out["reasoning_effort"] = self.effort
        if self.max_reasoning_tokens is not None:
            out["max_reasoning_tokens"] = self.max_reasoning_tokens
        if self.keep_alive is not None:
            out["keep_alive"] = self.keep_alive
        return out

    @classmethod
    def from_params(cls, params: TaskParams) -> Generation:
        return cls(
            stop=list(params.stop),
            logprobs=params.logprobs,
            top_logprobs=params.top_logprobs,
            n=params.n,
            format=params.format_spec(),
            tools=params.tools_spec(),
            effort=params.reasoning_effort,
            max_reasoning_tokens=params.max_reasoning_tokens,
            keep_alive=params.keep_alive,
        )

    def engine_format(self) -> ResponseFormat | None:
        if self.format is None:
            return None
        return ResponseFormat(self.format.type, self.format.schema, self.format.strict)

    def engine_tools(self) -> ToolSpec | None:
        if self.tools is None:
            return None
        return ToolSpec(
            tuple(
                FunctionTool(f.name, f.description, f.parameters, f.strict)
                for f in self.tools.functions
            ),
            self.tools.choice,
            self.tools.parallel,
            self.tools.max_calls,
            tuple(
                CustomTool(c.name, c.description, c.syntax, c.definition)
                for c in self.tools.customs
            ),
        )

    def function_names(self) -> set[str]:
        return {f.name for f in self.tools.functions} if self.tools is not None else set()

    def custom_names(self) -> set[str]:
        return {c.name for c in self.tools.customs} if self.tools is not None else set()


# The longest stop sequence taken (characters).
MAX_STOP_CHARS = 1024


def check(generation: Generation) -> None:
    """Refuse, with a 400 saying why and where, what the engine could not enforce, or what
    passes the counted limits of a schema (`engine.schema_limits`: linear in its size).

    The compile itself (llguidance, with the model's tokenizer, under a deadline) is
    `Admission.check_grammar`'s, once the model is known; its answer is raised by `refuse`.
    """
    if generation.logprobs and generation.calls:
        # The tokens of a call belong to no message: their log-probabilities would have no
        # text to go with, and would be silently left out.
        raise LMSPError(
            400,
            "unsupported_parameter",
            "Log-probabilities together with function tools are not supported; leave out "
            "'logprobs' (or 'tools').",
            param="top_logprobs" if not generation.chat else "logprobs",
        )
    for stop in generation.stop:
        if len(stop) > MAX_STOP_CHARS:
            # The worker checks the end of the text against every beginning of each stop
            # after every token: a 200,000-character stop made that quadratic (issue 43).
            raise invalid(
                f"A stop sequence may have at most {MAX_STOP_CHARS} characters; one has "
                f"{len(stop)}.",
                param="stop",
                code="invalid_value",
            )
    tools = generation.engine_tools()
    fmt = generation.engine_format()
    issue = check_limits(fmt, tools)
    if issue is not None:
        refuse(generation, "format" if issue.path[:1] == ("schema",) else "tools", issue)


def refuse(generation: Generation, part: str, issue: GrammarIssue) -> None:
    """Raise the 400 for `issue`, found in the request's response format (`part` "format")
    or its tools ("tools")."""
    if part == "format" and generation.format is not None:
        raise _schema_error(issue, _format_path(generation.format, issue))
    tools = generation.engine_tools()
    if issue.path[-1:] == ("definition",) and generation.tools and tools is not None:
        # A custom tool's grammar: its place in the request is on the tool.
        custom = generation.tools.customs[int(issue.path[1]) - len(tools.tools)]
        raise invalid(
            f"The grammar of custom tool {custom.name!r} cannot be compiled: {issue.reason}",
            param=custom.param,
            code="invalid_grammar",
        )
    raise _schema_error(issue, _tools_path(issue, chat=generation.chat))


def _format_path(fmt: FormatSpec, issue: GrammarIssue) -> str:
    # ("schema", <path in the schema>...) under `text.format` or `response_format.json_schema`.
    return render_path((*fmt.param.split("."), *issue.path))


def _tools_path(issue: GrammarIssue, *, chat: bool) -> str:
    path = issue.path
    if path[:1] == ("choice",):
        return "tool_choice"
    if path[:1] == ("max_calls",):
        return "max_tool_calls"
    if path[:1] == ("tools",) and len(path) >= 2:
        head: tuple[str | int, ...] = ("tools", path[1], "function") if chat else path[:2]
        return render_path((*head, *path[2:]))
    return "tools"


def _schema_error(issue: GrammarIssue, param: str) -> LMSPError:
    where = f" (at {issue.pointer})" if issue.path else ""
    return invalid(
        f"The grammar compiler cannot take this schema{where}: {issue.reason}",
        param=param,
        code="invalid_schema",
    )


def job_for(
    task: Task,
    response: Response,
    model: Model,
    params: TaskParams,
    generation: Generation,
    resume: bool,
) -> GenerateJob:
    """The worker's job for a response task (resumed from its snapshot when `resume`), from
    its params parsed once (`generation` is `Generation.from_params(params)`)."""
    attempt = Attempt.load(task.snapshot) if resume else Attempt({})
    points = attempt.choices(generation.n) if resume else None
    return GenerateJob(
        job_id=task.id,
        model_path=str(model.path),
        messages=stored_messages(response, task),
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        seed=params.seed,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        expected_files=json.loads(model.files) if model.files else None,
        stop=generation.stop,
        logprobs=generation.logprobs,
        top_logprobs=generation.top_logprobs,
        n=generation.n,
        resume_choices=(
            [ChoiceResume(p["token_ids"], p["text"], p["finish_reason"]) for p in points]
            if points is not None
            else None
        ),
        response_format=generation.engine_format(),
        tools=generation.engine_tools(),
        reasoning_effort=generation.effort,
        max_reasoning_tokens=generation.max_reasoning_tokens,
        keep_alive=generation.keep_alive,
    )
