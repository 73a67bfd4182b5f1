"""A response task's stored `params`: how to generate, as `services.responses` and
`services.chat` write it into the task row (JSON text) when the request is accepted.

The runner reads it once, into `TaskParams`, when it claims the task (`services.claiming`);
the job it builds and the generation features it keeps come from that one parse. Only what
differs from the defaults is written (`services.generation.Generation.params`), so every
feature field has a default. Rows written before the conversation moved into the response's
`request` also hold `messages`, `context` and `input_messages`: those keys are kept
(`extra="allow"`), and `services.conversation` reads them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .tools import FormatSpec, ToolsSpec


class TaskParams(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    # OpenAI's penalties, -2..2 (0: none; rows written before they were applied have neither).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # The prompt's tokens as admission counted them (None: not countable in the server, the
    # worker counts it), and what the task holds of its caller's quota while unfinished
    # (`store.quotas` sums `budget` in SQL).
    prompt_tokens: int | None = None
    budget: int = 0
    # The queue tier asked for, "priority" or "flex" (None: the default): read again when a
    # restarted runner queues its unfinished tasks.
    service_tier: str | None = None
    stop: list[str] = Field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    # Reasoning (issue 37): the effort as asked for (None: the template's default) and the
    # thinking budget (None: none).
    reasoning_effort: str | None = None
    max_reasoning_tokens: int | None = None
    # Seconds the model stays loaded once idle after the task (None: the worker's keep-alive).
    keep_alive: float | None = None
    # `FormatSpec.to_json()` / `ToolsSpec.to_json()`.
    format: dict[str, Any] | None = None
    tools: dict[str, Any] | None = None

    @classmethod
    def load(cls, text: str) -> TaskParams:
        """Parse a task row's `params` column."""
        return cls.model_validate_json(text)

    def dump(self) -> str:
        return self.model_dump_json(exclude_defaults=True)

    def format_spec(self) -> FormatSpec | None:
        return FormatSpec.from_json(self.format) if self.format else None

    def tools_spec(self) -> ToolsSpec | None:
        return ToolsSpec.from_json(self.tools) if self.tools else None
