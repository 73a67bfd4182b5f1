"""Admission: what a new task may cost, checked before it is accepted (docs/security.md).

- The prompt is counted with the model's own tokenizer and template (`engine.tokens`), off
  the event loop on one thread of its own; a prompt that leaves no room in the model's
  context window (`max_context_tokens` may narrow it) is refused with 400
  `context_length_exceeded`, and the output limit is capped at what the window leaves.
  Without a limit asked for, the limit is what the window leaves (as OpenAI has it), or the
  owner's `max_output_tokens_default` when set (above 0).
- A paired client may have at most `max_tasks` unfinished tasks and `max_tokens` tokens in
  flight (prompt plus output limit, summed over its unfinished tasks); beyond either, 429
  with `Retry-After`. The check runs inside the transaction that creates the task, so
  concurrent requests cannot overshoot. The clients a client approved (with `clients:admin`),
  and theirs, share its quota (`store.quotas`). The same tree may keep at most
  `max_stored` characters of finished tasks' events and output (0: no limit); at or beyond
  it a new task is 403 `storage_quota_exceeded` until responses are deleted or expire. The
  owner (the Jupyter user) has no quota.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from ..auth.scopes import Caller
from ..engine.grammar_check import CheckResult
from ..engine.grammars import ResponseFormat, ToolSpec
from ..engine.reasoning import EffortRefused
from ..engine.tokens import PromptCounter, PromptTooHard, context_window
from ..protocol.errors import LMSPError
from ..store import quotas
from ..store.quotas import Connection
from ..store.tables import Model
from .grammar_gate import GrammarGate

P = ParamSpec("P")
T = TypeVar("T")

# How long a client over its quota is told to wait: its tasks finish in seconds to minutes.
RETRY_AFTER = 5
# The output limit of a request that asks for none, for a model whose context window is
# unknown (no `max_position_embeddings`) when the owner set no default.
UNKNOWN_WINDOW_OUTPUT = 1024


@dataclass
class Plan:
    """What a generation was granted: its prompt's token count (None if it could not be
    counted here), its output limit, and the tokens it holds while unfinished."""

    prompt_tokens: int | None
    max_tokens: int
    budget: int


class Admission:
    def __init__(
        self,
        *,
        max_output_tokens_default: int = 0,
        max_context_tokens: int = 0,
        max_tasks: int = 64,
        max_tokens: int = 131072,
        max_stored: int = 0,
        grammars: GrammarGate | None = None,
    ) -> None:
        self.max_output_tokens_default = max_output_tokens_default
        self.max_context_tokens = max_context_tokens
        self.max_tasks = max_tasks
        self.max_tokens = max_tokens
        self.max_stored = max_stored
        self.counter = PromptCounter()
        # Grammars compiled with the model's tokenizer under a deadline (issue 43).
        self.grammars = grammars if grammars is not None else GrammarGate()
        # One thread: counting is CPU work, and queued behind each other requests cannot
        # take more than one core from the server between them.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="lmsp-prompt-tokens"
        )

    def window(self, model: Model) -> int | None:
        """The context window requests for `model` are held to."""
        own = context_window(model.path)
        if self.max_context_tokens > 0:
            return min(own, self.max_context_tokens) if own else self.max_context_tokens
        return own

    def warm(self, model: Model) -> None:
        """Load `model`'s tokenizer in the background, so the first request does not wait."""
        # On a daemon thread, not the executor: the interpreter joins an executor's threads at
        # exit, so a server stopped during the warm-up (importing transformers and loading the
        # tokenizer: seconds of CPU) waited for it to end. A count that comes meanwhile waits
        # for the same load (`PromptCounter` loads one tokenizer at a time).
        threading.Thread(
            target=self.counter.warm,
            args=(_key(model), model.path),
            name="lmsp-tokenizer-warm-up",
            daemon=True,
        ).start()

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn` on admission's own thread (CPU work at request time: counting a prompt,
        compiling a grammar to check it), awaited from the loop."""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(fn, *args, **kwargs)
        )

    async def check_grammar(
        self,
        caller: Caller,
        model: Model,
        fmt: ResponseFormat | None,
        tools: ToolSpec | None,
    ) -> CheckResult:
        """Where a request's format and tools fail to compile for `model` (part None: they
        do), in a child process killed at the gate's deadline (`services.grammar_gate`)."""
        return await self.grammars.check(caller.id, _key(model), str(model.path), fmt, tools)

    async def count(
        self,
        model: Model,
        messages: list[dict[str, Any]],
        tools: ToolSpec | None = None,
        *,
        strict: bool = False,
        effort: str | None = None,
        effort_param: str = "reasoning.effort",
    ) -> int | None:
        """The prompt's tokens as the worker will render it (with the template's switch for a
        reasoning `effort`): None if it cannot be counted here (the worker then counts it), or
        with `strict` a 400 `prompt_not_countable` that says why. An effort the model cannot
        take is a 400 `unsupported_parameter` naming those it can (`effort_param`)."""
        try:
            return await self.run(
                self.counter.count, _key(model), model.path, messages, tools, effort
            )
        except EffortRefused as e:
            raise LMSPError(
                400,
                # OpenAI's code for an effort a model does not take.
                "unsupported_parameter",
                f"The model '{model.id}' does not reason apart from its answer (it has no "
                f"thinking markers, and its chat template no reasoning_effort): "
                f"'{effort_param}' can be {' or '.join(repr(a) for a in e.allowed)}, "
                f"not {e.effort!r}.",
                param=effort_param,
            ) from e
        except PromptTooHard as e:
            if strict:
                raise LMSPError(
                    400,
                    "prompt_not_countable",
                    f"The prompt cannot be rendered and counted for the model '{model.id}': {e}",
                    param="input",
                ) from e
            return None

    async def plan(
        self,
        model: Model,
        messages: list[dict[str, Any]],
        requested: int | None,
        param: str = "input",
        *,
        tools: ToolSpec | None = None,
        choices: int = 1,
        effort: str | None = None,
        effort_param: str = "reasoning.effort",
    ) -> Plan:
        """The output limit and quota budget of a generation: its prompt (with its `tools`
        rendered in, as the worker renders them) counted, and `choices` answers of up to the
        output limit each."""
        window = self.window(model)
        prompt = await self.count(model, messages, tools, effort=effort, effort_param=effort_param)
        # No limit asked for: the owner's default when set, else what the window leaves.
        wanted = requested or self.max_output_tokens_default or None
        if window is None:
            max_tokens = wanted or UNKNOWN_WINDOW_OUTPUT
        elif prompt is None:
            max_tokens = min(wanted or window, window)
        else:
            if prompt >= window:
                raise LMSPError(
                    400,
                    "context_length_exceeded",
                    f"The prompt has {prompt} tokens, and the model's context window is "
                    f"{window}: at least one must be left for the answer. Shorten the input.",
                    param=param,
                )
            max_tokens = min(wanted or window, window - prompt)
        # Uncounted, a prompt is charged its length in UTF-8 bytes (no token is shorter).
        charged = prompt if prompt is not None else _bytes(messages)
        if wanted is None:
            # A limit nobody asked for stays within what a client may hold in flight, so a
            # request without one is never refused for the size of its own default.
            room = (self.max_tokens - charged) // max(1, choices)
            max_tokens = max(1, min(max_tokens, room))
        return Plan(prompt, max_tokens, charged + max_tokens * max(1, choices))

    def quota(
        self, caller: Caller, budget: int, output_param: str = "max_output_tokens"
    ) -> Callable[[Connection], None] | None:
        """The check `rules.create_task` runs in its transaction for a task of `caller` that
        holds `budget` tokens; None for the owner."""
        if caller.is_owner:
            return None
        if budget > self.max_tokens:
            raise LMSPError(
                400,
                "quota_exceeded",
                f"This request needs {budget} tokens (prompt and output limit), more than a "
                f"client may have in flight ({self.max_tokens}); lower '{output_param}'.",
                param=output_param,
            )
        max_tasks, max_tokens, max_stored = self.max_tasks, self.max_tokens, self.max_stored

        def check(conn: Connection) -> None:
            # Counted in the creating transaction, under the owner's quota lock (see
            # store.quotas): concurrent creates cannot both pass on the same count.
            used = quotas.usage(conn, caller.id, stored=max_stored > 0)
            tasks, tokens = used.held
            if tasks >= max_tasks:
                raise _too_many(
                    "too_many_tasks",
                    f"This client and the clients approved with it already have {tasks} "
                    "unfinished tasks, their shared limit; wait for some to finish (or cancel "
                    "them).",
                )
            if tokens + budget > max_tokens:
                raise _too_many(
                    "too_many_tokens_in_flight",
                    f"The unfinished tasks of this client and the clients approved with it "
                    f"hold {tokens} tokens; this one needs {budget} more, beyond their shared "
                    f"limit of {max_tokens}.",
                )
            if used.stored is not None and (kept := used.stored) >= max_stored:
                raise LMSPError(
                    403,
                    "storage_quota_exceeded",
                    f"This client and the clients approved with it keep {kept} bytes of "
                    f"finished responses and their events, their limit being {max_stored}; "
                    "delete some responses (DELETE /responses/{id}) or wait for them to expire.",
                    type="insufficient_quota",
                )

        return check

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.grammars.close()


def _too_many(code: str, message: str) -> LMSPError:
    return LMSPError(
        429,
        code,
        message,
        type="rate_limit_error",
        headers={"Retry-After": str(RETRY_AFTER)},
    )


def _key(model: Model) -> str:
    return f"{model.path}\0{model.digest}"


def _bytes(messages: list[dict[str, Any]]) -> int:
    return len(json.dumps(messages, ensure_ascii=False).encode())
