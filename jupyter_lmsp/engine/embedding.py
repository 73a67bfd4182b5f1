"""Embeddings in the inference worker (issue 39): pooling, normalisation, batches of inputs.

An embedding is a model's final hidden states (after its last norm: `model.model(ids)` of an
mlx-lm model) pooled over an input's positions, truncated to `dimensions` if asked, and
scaled to unit length (as OpenAI's and Ollama's vectors are). The pooling is the one the
model's sentence-transformers configuration names (`modules.json` -> its Pooling module's
`config.json`, or `1_Pooling/config.json`): last token (Qwen3-Embedding), mean, first token
(`cls`) or max; a model without one (any causal LM) is mean-pooled, as Ollama serves
embeddings from any model. A model with a sentence-transformers configuration is an
*embedding model*: it takes `dimensions` (trained to be truncated, Matryoshka-style) and the
server refuses it chat (`is_embedding_model`, decided from its registered file names).

Inputs are right-padded into one batch: with a causal model a position attends only to those
before it, so the padding after an input changes none of its hidden states, and the last-token
and mean pooling read only its own positions.

`EmbeddingQueue` holds the inputs of every embedding job the worker took, each job's inputs
sorted by length (less padding), and computes them in chunks of at most `budget` padded
positions, the oldest job's model first and inputs of later jobs on the same model in the same
pass: requests that come together are batched together. The worker runs one chunk between two
decode steps, so a long embedding request delays generation by one chunk at a time.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

# numpy is imported where it is used: the server imports this module (`is_embedding_model`)
# and never embeds; the worker, which does, has numpy loaded already.

# Padded positions (rows x longest input) of one forward pass: while generation runs, and
# when only embeddings are waiting. On a CPU a larger pass is barely faster per token (see
# batching.DEFAULT_PREFILL_STEP), and a smaller one lets decode steps in between.
CHUNK_POSITIONS_BUSY = 256
CHUNK_POSITIONS_IDLE = 2048
POOLINGS = ("last", "mean", "cls", "max")
# Files that make a model directory a sentence-transformers (embedding) model.
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "config_sentence_transformers.json")

_MODE_KEYS = (
    ("pooling_mode_lasttoken", "last"),
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_max_tokens", "max"),
)
_MODE_NAMES = {"lasttoken": "last", "last": "last", "cls": "cls", "mean": "mean", "max": "max"}


class EmbeddingError(Exception):
    """An embedding job the worker refuses; `code` goes into its `JobFailed`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def is_embedding_model(file_names: Iterable[str]) -> bool:
    """Whether a model with these files (relative paths) is an embedding model."""
    return any(name in SENTENCE_TRANSFORMERS_FILES for name in file_names)


@dataclass(frozen=True)
class EmbeddingSpec:
    """How a model's embeddings are made: its pooling, whether it is an embedding model
    (which may be truncated to `dimensions`), its vector size and context window."""

    pooling: str
    embedding_model: bool
    size: int
    max_tokens: int


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def pooling_of(path: Path) -> tuple[str, bool]:
    """The pooling a model directory names and whether it is an embedding model."""
    embedding_model = is_embedding_model(p.name for p in path.iterdir() if p.is_file())
    modules = _read_json(path / "modules.json")
    folder = None
    if isinstance(modules, list):
        for module in modules:
            if isinstance(module, dict) and str(module.get("type", "")).endswith("Pooling"):
                # Only a folder of the model's own (a name, never a path out of it).
                folder = path / Path(str(module.get("path", ""))).name
    if folder is None and (path / "1_Pooling" / "config.json").is_file():
        folder = path / "1_Pooling"
    if folder is None:
        return "mean", embedding_model
    config = _read_json(folder / "config.json")
    if not isinstance(config, dict):
        raise EmbeddingError(
            "embedding_unsupported", "the model's pooling configuration cannot be read"
        )
    named = config.get("pooling_mode")
    if isinstance(named, str) and named in _MODE_NAMES:
        return _MODE_NAMES[named], True
    for key, mode in _MODE_KEYS:
        if config.get(key) is True:
            return mode, True
    raise EmbeddingError(
        "embedding_unsupported",
        "the model's pooling is none this service computes (last token, mean, cls, max)",
    )


def spec_of(path: Path, model: nn.Module, window: int | None) -> EmbeddingSpec:
    pooling, embedding_model = pooling_of(path)
    args = getattr(model, "args", None)
    size = int(getattr(args, "hidden_size", 0) or 0)
    return EmbeddingSpec(pooling, embedding_model, size, window or 8192)


def hidden_states(model: nn.Module, ids: mx.array) -> mx.array:
    """The model's final hidden states for a batch of token ids, [rows, positions, size]."""
    inner = getattr(model, "model", None)
    if inner is None:
        language = getattr(model, "language_model", None)
        inner = getattr(language, "model", None)
    if inner is None or not callable(inner):
        raise EmbeddingError(
            "embedding_unsupported", "this model's architecture gives no hidden states"
        )
    out: mx.array = inner(ids)
    return out


def embed_rows(model: nn.Module, rows: list[list[int]], pooling: str) -> np.ndarray:
    """One forward pass over `rows` (right-padded), pooled: [len(rows), size] float32."""
    import mlx.core as mx
    import numpy as np

    lengths = [len(row) for row in rows]
    longest = max(lengths)
    ids = np.zeros((len(rows), longest), np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    hidden = hidden_states(model, mx.array(ids)).astype(mx.float32)
    counts = mx.array(lengths)
    if pooling == "last":
        pooled = hidden[mx.arange(len(rows)), counts - 1]
    elif pooling == "cls":
        pooled = hidden[:, 0]
    else:
        inside = (mx.arange(longest)[None, :] < counts[:, None])[..., None]
        if pooling == "max":
            pooled = mx.where(inside, hidden, -mx.inf).max(axis=1)
        else:
            pooled = (hidden * inside).sum(axis=1) / counts[:, None]
    mx.eval(pooled)
    return np.array(pooled, dtype=np.float32)


def finish_vector(vector: np.ndarray, dimensions: int | None) -> np.ndarray:
    """Truncated to `dimensions` (if given) and scaled to unit length."""
    import numpy as np

    if dimensions is not None:
        vector = vector[:dimensions]
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm > 0 else vector


@dataclass
class EmbedRequest:
    """One embedding job in the queue: its inputs' tokens and the vectors computed so far."""

    job_id: str
    key: tuple[Any, ...]
    inputs: list[list[int]]
    dimensions: int | None
    # The loaded model it runs on (held until the job is done) and its pooling.
    model: Any
    pooling: str
    vectors: list[np.ndarray | None] = field(default_factory=list)
    left: int = 0
    # The rows of each pass that computed some of its inputs.
    passes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.vectors = [None] * len(self.inputs)
        self.left = len(self.inputs)

    @property
    def tokens(self) -> int:
        return sum(len(row) for row in self.inputs)

    def result(self) -> np.ndarray:
        """The finished vectors, [inputs, size] float32 (each of unit length)."""
        import numpy as np

        done = [finish_vector(v, self.dimensions) for v in self.vectors if v is not None]
        return np.stack(done).astype(np.float32)


class EmbeddingQueue:
    def __init__(self) -> None:
        self._requests: dict[str, EmbedRequest] = {}
        # (job id, input index) waiting to be computed, in the order they are taken.
        self._pending: deque[tuple[str, int]] = deque()

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def keys(self) -> set[tuple[Any, ...]]:
        """The models with embedding work in flight (never evicted meanwhile)."""
        return {request.key for request in self._requests.values()}

    def add(self, request: EmbedRequest) -> None:
        self._requests[request.job_id] = request
        order = sorted(range(len(request.inputs)), key=lambda i: len(request.inputs[i]))
        self._pending.extend((request.job_id, i) for i in order)

    def cancel(self, job_id: str) -> bool:
        if self._requests.pop(job_id, None) is None:
            return False
        self._pending = deque(item for item in self._pending if item[0] != job_id)
        return True

    def drop_all(self) -> list[str]:
        ids = list(self._requests)
        self._requests.clear()
        self._pending.clear()
        return ids

    def step(self, budget: int) -> list[EmbedRequest]:
        """Compute one chunk: the oldest waiting input's model, and as many inputs on that
        model, in queue order, as fit in `budget` padded positions (at least one). Answers the
        requests it finished."""
        head = self._requests[self._pending[0][0]]
        first = head.key
        chunk: list[tuple[str, int]] = []
        rest: deque[tuple[str, int]] = deque()
        longest = 0
        for item in self._pending:
            request = self._requests[item[0]]
            size = len(request.inputs[item[1]])
            if request.key != first or (chunk and (len(chunk) + 1) * max(longest, size) > budget):
                rest.append(item)
                continue
            chunk.append(item)
            longest = max(longest, size)
        self._pending = rest
        rows = [self._requests[job].inputs[index] for job, index in chunk]
        vectors = embed_rows(head.model, rows, head.pooling)
        for job_id in dict.fromkeys(job for job, _ in chunk):
            self._requests[job_id].passes.append(len(chunk))
        finished = []
        for (job_id, index), vector in zip(chunk, vectors, strict=True):
            request = self._requests[job_id]
            request.vectors[index] = vector
            request.left -= 1
            if request.left == 0:
                finished.append(self._requests.pop(job_id))
        return finished


def prepare(
    job_id: str,
    key: tuple[Any, ...],
    inputs: list[str | list[int]],
    dimensions: int | None,
    model: nn.Module,
    tokenizer: Any,
    specs: dict[tuple[Any, ...], EmbeddingSpec],
) -> EmbedRequest:
    """An embedding job's request for the queue: its texts encoded, every input checked
    against the model (its vocabulary, its context window) and `dimensions` against its size;
    refusals raise `EmbeddingError`. `specs` caches each model's `EmbeddingSpec`."""
    spec = specs.get(key)
    if spec is None:
        args = getattr(model, "args", None)
        window = getattr(args, "max_position_embeddings", None)
        pooling, embedding_model = pooling_of(Path(key[0]))
        size = int(getattr(args, "hidden_size", 0) or 0)
        spec = specs[key] = EmbeddingSpec(pooling, embedding_model, size, int(window or 8192))
    if dimensions is not None:
        if not spec.embedding_model and dimensions != spec.size:
            raise EmbeddingError(
                "invalid_dimensions",
                "This model's vectors cannot be shortened: 'dimensions' is taken by embedding "
                f"models only (this model's vectors have {spec.size} dimensions).",
            )
        if spec.size and not 1 <= dimensions <= spec.size:
            raise EmbeddingError(
                "invalid_dimensions",
                f"'dimensions' must be between 1 and {spec.size} for this model.",
            )
    vocab = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 0)
    rows: list[list[int]] = []
    for i, item in enumerate(inputs):
        row = list(tokenizer.encode(item)) if isinstance(item, str) else list(item)
        if not row:
            raise EmbeddingError("invalid_input", f"input {i} has no tokens.")
        if len(row) > spec.max_tokens:
            raise EmbeddingError(
                "invalid_input",
                f"input {i} has {len(row)} tokens; this model takes at most {spec.max_tokens}.",
            )
        if vocab and not all(0 <= t < vocab for t in row):
            raise EmbeddingError(
                "invalid_input",
                f"input {i} holds a token id outside this model's vocabulary (0..{vocab - 1}).",
            )
        rows.append(row)
    return EmbedRequest(job_id, key, rows, dimensions, model, spec.pooling)
