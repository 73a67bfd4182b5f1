"""gpt-oss-shaped test models (issue 37): the scripted model (tests/scriptedmodel.py) with
harmony's special tokens, a chat template written here in gpt-oss's shape (system and
developer messages, tools as a `namespace functions`, calls as
`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>…<|call|>`, results
from `functions.NAME to=assistant`, `reasoning_effort` read) and gpt-oss's end-of-sequence tokens
(`<|return|>`, `<|call|>`; `<|end|>` only ends a message).

`make_harmony_model(dir, script, opening)`: `script` is the output (each one token; tokens may
not repeat, which is why the thinking model's generation prompt opens the analysis block
itself: `opening` follows `<|start|>assistant`), `opening` what the template adds there.
"""

from __future__ import annotations

import json
from pathlib import Path

from scriptedmodel import CALL_ARGUMENTS, CALL_NAME, make_scripted_model

from jupyter_lmsp.engine.thinking import HARMONY_MARKERS

START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN = HARMONY_MARKERS

_TEMPLATE = (
    "{%- set effort = reasoning_effort if reasoning_effort is defined else 'medium' -%}"
    "<|start|>system<|message|>You are a test model.\nReasoning: {{ effort }}\n\n"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\n\n## functions\n\n"
    "namespace functions {\n{% for t in tools %}"
    "{% set f = t.function if t.function is defined else t %}// {{ f.description }}\n"
    "type {{ f.name }} = (_: {{ f.parameters | tojson }}) => any;\n"
    "{% endfor %}} // namespace functions<|end|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}"
    "<|end|>{% endif %}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}"
    "{% set f = c.function if c.function is defined else c %}"
    "<|start|>assistant to=functions.{{ f.name }}<|channel|>commentary json<|message|>"
    "{{ f.arguments | tojson }}<|call|>{% endfor %}"
    "{%- else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}"
    "{%- elif m.role == 'tool' %}<|start|>functions.{{ m.name or 'tool' }} to=assistant"
    "<|channel|>commentary<|message|>{{ m.content | tojson }}<|end|>"
    "{%- else %}<|start|>{{ 'developer' if m.role == 'system' else m.role }}<|message|>"
    "{{ m.content }}<|end|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{{ OPENING }}{% endif %}"
)

THINKING = "I should run it"
ARGUMENTS = json.dumps(CALL_ARGUMENTS)
# Thinking (the prompt opened the analysis block), then a call: eleven distinct tokens.
CALL_SCRIPT = (
    THINKING,
    END,
    START,
    "assistant",
    CHANNEL,
    f"commentary to=functions.{CALL_NAME} ",
    CONSTRAIN,
    "json",
    MESSAGE,
    ARGUMENTS,
    CALL,
)
# The analysis block opened by the template, a newline after it (the scripted model's output
# follows from the prompt's last token, which must not be one of the script's).
OPENED = "<|channel|>analysis<|message|>\n"
ANSWER = json.dumps({"answer": 42})
# A final message straight away (no thinking), its text JSON.
FINAL_SCRIPT = (CHANNEL, "final", MESSAGE, ANSWER, RETURN)


def chat_template(opening: str) -> str:
    return "{%- set OPENING = " + json.dumps(opening) + " -%}" + _TEMPLATE


def make_harmony_model(path: Path, script: tuple[str, ...], opening: str = "") -> Path:
    """Write a harmony test model at `path` whose output is `script` (see the module
    docstring) and return `path`."""
    made = make_scripted_model(
        path, script=script, special=HARMONY_MARKERS, chat_template=chat_template(opening)
    )
    return _gpt_oss_ends(made)


def make_harmony_chain(path: Path, texts: tuple[str, ...], opening: str = "") -> Path:
    """A chain model (tests/chainmodel.py: up to 31 distinct texts, whatever the prompt) in
    gpt-oss's shape, its output `texts`."""
    from chainmodel import make_chain_model

    made = make_chain_model(
        path, texts, template=chat_template(opening), extra_tokens=HARMONY_MARKERS
    )
    return _gpt_oss_ends(made)


def _gpt_oss_ends(made: Path) -> Path:
    tokenizer = json.loads((made / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    # gpt-oss's end-of-sequence tokens, as its generation config lists them.
    config = json.loads((made / "config.json").read_text())
    config["eos_token_id"] = [ids[RETURN], ids[CALL]]
    (made / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        tokens = json.loads((made / name).read_text())
        tokens["eos_token"] = tokens["pad_token"] = RETURN
        (made / name).write_text(json.dumps(tokens))
    return made
