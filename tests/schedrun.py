"""Running `BatchScheduler` in the test process: jobs in, per-choice results out.

The worker process is `Worker` around the same scheduler; tests that need to look inside a
step (which tokens, how the model was called, what each update held back) drive the scheduler
directly with these helpers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jupyter_lmsp.engine.batching import BatchScheduler, Update
from jupyter_lmsp.engine.messages import GenerateJob, TokenLogprob
from jupyter_lmsp.engine.prompt_cache import PromptCache
from jupyter_lmsp.engine.speculative import SpeculationSettings
from jupyter_lmsp.engine.worker import encode_chat

# A verify step whenever any row has a proposal, as wide as the proposals go: the cost model
# says every step costs the same, and it learns nothing from timing.
FORCED = SpeculationSettings(
    verify_cost=(0.0, 0.0), sync_cost=0.0, learn_costs=False, max_rows=1 << 16
)

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tell me about the café on the corner."},
]


@dataclass
class Result:
    """One choice's output: its updates, and what they add up to."""

    updates: list[Update] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [t for u in self.updates for t in u.token_ids]

    @property
    def text(self) -> str:
        return "".join(u.text for u in self.updates)

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return [lp for u in self.updates for lp in (u.logprobs or [])]

    @property
    def end(self) -> Update | None:
        return self.updates[-1] if self.updates and self.updates[-1].final else None

    @property
    def finish_reason(self) -> str | None:
        end = self.end
        return end.finish_reason if end is not None else None


def job(job_id: str, **kwargs: Any) -> GenerateJob:
    fields: dict[str, Any] = {"model_path": "", "messages": CHAT, "max_tokens": 32}
    fields.update(kwargs)
    return GenerateJob(job_id=job_id, **fields)


def scheduler(**kwargs: Any) -> BatchScheduler:
    return BatchScheduler(PromptCache(kwargs.pop("cache_bytes", 0)), **kwargs)


def add(
    sched: BatchScheduler,
    model: Any,
    tokenizer: Any,
    results: dict[tuple[str, int], Result],
    jobs: list[GenerateJob],
    grammar: str | dict[str, str | None] | None = None,
    model_key: str = "m",
) -> None:
    """Admit `jobs`; `grammar` is every job's, or a grammar per job id."""
    for j in jobs:
        prompt = encode_chat(tokenizer, j.messages)
        mine = grammar.get(j.job_id) if isinstance(grammar, dict) else grammar
        _, updates = sched.add(j, model_key, model, tokenizer, prompt, mine)
        for i in range(j.n):
            results.setdefault((j.job_id, i), Result())
        collect(results, updates)


def collect(results: dict[tuple[str, int], Result], updates: list[Update]) -> None:
    for update in updates:
        results.setdefault((update.job_id, update.choice), Result()).updates.append(update)


def run(
    model: Any,
    tokenizer: Any,
    jobs: list[GenerateJob],
    grammar: str | dict[str, str | None] | None = None,
    sched: BatchScheduler | None = None,
) -> dict[tuple[str, int], Result]:
    """Admit `jobs` together and step until all have ended."""
    sched = sched or scheduler()
    results: dict[tuple[str, int], Result] = {}
    add(sched, model, tokenizer, results, jobs, grammar)
    while sched.active:
        collect(results, sched.step())
    return results


def run_one(model: Any, tokenizer: Any, j: GenerateJob, grammar: str | None = None) -> Result:
    return run(model, tokenizer, [j], grammar)[(j.job_id, 0)]


def streamed_text(tokenizer: Any, tokens: list[int], final: bool = False) -> str:
    """What a streaming detokenizer has completed after `tokens` (all of it when `final`)."""
    detokenizer = tokenizer.detokenizer
    for token in tokens:
        detokenizer.add_token(token)
    if final:
        detokenizer.finalize()
    return detokenizer.text
