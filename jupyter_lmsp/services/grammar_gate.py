"""Admission's grammar check, with a budget (issue 43; docs/security.md, "Grammars").

A request's response format and tools are first counted against `engine.schema_limits`
(cheap, on admission's thread: `generation.check`). What passes is compiled here, with the
model's own tokenizer, in one of `processes` child processes (`engine.grammar_check`), each
killed at `deadline` seconds: a schema that takes longer is a 400 naming the limit
`compile_seconds`. One caller's checks run one at a time, so a caller sending grammar bombs
holds at most one child and everyone else's requests (with or without grammars) go on.
Answers are kept by a hash of the model and what was compiled, so a repeated schema (an agent
sends the same tools every turn) is compiled once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import pickle
import queue
from collections import OrderedDict

from ..engine.grammar_check import CheckRequest, CheckResult, CompileTimeout, GrammarChecker
from ..engine.grammars import GrammarIssue, ResponseFormat, ToolSpec

log = logging.getLogger(__name__)

# Seconds a grammar may take to compile with the model's tokenizer. The largest schemas the
# counted limits let through compiled in ~0.1-1 s here (2 CPUs); a loaded machine doubles it.
COMPILE_SECONDS = 5.0
CACHED = 512


class GrammarGate:
    def __init__(self, *, deadline: float = COMPILE_SECONDS, processes: int = 2) -> None:
        self.deadline = deadline
        self._checkers: queue.SimpleQueue[GrammarChecker] = queue.SimpleQueue()
        self._all = [GrammarChecker() for _ in range(processes)]
        for checker in self._all:
            self._checkers.put(checker)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            processes, thread_name_prefix="lmsp-grammar-check"
        )
        # Each caller's lock, with how many of its requests hold or wait for it.
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._answers: OrderedDict[bytes, CheckResult] = OrderedDict()

    @property
    def kills(self) -> int:
        """How many compiles were killed at their deadline."""
        return sum(checker.kills for checker in self._all)

    async def check(
        self,
        caller_id: str,
        model_key: str,
        model_path: str,
        fmt: ResponseFormat | None,
        tools: ToolSpec | None,
    ) -> CheckResult:
        """Where `fmt` and `tools` fail to compile for the model (`CheckResult.part` None: they
        compile, or there is nothing to compile)."""
        if fmt is None and (tools is None or not (tools.tools or tools.customs)):
            return CheckResult()
        request = CheckRequest(model_path, fmt, tools)
        key = hashlib.sha256(model_key.encode() + pickle.dumps((fmt, tools))).digest()
        found = self._answers.get(key)
        if found is not None:
            self._answers.move_to_end(key)
            return found
        lock, users = self._locks.get(caller_id, (asyncio.Lock(), 0))
        self._locks[caller_id] = (lock, users + 1)
        try:
            async with lock:
                found = self._answers.get(key)
                if found is None:
                    loop = asyncio.get_running_loop()
                    found = await loop.run_in_executor(self._executor, self._run, request)
                    self._remember(key, found)
        finally:
            lock, users = self._locks[caller_id]
            if users <= 1:
                del self._locks[caller_id]
            else:
                self._locks[caller_id] = (lock, users - 1)
        return found

    def _run(self, request: CheckRequest) -> CheckResult:
        checker = self._checkers.get()
        try:
            return checker.check(request, self.deadline)
        except CompileTimeout:
            part = "format" if request.response_format is not None else "tools"
            return CheckResult(
                part,
                GrammarIssue(
                    f"the schema exceeds the limit 'compile_seconds': its grammar did not "
                    f"compile within {self.deadline:g} s"
                ),
            )
        except (RuntimeError, OSError) as exc:
            # The checker itself failed (a tokenizer it cannot load): the worker builds the
            # grammar again and fails the job with `grammar_invalid` if it must.
            log.warning("grammar check failed: %s", exc)
            return CheckResult()
        finally:
            self._checkers.put(checker)

    def _remember(self, key: bytes, answer: CheckResult) -> None:
        self._answers[key] = answer
        while len(self._answers) > CACHED:
            self._answers.popitem(last=False)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        for checker in self._all:
            checker.close()
