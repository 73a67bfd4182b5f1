"""Compiling a request's grammar at admission, in a process that is killed at a deadline.

A schema that passes the counted limits (`schema_limits`) can still take seconds to compile;
llguidance's compiler runs in native code that nothing in the server can interrupt. So the
check that used to run on admission's thread (`grammars.check_response_format` /
`check_tools`: compile without a tokenizer, and find the failing place) and the build of the
real matcher with the model's own tokenizer, with its first token mask, run here, in a
*spawn*-context child process (`GrammarChecker`). The server waits for the answer up to
`deadline` seconds; past it the child is killed (and started again for the next request), and
the request is refused with the limit `compile_seconds`. What fails only with the model's
tokenizer (a lexer over its limits, a row of the grammar too wide) is thus a 400 at request
time, not a failed task later. The real matcher is the one in the model's own tool-call format
(`worker.call_format_of`: a family of `callformats`, or harmony), where the tools are also
compiled the way that format compiles them (`formatcheck.check_in_format`: a parameter's
schema alone), so a schema only the family's grammar refuses is a 400 naming the parameter.

The child keeps llguidance's view of up to `MAX_TOKENIZERS` models' tokenizers (loaded the way
the worker loads them). Blocking calls: the services run them on threads of their own.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .formatcheck import check_in_format
from .grammars import (
    GENERIC,
    CallFormat,
    GrammarIssue,
    ResponseFormat,
    ToolSpec,
    build_grammar,
    check_response_format,
    check_tools,
)
from .spawn import start_without_main

MAX_TOKENIZERS = 4


@dataclass(frozen=True)
class CheckRequest:
    """What to check: a response format and tools, for the model at `model_path`."""

    model_path: str
    response_format: ResponseFormat | None
    tools: ToolSpec | None


@dataclass(frozen=True)
class CheckResult:
    """Where the check failed: `part` is "format" or "tools", `issue` as the grammars module
    gives it. `part` None: all compiled."""

    part: str | None = None
    issue: GrammarIssue | None = None


class CompileTimeout(Exception):
    """The compile took longer than its deadline; the child was killed."""


def check_request(request: CheckRequest, tokenizers: _Tokenizers | None = None) -> CheckResult:
    """The check itself (what the child runs; callable in-process too)."""
    if request.response_format is not None:
        issue = check_response_format(request.response_format)
        if issue is not None:
            return CheckResult("format", issue)
    if request.tools is not None:
        issue = check_tools(request.tools)
        if issue is not None:
            return CheckResult("tools", issue)
    loaded = tokenizers.get(request.model_path) if tokenizers is not None else None
    tokenizer, call_format = None, GENERIC
    if loaded is not None:
        # The grammar the worker will build: in the model's own call format (issue 37), whose
        # grammar may refuse what the generic one takes (`formatcheck`).
        tokenizer, wrapper = loaded
        call_format = _call_format(wrapper, tokenizer, request.tools)
        if request.tools is not None:
            issue = check_in_format(request.tools, call_format)
            if issue is not None:
                return CheckResult("tools", issue)
    grammar = build_grammar(request.response_format, request.tools, call_format)
    if grammar is None or tokenizer is None:
        return CheckResult()
    reason = first_mask_error(tokenizer, grammar)
    if not reason:
        return CheckResult()
    part = "tools" if request.tools is not None and request.tools.active else "format"
    return CheckResult(part, GrammarIssue(f"with the model's tokenizer: {reason}"))


def _call_format(wrapper: Any, tokenizer: Any, tools: ToolSpec | None) -> CallFormat:
    """The call format the worker serves a job in (`worker.Worker._prepare`)."""
    from .harmony import is_harmony
    from .worker import call_format_of

    if (tools is not None and tools.active) or is_harmony(wrapper):
        return call_format_of(wrapper, tokenizer, tools)
    return GENERIC


def first_mask_error(tokenizer: Any, grammar: str) -> str:
    """Why a matcher of `grammar` with `tokenizer` fails to build or to give its first mask
    ("" if it does not)."""
    import llguidance
    import numpy as np
    from llguidance.numpy import fill_next_token_bitmask

    # Here, as numpy is: these checks run in the checking child, never in the server.
    from .constraints import parser_limits

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        return str(matcher.get_error())
    mask = np.zeros((1, (tokenizer.vocab_size + 31) // 32), dtype=np.int32)
    fill_next_token_bitmask(matcher, mask, 0)
    if matcher.is_error():
        return str(matcher.get_error())
    return ""


class _Tokenizers:
    """llguidance's view of models' tokenizers with mlx-lm's (a pair), by model path, the
    oldest dropped first; None for a model whose tokenizer cannot be loaded here (the worker
    reports why)."""

    def __init__(self) -> None:
        self._made: OrderedDict[str, Any] = OrderedDict()

    def get(self, model_path: str) -> Any:
        if model_path in self._made:
            self._made.move_to_end(model_path)
            return self._made[model_path]
        try:
            made = self._load(model_path)
        except Exception:
            made = None
        self._made[model_path] = made
        while len(self._made) > MAX_TOKENIZERS:
            self._made.popitem(last=False)
        return made

    def _load(self, model_path: str) -> Any:
        import llguidance.hf
        from mlx_lm.utils import load_tokenizer

        path = Path(model_path)
        config = json.loads((path / "config.json").read_text())
        wrapper = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
        made = llguidance.hf.from_tokenizer(
            wrapper._tokenizer,
            n_vocab=config.get("vocab_size"),
            eos_token=sorted(wrapper.eos_token_ids),
        )
        # mlx-lm's wrapper too: the model's call format is read from it.
        return made, wrapper


def _serve(conn: Connection) -> None:
    """The child's loop: a `CheckRequest` in, a `CheckResult` (or an error string) out."""
    # Compiling is admission's work for one request: it yields the CPU to the inference
    # worker and the server (2 CPUs here), so nobody's stream waits for it.
    with contextlib.suppress(OSError):
        os.nice(10)
    tokenizers = _Tokenizers()
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        try:
            answer: object = check_request(request, tokenizers)
        except Exception as exc:  # reported to the caller, never kills the child
            answer = f"{type(exc).__name__}: {exc}"
        try:
            conn.send(answer)
        except (OSError, BrokenPipeError):
            return


class GrammarChecker:
    """One child process that checks grammars one at a time (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        # Models whose tokenizer the current child has loaded (loading is not compiling: it
        # gets its own, long deadline).
        self._warm: set[str] = set()
        self.kills = 0

    def check(self, request: CheckRequest, deadline: float) -> CheckResult:
        """`request` checked in the child; `CompileTimeout` after `deadline` seconds (the
        child is then killed). A failure of the child itself is a `RuntimeError`."""
        with self._lock:
            if request.model_path not in self._warm or not self._alive():
                nothing = CheckRequest(request.model_path, ResponseFormat("json_object"), None)
                self._ask(nothing, 120.0)
                self._warm.add(request.model_path)
            return self._ask(request, deadline)

    def _ask(self, request: CheckRequest, deadline: float) -> CheckResult:
        conn = self._connection()
        conn.send(request)
        if not conn.poll(deadline):
            self.kills += 1
            self._kill()
            raise CompileTimeout(deadline)
        try:
            answer = conn.recv()
        except (EOFError, OSError) as exc:
            self._kill()
            raise RuntimeError("the grammar checker exited") from exc
        if isinstance(answer, str):
            raise RuntimeError(answer)
        assert isinstance(answer, CheckResult)
        return answer

    def _alive(self) -> bool:
        return self._process is not None and self._process.is_alive() and self._conn is not None

    def _connection(self) -> Connection:
        if self._alive():
            assert self._conn is not None
            return self._conn
        self._kill()
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(
            target=_serve, args=(child,), name="lmsp-grammar-check", daemon=True
        )
        start_without_main(process)
        child.close()
        self._process, self._conn = process, parent
        return parent

    def _kill(self) -> None:
        process, conn = self._process, self._conn
        self._process = self._conn = None
        self._warm.clear()
        if conn is not None:
            conn.close()
        if process is not None:
            if process.is_alive():
                process.kill()
            process.join(5)

    def close(self) -> None:
        with self._lock:
            self._kill()
