"""Counting a prompt's tokens in the server process, exactly as the inference worker will.

A request must be checked against its model's context window before it is accepted (400
`context_length_exceeded`), and its output limit capped at what the window leaves; that needs
the prompt's token count at request time. The worker would know it only once the job reaches
it. So the server loads the model's tokenizer the way the worker does (`mlx_lm`'s tokenizer
loader, with the model's `eos_token_id`) and renders the prompt with the worker's own
`encode_chat`: the count is the worker's `input_tokens`, not an estimate.

Calls block (loading a tokenizer, rendering and encoding a long prompt): run them off the
event loop (`services.budget` does, on one thread of its own). Tokenizers are kept per model
key, the least recently used dropped first.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from .callformats import FAMILIES, family_name
from .chat_prompt import JobError, encode_chat
from .grammars import GENERIC, CallFormat, ToolSpec
from .harmony import harmony_format, is_harmony
from .reasoning import effort_args
from .toolcalls import call_format_for, render

# config.json keys that hold a model's context window, in the order they are trusted.
WINDOW_KEYS = (
    "max_position_embeddings",
    "n_ctx",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
)
MAX_TOKENIZERS = 4


class PromptTooHard(Exception):
    """The prompt cannot be counted here (no tokenizer, a template that fails); the worker
    will report why when it runs it."""


class PromptCounter:
    def __init__(self, max_tokenizers: int = MAX_TOKENIZERS) -> None:
        self._tokenizers: OrderedDict[str, Any] = OrderedDict()
        self._max = max_tokenizers
        self._lock = threading.Lock()
        # Held while a tokenizer loads: a count that comes while the start-up warm-up (a thread
        # of its own) loads the same tokenizer waits for it rather than load a second copy.
        self._loading = threading.Lock()

    def count(
        self,
        key: str,
        model_path: str,
        messages: list[dict[str, Any]],
        tools: ToolSpec | None = None,
        effort: str | None = None,
    ) -> int:
        """The number of tokens of `messages` rendered for the model at `model_path`, with
        `tools` (and any past calls and results) rendered as the worker renders them
        (`toolcalls.render`, in the model's own call format where it has one), and the
        template's switch for a reasoning `effort` (`reasoning.effort_args`: an effort the
        model cannot take raises its `EffortRefused`)."""
        tokenizer = self._tokenizer(key, Path(model_path))
        thinking_args = effort_args(tokenizer, effort)
        call_format = _call_format(tokenizer, tools)
        rendered, template_args = render(messages, tools, call_format)
        try:
            return len(encode_chat(tokenizer, rendered, **template_args, **thinking_args))
        except JobError as e:
            raise PromptTooHard(e.message) from e

    def warm(self, key: str, model_path: str) -> None:
        """Load the model's tokenizer now (at start-up, so no request waits for it)."""
        with contextlib.suppress(PromptTooHard):
            self._tokenizer(key, Path(model_path))

    def _tokenizer(self, key: str, path: Path) -> Any:
        found = self._loaded(key)
        if found is not None:
            return found
        with self._loading:
            found = self._loaded(key)
            if found is not None:
                return found
            try:
                from mlx_lm.utils import load_tokenizer

                config = json.loads((path / "config.json").read_text())
                tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
            except Exception as e:  # no tokenizer files, a broken config: not countable here
                raise PromptTooHard(f"{type(e).__name__}: {e}") from e
            with self._lock:
                self._tokenizers[key] = tokenizer
                while len(self._tokenizers) > self._max:
                    self._tokenizers.popitem(last=False)
        return tokenizer

    def _loaded(self, key: str) -> Any:
        with self._lock:
            found = self._tokenizers.get(key)
            if found is not None:
                self._tokenizers.move_to_end(key)
            return found


def _call_format(tokenizer: Any, tools: ToolSpec | None) -> CallFormat:
    """The worker's choice of call format (`worker.call_format_of`), markers as text: whether
    they are special tokens matters to the grammar's tokens only, not to the prompt."""
    if is_harmony(tokenizer):
        return harmony_format()
    if tools is None or not tools.active:
        return GENERIC
    parser = (getattr(tokenizer, "init_kwargs", None) or {}).get("tool_parser_type")
    if parser in FAMILIES:
        parser = family_name(parser, getattr(tokenizer, "chat_template", None))
    return call_format_for(parser, tools=tools)


def context_window(model_path: str) -> int | None:
    """The model's context window from its config.json, if it states one (read again only
    when the file changes: every create asks)."""
    path = Path(model_path) / "config.json"
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return _window_of(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=32)
def _window_of(config_path: str, _mtime_ns: int, _size: int) -> int | None:
    try:
        config = json.loads(Path(config_path).read_text())
    except (OSError, ValueError):
        return None
    for source in (config, config.get("text_config") or {}):
        for name in WINDOW_KEYS:
            value = source.get(name)
            if isinstance(value, int) and value > 0:
                return value
    return None
