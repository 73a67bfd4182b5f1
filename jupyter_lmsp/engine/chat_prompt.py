"""A job's messages as the prompt's token ids (the model's chat template), and `JobError`, the
error of a job its caller can act on.

Apart from the worker: the server counts prompts the way the worker will render them
(`tokens.PromptCounter`), and must not import the worker (numpy, MLX's batching, the model
loader) to do so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


class JobError(Exception):
    """A job failed for a reason the caller can act on; `code` goes into `JobFailed`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def encode_chat(
    tokenizer: TokenizerWrapper, messages: list[dict[str, Any]], **template_args: Any
) -> list[int]:
    """Apply the model's chat template (with the assistant prompt) and tokenize."""
    if not messages:
        raise JobError("invalid_request", "no messages to generate a reply to")
    try:
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **template_args
        )
    except Exception as exc:
        raise JobError("template_failed", f"chat template failed: {exc}") from exc
    if not isinstance(prompt, str):
        raise JobError("template_failed", "chat template did not render to text")
    # The template already holds every special token the model expects (BOS included, where
    # it has one); encoding with special tokens again would double them.
    ids: list[int] = tokenizer.encode(prompt, add_special_tokens=False)
    if not ids:
        raise JobError("invalid_request", "the prompt is empty")
    return ids
