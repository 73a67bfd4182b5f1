"""Model families made here, for the call-format tests (issue 37): per tool-call format mlx-lm
knows, the special tokens its models' tokenizers have and a chat template written here in the
family's shape (tools listed in the system block, past calls written in the family's syntax,
results as `<tool_response>` blocks).

`family_tokenizer(name, dir)` writes a tokenizer directory (the test model's byte-level BPE plus
the family's special tokens, and its template) and loads it with mlx-lm's own loader, which
infers the tool parser from the template as it does for a real checkpoint. `family_script(name)`
is the token sequence in which a scripted model (tests/scriptedmodel.py) writes the call
`exec_command(cmd="echo scripted-hi")` in the family's format (kimi_k3's repeats tokens: a
context model, tests/contextmodel.py, writes it; tests/scriptedmodel.py writes the others).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scriptedmodel import CALL_ARGUMENTS, CALL_NAME, _tokenizer_json

from jupyter_lmsp.models.testmodel import EOS_TOKEN

# The frame every template shares: role blocks in the test model's special tokens; tools in
# the system block; a tool's result as a <tool_response> block.
_HEAD = (
    "{%- if tools %}<|system|>\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}{{ call_help }}<|end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "<|user|>\n<tool_response>\n{{ message.content }}\n</tool_response><|end|>\n"
    "{%- elif message.role == 'assistant' %}"
    "<|assistant|>\n{{ message.content or '' }}"
    "{%- if message.tool_calls %}{{ calls(message.tool_calls) }}{% endif %}<|end|>\n"
    "{%- else %}<|{{ message.role }}|>\n{{ message.content }}<|end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_VALUE = "{% if v is string %}{{ v }}{% else %}{{ v | tojson }}{% endif %}"
_FN = "{% set f = c.function if c.function is defined else c %}"

_CALLS = {
    "qwen3_coder": (
        "{% for c in tool_calls %}" + _FN + "{% if not loop.first %}{{ NL }}{% endif %}"
        "<tool_call>\n<function={{ f.name }}>{{ NL }}"
        "{% for k, v in f.arguments.items() %}<parameter={{ k }}>{{ NL }}"
        + _VALUE
        + "{{ NL }}</parameter>{{ NL }}{% endfor %}</function>{{ NL }}</tool_call>{% endfor %}"
    ),
    "glm47": (
        "{% for c in tool_calls %}" + _FN + "<tool_call>{{ f.name }}"
        "{% for k, v in f.arguments.items() %}<arg_key>{{ k }}</arg_key><arg_value>"
        + _VALUE
        + "</arg_value>{% endfor %}</tool_call>{% endfor %}"
    ),
    "longcat": (
        "{% for c in tool_calls %}" + _FN + "<longcat_tool_call>{{ f.name }}"
        "{% for k, v in f.arguments.items() %}<longcat_arg_key>{{ k }}</longcat_arg_key>"
        "<longcat_arg_value>" + _VALUE + "</longcat_arg_value>{% endfor %}"
        "</longcat_tool_call>{% endfor %}"
    ),
    "minimax_m2": (
        "<minimax:tool_call>{{ NL }}{% for c in tool_calls %}" + _FN + "{% if not loop.first %}"
        '{{ NL }}{% endif %}<invoke name="{{ f.name }}">{{ NL }}'
        "{% for k, v in f.arguments.items() %}"
        '<parameter name="{{ k }}">' + _VALUE + "</parameter>{{ NL }}{% endfor %}</invoke>"
        "{% endfor %}{{ NL }}</minimax:tool_call>"
    ),
    "minicpm5": (
        "{% for c in tool_calls %}" + _FN + '<function name="{{ f.name }}">'
        '{% for k, v in f.arguments.items() %}<param name="{{ k }}">' + _VALUE + "</param>"
        "{% endfor %}</function>{% endfor %}"
    ),
    "muse_spark": (
        "<atem:function_calls>{% for c in tool_calls %}"
        + _FN
        + '<atem:invoke name="{{ f.name }}">{% for k, v in f.arguments.items() %}'
        '<atem:parameter name="{{ k }}">{{ v | tojson }}</atem:parameter>{% endfor %}'
        "</atem:invoke>{% endfor %}</atem:function_calls>"
    ),
    "mistral": (
        "{% for c in tool_calls %}" + _FN + "[TOOL_CALLS]{{ f.name }}[ARGS]"
        "{{ f.arguments | tojson }}{% endfor %}"
    ),
    "mistral_json": (
        "[TOOL_CALLS] [{% for c in tool_calls %}" + _FN + "{% if not loop.first %}, {% endif %}"
        '{{ "{" }}"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}{{ "}" }}'
        "{% endfor %}]"
    ),
    "kimi_k2": (
        "<|tool_calls_section_begin|>{% for c in tool_calls %}" + _FN + "<|tool_call_begin|>"
        "functions.{{ f.name }}:{{ loop.index0 }}<|tool_call_argument_begin|>"
        "{{ f.arguments | tojson }}<|tool_call_end|>{% endfor %}<|tool_calls_section_end|>"
    ),
    "kimi_k3": (
        "<|open|>tools<|sep|>{% for c in tool_calls %}" + _FN + '<|open|>call tool="{{ f.name }}"'
        ' index="{{ loop.index0 }}"<|sep|>{% for k, v in f.arguments.items() %}'
        '<|open|>argument key="{{ k }}" type="{% if v is string %}string{% else %}json'
        '{% endif %}"<|sep|>' + _VALUE + "<|close|>argument<|sep|>{% endfor %}"
        "<|close|>call<|sep|>{% endfor %}<|close|>tools<|sep|>"
    ),
    "pythonic": (
        "<|tool_call_start|>[{% for c in tool_calls %}" + _FN + "{% if not loop.first %}, "
        "{% endif %}{{ f.name }}({% for k, v in f.arguments.items() %}{% if not loop.first %}"
        ", {% endif %}{{ k }}={{ v | tojson }}{% endfor %}){% endfor %}]<|tool_call_end|>"
    ),
    "gemma4": (
        "{% for c in tool_calls %}" + _FN + "<|tool_call>call:{{ f.name }}{{ '{' }}"
        "{% for k, v in f.arguments.items() %}{% if not loop.first %},{% endif %}{{ k }}:"
        '{% if v is string %}<|"|>{{ v }}<|"|>{% else %}{{ v | tojson }}{% endif %}'
        "{% endfor %}{{ '}' }}<tool_call|>{% endfor %}"
    ),
    "function_gemma": (
        "{% for c in tool_calls %}" + _FN + "<start_function_call>call:{{ f.name }}{{ '{' }}"
        "{% for k, v in f.arguments.items() %}{% if not loop.first %},{% endif %}{{ k }}:"
        "{% if v is string %}<escape>{{ v }}<escape>{% else %}{{ v | tojson }}{% endif %}"
        "{% endfor %}{{ '}' }}<end_function_call>{% endfor %}"
    ),
}

# What each template tells the model (and what mlx-lm's inference reads).
_HELP = {
    "qwen3_coder": "Call a function as <tool_call>\n<function=NAME>\n...",
    "glm47": "Call a function as <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>",
    "longcat": "Call a function as <longcat_tool_call>NAME<longcat_arg_key>K...",
    "minimax_m2": "Call functions in <minimax:tool_call> blocks.",
    "minicpm5": 'Call a function as <function name="NAME"><param name="K">V</param></function>.',
    "muse_spark": "Call functions in an <atem:function_calls> block.",
    "mistral": "Call functions as [TOOL_CALLS]NAME[ARGS]{...}.",
    "mistral_json": "Call functions as [TOOL_CALLS] [{...}].",
    "kimi_k2": "Call functions in a <|tool_calls_section_begin|> section.",
    "kimi_k3": "Call functions in a tools block.",
    "pythonic": "Call functions as <|tool_call_start|>[f(a=1)]<|tool_call_end|>.",
    "gemma4": "Call functions as <|tool_call>call:f{a:1}<tool_call|>.",
    "function_gemma": "Call functions as <start_function_call>call:f{a:1}<end_function_call>.",
}

# The family's marker tokens that are special tokens of the tokenizer made here (qwen3_coder's
# and longcat's are text, as in Qwen3-Coder's tokenizer; llguidance still takes an added token
# spelled <...> for a special one).
SPECIAL: dict[str, tuple[str, ...]] = {
    "qwen3_coder": (),
    "glm47": (
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
    ),
    "longcat": (),
    "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>"),
    "minicpm5": (),
    "muse_spark": ("<atem:function_calls>", "</atem:function_calls>"),
    "mistral": ("[TOOL_CALLS]", "[ARGS]"),
    "mistral_json": ("[TOOL_CALLS]",),
    "kimi_k2": (
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ),
    "kimi_k3": ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"),
    "pythonic": ("<|tool_call_start|>", "<|tool_call_end|>"),
    "gemma4": ("<|tool_call>", "<tool_call|>", '<|"|>'),
    "function_gemma": ("<start_function_call>", "<end_function_call>", "<escape>"),
}

FAMILIES = tuple(_CALLS)


def chat_template(family: str) -> str:
    # (Newlines next to block tags are written as {{ NL }}: HF renders with trim_blocks.)
    macro = (
        "{%- set NL = '\\n' -%}{%- macro calls(tool_calls) -%}"
        + _CALLS[family]
        + "{%- endmacro -%}"
    )
    return macro + "{%- set call_help = " + json.dumps(_HELP[family]) + " -%}" + _HEAD


# The families whose quote is a token (gemma4's `<|"|>`, function_gemma's `<escape>`) write a
# string value between two of them: tests/scriptedmodel.py cannot repeat a token, so their
# scripted call takes an integer (`COUNT_PARAMETERS`; tests/contextmodel.py could write either).
COUNT_PARAMETERS = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
}
SHELL_PARAMETERS = {
    "type": "object",
    "properties": {"cmd": {"type": "string"}},
    "required": ["cmd"],
}


@dataclass(frozen=True)
class Script:
    """A scripted first turn: the tokens (`tokens`) and their text, the tokenizer's special
    tokens (`special`: those among `tokens`, and any the tokenizer needs besides); the call's
    tool parameters and its arguments."""

    tokens: tuple[str, ...]
    special: tuple[str, ...]
    parameters: dict[str, Any] = field(default_factory=lambda: SHELL_PARAMETERS)
    arguments: dict[str, Any] = field(default_factory=lambda: dict(CALL_ARGUMENTS))

    @property
    def text(self) -> str:
        return "".join(self.tokens)


def family_script(family: str) -> Script:
    """The tokens in which a scripted model writes `exec_command(cmd=...)` in `family`'s format
    (body tokens start with a character other than `<`, which llguidance would take for a
    special token's)."""
    cmd = CALL_ARGUMENTS["cmd"]
    if family == "qwen3_coder":
        # The string value a token of its own: llguidance's token mask refuses a token in which
        # a lexeme of variable length ends and another one follows (BPE tokens are short).
        return Script(
            (
                "<tool_call>",
                f"\n<function={CALL_NAME}>\n<parameter=cmd>\n",
                cmd,
                "\n</parameter>\n</function>\n",
                "</tool_call>",
            ),
            ("<tool_call>", "</tool_call>"),
        )
    if family == "mistral":
        args = json.dumps(CALL_ARGUMENTS)
        return Script(("[TOOL_CALLS]", CALL_NAME, "[ARGS]", args), SPECIAL["mistral"])
    if family == "kimi_k2":
        return Script(
            (
                "<|tool_calls_section_begin|>",
                "<|tool_call_begin|>",
                f"functions.{CALL_NAME}:",
                "0",
                "<|tool_call_argument_begin|>",
                json.dumps(CALL_ARGUMENTS),
                "<|tool_call_end|>",
                "<|tool_calls_section_end|>",
            ),
            SPECIAL["kimi_k2"],
        )
    if family in ("glm47", "longcat"):
        tag = "longcat_" if family == "longcat" else ""
        markers = tuple(
            f"<{end}{tag}{name}>"
            for name, end in (
                ("tool_call", ""),
                ("arg_key", ""),
                ("arg_key", "/"),
                ("arg_value", ""),
                ("arg_value", "/"),
                ("tool_call", "/"),
            )
        )
        start, key, key_end, value, value_end, end = markers
        return Script((start, CALL_NAME, key, "cmd", key_end, value, cmd, value_end, end), markers)
    if family == "minimax_m2":
        return Script(
            (
                "<minimax:tool_call>",
                f'\n<invoke name="{CALL_NAME}">\n<parameter name="cmd">',
                cmd,
                "</parameter>\n</invoke>\n",
                "</minimax:tool_call>",
            ),
            SPECIAL["minimax_m2"],
        )
    if family == "minicpm5":
        # (No token both begins with `<` and ends with `>`: llguidance would take it for a
        # special token, which a grammar's text never matches.)
        return Script(
            (
                "<function name=",
                f'"{CALL_NAME}"><param name="cmd">',
                cmd,
                "</param></function",
                ">",
            ),
            (),
        )
    if family == "muse_spark":
        return Script(
            (
                "<atem:function_calls>",
                f'<atem:invoke name="{CALL_NAME}"',
                '><atem:parameter name="cmd">',
                json.dumps(cmd),
                "</atem:parameter></atem:invoke",
                ">",
                "</atem:function_calls>",
            ),
            SPECIAL["muse_spark"],
        )
    if family == "mistral_json":
        return Script(
            (
                "[TOOL_CALLS]",
                f' [{{"name": "{CALL_NAME}", "arguments": ',
                json.dumps(CALL_ARGUMENTS),
                "}]",
            ),
            SPECIAL["mistral_json"],
        )
    if family == "pythonic":
        return Script(
            (
                "<|tool_call_start|>",
                f"[{CALL_NAME}(cmd=",
                json.dumps(cmd),
                ")]",
                "<|tool_call_end|>",
            ),
            SPECIAL["pythonic"],
        )
    if family in ("gemma4", "function_gemma"):
        start, end = SPECIAL[family][:2]
        return Script(
            (start, f"call:{CALL_NAME}{{n:", "7", "}", end),
            SPECIAL[family],
            COUNT_PARAMETERS,
            {"n": 7},
        )
    if family == "kimi_k3":
        # Its markers repeat within one call (`<|open|>` three times, `<|sep|>` seven): only
        # a context model (tests/contextmodel.py) writes it. The index a token of its own, as
        # qwen3_coder's string value (a lexeme of variable length: `/[0-9]{1,4}/`).
        open_, close, sep = "<|open|>", "<|close|>", "<|sep|>"
        return Script(
            (
                open_,
                "tools",
                sep,
                open_,
                f'call tool="{CALL_NAME}" index="',
                "0",
                '"',
                sep,
                open_,
                'argument key="cmd" type="string"',
                sep,
                cmd,
                close,
                "argument",
                sep,
                close,
                "call",
                sep,
                close,
                "tools",
                sep,
            ),
            # (`<|end_of_msg|>` too, not written: mlx-lm tells an XTML vocabulary by it.)
            SPECIAL["kimi_k3"],
        )
    raise KeyError(family)


# The families a scripted model writes a call in (tests/test_family_reasoning.py): all of them,
# kimi_k3 only by a context model (its markers repeat within a call).
SCRIPTED = FAMILIES


@dataclass(frozen=True)
class Markers:
    """A family's thinking markers as its models write them: the start and end markers' tokens,
    the special tokens among them, and the tokens the vocabulary needs besides (mlx-lm finds a
    `<think>` pair there)."""

    start: tuple[str, ...]
    end: tuple[str, ...]
    special: tuple[str, ...]
    extra: tuple[str, ...]

    @property
    def text(self) -> tuple[str, str]:
        return "".join(self.start), "".join(self.end)


_THINK = Markers(("<think>",), ("</think>",), ("<think>", "</think>"), ())
# The multi-token markers mlx-lm infers from these vocabularies (`_infer_thinking`): Gemma's
# `<|channel>thought` .. `<channel|>`; an XTML vocabulary's (Kimi K3's) `<|open|>think<|sep|>`
# .. `<|close|>think<|sep|>`, whose `think` is a text token.
_NATIVE = {
    "gemma4": Markers(("<|channel>", "thought"), ("<channel|>",), ("<|channel>", "<channel|>"), ()),
    "kimi_k3": Markers(("<|open|>", "think", "<|sep|>"), ("<|close|>", "think", "<|sep|>"), (), ()),
}


def thinking_markers(family: str) -> Markers:
    """The thinking markers a scripted model of `family` writes: the family's own multi-token
    ones for gemma4 and kimi_k3, `<think>` / `</think>` for the others."""
    return _NATIVE.get(family, _THINK)


def family_tokenizer(family: str, path: Path) -> Any:
    """mlx-lm's `TokenizerWrapper` for a tokenizer of `family` written at `path`."""
    from mlx_lm.tokenizer_utils import load

    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(_tokenizer_json((), SPECIAL[family]), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": chat_template(family),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return load(path, eos_token_ids=None)


def ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's view of `tokenizer` (as the worker builds it)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(
        tokenizer._tokenizer, eos_token=sorted(tokenizer.eos_token_ids)
    )
