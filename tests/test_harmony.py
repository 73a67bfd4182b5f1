"""gpt-oss's harmony format (issue 37, engine/harmony.py): the analysis channel as reasoning,
commentary to `functions.NAME` as a call, final as the message.

In process, with a harmony tokenizer made here (tests/harmonymodel.py): the parser gives the
same events under any chunking, for the call forms gpt-oss and its template write, later
analysis as reasoning, a preamble as text; an unknown recipient or arguments that are not an
object fail loudly; the grammar lets the model open and close its analysis block freely, then
takes only the declared call (or a final message in the response format's schema).

End to end (two scripted harmony models on the families' shared server, and kill -9 and
resume): tests/test_family_reasoning.py.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from harmonymodel import (
    ANSWER,
    FINAL_SCRIPT,
    make_harmony_model,
)

from jupyter_lmsp.engine.grammars import (
    FunctionTool,
    ResponseFormat,
    ToolSpec,
    build_grammar,
)
from jupyter_lmsp.engine.harmony import HarmonyParser, ReasoningDelta, harmony_format
from jupyter_lmsp.engine.reasoning import after_thinking
from jupyter_lmsp.engine.thinking import Thinking, ThinkingSplitter
from jupyter_lmsp.engine.toolcalls import CallDone, ContentDelta, ToolCallError

pytestmark = pytest.mark.timeout(300)

FINAL_MODEL = "oss-final"
AFTER = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
BEFORE = "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
TEXTS = {
    # gpt-oss's own form after thinking, its template's form, a preamble then a call, a final
    # answer with more thinking before it.
    "after": "<|start|>assistant" + AFTER + '{"city": "Oslo", "days": 3}',
    "before": BEFORE + '{"city": "Oslo"}<|call|>',
    # The template's form as the first message (the prompt ended with `<|start|>assistant`).
    "first": BEFORE.removeprefix("<|start|>assistant") + '{"city": "Oslo"}',
    "preamble": "<|channel|>commentary<|message|>Let me look.<|end|>" + BEFORE + "{}",
    "final": "<|channel|>final<|message|>It is <b>sunny</b>.<|return|>",
    "analysis": "<|channel|>final<|message|>One.<|end|><|start|>assistant<|channel|>analysis"
    "<|message|>hmm<|end|><|start|>assistant<|channel|>final<|message|>Two.",
}


def events_of(text: str, chunks: list[str] | None = None) -> list[Any]:
    parser = HarmonyParser({"get_weather"})
    out = []
    for chunk in chunks if chunks is not None else [text]:
        out += parser.feed(chunk)
    return out + parser.finish()


def summary(events: list[Any]) -> tuple[str, str, list[tuple[str, str]]]:
    text = "".join(e.text for e in events if isinstance(e, ContentDelta))
    thought = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    return text, thought, [(e.name, e.arguments) for e in events if isinstance(e, CallDone)]


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_the_parser_reads_each_channel_under_any_chunking(name: str) -> None:
    text = TEXTS[name]
    whole = summary(events_of(text))
    expected = {
        "after": ("", "", [("get_weather", json.dumps({"city": "Oslo", "days": 3}))]),
        "before": ("", "", [("get_weather", json.dumps({"city": "Oslo"}))]),
        "first": ("", "", [("get_weather", json.dumps({"city": "Oslo"}))]),
        "preamble": ("Let me look.", "", [("get_weather", "{}")]),
        "final": ("It is <b>sunny</b>.", "", []),
        "analysis": ("One.Two.", "hmm", []),
    }[name]
    assert whole == expected
    rng = random.Random(name)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert summary(events_of(text, chunks)) == whole, chunks


def test_a_call_it_cannot_take_fails_loudly() -> None:
    with pytest.raises(ToolCallError, match="unknown tool"):
        events_of("<|channel|>commentary to=browser.search <|constrain|>json<|message|>{}")
    with pytest.raises(ToolCallError, match="unknown tool"):
        events_of("<|channel|>commentary to=functions.nope <|constrain|>json<|message|>{}")
    with pytest.raises(ToolCallError, match="not an object"):
        events_of(AFTER + "[1, 2]")
    with pytest.raises(ToolCallError, match="bad arguments"):
        events_of(AFTER + "{oops")
    # Text that begins like a header but is none is the answer's, never dropped.
    assert summary(events_of("<|b|> bold")) == ("<|b|> bold", "", [])
    # No tools: no call at all.
    parser = HarmonyParser(())
    with pytest.raises(ToolCallError):
        parser.feed(AFTER + "{}<|call|>")


@pytest.fixture(scope="module")
def harmony_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from mlx_lm.utils import load_tokenizer

    path = make_harmony_model(tmp_path_factory.mktemp("harmony-tok"), FINAL_SCRIPT)
    config = json.loads((path / "config.json").read_text())
    return load_tokenizer(path, eos_token_ids=config["eos_token_id"])


def _accepts(tokenizer: Any, grammar: str, text: str) -> bool:
    import llguidance
    import llguidance.hf
    import numpy as np

    ll = llguidance.hf.from_tokenizer(
        tokenizer._tokenizer, eos_token=sorted(tokenizer.eos_token_ids)
    )
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    eos = sorted(tokenizer.eos_token_ids)[0]
    for token in [*tokenizer.encode(text, add_special_tokens=False), eos]:
        mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
        if not (int(mask[token // 32]) >> (token % 32)) & 1:
            return False
        if token != eos and not matcher.consume_token(token):
            return False
    return not matcher.is_error()


def test_the_grammar_lets_it_think_then_takes_the_call(harmony_tokenizer: Any) -> None:
    """The model opens its analysis block itself (gpt-oss's prompt ends with
    `<|start|>assistant`), thinks freely, then must call in either form; the same text split
    and parsed gives the thinking and the call."""
    tokenizer = harmony_tokenizer
    prompt = tokenizer.encode("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    thinking = Thinking.of(tokenizer, prompt)
    assert thinking is not None and not thinking.open
    ids = {}
    for marker in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"):
        [ids[marker]] = tokenizer.encode(marker, add_special_tokens=False)
    fmt = harmony_format(tuple(ids.items()))
    weather = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    }
    spec = ToolSpec((FunctionTool("get_weather", None, weather, True),), "required")
    grammar = after_thinking(build_grammar(None, spec, fmt) or "", thinking)
    think = "<|channel|>analysis<|message|>Rain, maybe.<|end|>"
    args = '{"city": "Oslo"}'
    assert _accepts(tokenizer, grammar, think + "<|start|>assistant" + AFTER + args)
    assert _accepts(tokenizer, grammar, think + BEFORE + args)
    assert _accepts(tokenizer, grammar, AFTER + args)  # no thinking
    assert _accepts(tokenizer, grammar, BEFORE.removeprefix("<|start|>assistant") + args)
    assert not _accepts(
        tokenizer, grammar, think + AFTER.replace("get_weather", "get_wether") + args
    )
    assert not _accepts(tokenizer, grammar, think + "<|start|>assistant" + AFTER + '{"town": "x"}')
    assert not _accepts(
        tokenizer, grammar, think + "<|start|>assistant<|channel|>final<|message|>hi"
    )

    # Structured output: a final message in the schema, after free thinking.
    answer = ResponseFormat(
        "json_schema", {"type": "object", "properties": {"answer": {"type": "integer"}}}
    )
    grammar = after_thinking(build_grammar(answer, None, fmt) or "", thinking)
    assert _accepts(
        tokenizer, grammar, think + "<|start|>assistant<|channel|>final<|message|>" + ANSWER
    )
    assert not _accepts(tokenizer, grammar, "<|channel|>final<|message|>forty-two")

    # What the model wrote, split and parsed as the server does.
    text = think + "<|start|>assistant" + AFTER + args
    splitter = ThinkingSplitter(thinking)
    parser = HarmonyParser({"get_weather"})
    reasoning, events = "", []
    for i in range(0, len(text), 5):
        for kind, part in splitter.feed(text[i : i + 5]):
            if kind == "reasoning":
                reasoning += part
            else:
                events += parser.feed(part)
    for _kind, part in splitter.finish():
        events += parser.feed(part)
    events += parser.finish()
    assert reasoning == "Rain, maybe."
    assert summary(events) == ("", "", [("get_weather", args)])
