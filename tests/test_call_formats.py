"""Every tool-call format mlx-lm knows (issue 37): for each family (tests/familymodels.py: a
tokenizer with the family's special tokens and a chat template in its shape), the format is
inferred as mlx-lm infers it; tools, past calls and results render through the template and the
calls the template writes parse back; the streaming parser gives the same calls whatever the
chunking; the family's grammar takes its valid calls and refuses a wrong name or an undeclared
key of a strict tool; a call that cannot be read fails loudly. Then three families end to end on
one server: a scripted model writes its call in the family's syntax and both APIs return it as
a call."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from familymodels import FAMILIES, SPECIAL, family_script, family_tokenizer, ll_tokenizer
from scriptedmodel import CALL_ARGUMENTS, CALL_NAME, make_scripted_model
from serverproc import ServerProcess

from jupyter_lmsp.engine.callformats import FAMILIES as FORMATS
from jupyter_lmsp.engine.callformats import make_parser
from jupyter_lmsp.engine.grammars import (
    GENERIC,
    CustomTool,
    FunctionTool,
    ToolSpec,
    build_grammar,
    check_tools,
)
from jupyter_lmsp.engine.toolcalls import (
    CallDone,
    ContentDelta,
    ToolCallError,
    call_format_for,
    render,
)
from jupyter_lmsp.engine.worker import call_format_of

pytestmark = pytest.mark.timeout(300)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "units": {"type": "string", "enum": ["c", "f"]},
        "opts": {"type": "object", "properties": {"hourly": {"type": "boolean"}}},
    },
    "required": ["city"],
}
TOOLS = (FunctionTool("get_weather", "The weather", WEATHER, True), FunctionTool("ping"))
NAMES = {"get_weather", "ping"}


def arguments(family: str) -> dict[str, Any]:
    args: dict[str, Any] = {"city": "Oslo", "days": 3, "units": "c"}
    if family != "function_gemma":
        # mlx-lm's function_gemma parser splits values at commas: no nested objects there.
        args["opts"] = {"hourly": True}
    return args


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("families")
    return {family: family_tokenizer(family, root / family) for family in FAMILIES}


def spec(choice: str = "auto", tools: tuple[FunctionTool, ...] = TOOLS) -> ToolSpec:
    return ToolSpec(tools, choice)


def written(tokenizer: Any, family: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """The calls as the family's template writes them (an assistant turn's text)."""
    fmt = call_format_for(family)
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"c{i}", "name": name, "arguments": json.dumps(args)}
            for i, (name, args) in enumerate(calls)
        ],
    }
    rendered, extra = render([{"role": "user", "content": "hi"}, message], spec(), fmt)
    prompt = tokenizer.apply_chat_template(rendered, tokenize=False, **extra)
    start = prompt.rindex("<|assistant|>\n") + len("<|assistant|>\n")
    return str(prompt[start : prompt.index("<|end|>", start)])


def parse(family: str, text: str, chunks: list[str] | None = None) -> tuple[str, list[CallDone]]:
    parser = make_parser(family, NAMES, (), spec())
    events = []
    for chunk in chunks if chunks is not None else [text]:
        events += parser.feed(chunk)
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return content, [e for e in events if isinstance(e, CallDone)]


def accepts(tokenizer: Any, grammar: str, text: str) -> bool:
    """Whether the token mask lets the model write `text` (as the tokenizer encodes it), then
    end. (The mask, not only `consume_tokens`: llguidance's mask can be stricter.)"""
    import llguidance
    import numpy as np

    ll = ll_tokenizer(tokenizer)
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    for token in [*tokenizer.encode(text, add_special_tokens=False), ll.eos_token]:
        mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
        if not (int(mask[token // 32]) >> (token % 32)) & 1:
            return False
        if token != ll.eos_token and not matcher.consume_token(token):
            return False
    return not matcher.is_error()


def grammar_for(tokenizer: Any, tools: ToolSpec) -> str:
    fmt = call_format_of(tokenizer, ll_tokenizer(tokenizer), tools)
    grammar = build_grammar(None, tools, fmt)
    assert grammar is not None
    return grammar


# --- formats ---------------------------------------------------------------------------------


def test_every_mlx_lm_parser_of_the_priority_list_has_a_format():
    for name in ("qwen3_coder", "mistral", "pythonic", "glm47", "kimi_k2", "minimax_m2"):
        assert name in FORMATS
    for name in (
        "function_gemma",
        "gemma4",
        "longcat",
        "laguna",
        "minicpm5",
        "muse_spark",
        "kimi_k3",
    ):
        assert name in FORMATS


@pytest.mark.parametrize("family", FAMILIES)
def test_the_format_is_inferred_as_mlx_lm_infers_it(tokenizers, family):
    tokenizer = tokenizers[family]
    parser = FORMATS[family].parser or family
    assert tokenizer.init_kwargs["tool_parser_type"] == parser
    fmt = call_format_of(tokenizer, ll_tokenizer(tokenizer), spec())
    assert fmt.name == family
    # The markers that are special tokens are named by id in the grammar.
    specials = {marker for marker, _ in fmt.marker_ids}
    assert specials == {m for m in FORMATS[family].markers if m in SPECIAL[family]}


def test_custom_tools_are_served_in_the_generic_format():
    customs = ToolSpec(TOOLS, "auto", customs=(CustomTool("shell"),))
    assert call_format_for("qwen3_coder", tools=customs) == GENERIC
    assert call_format_for("json_tools", tools=customs).name == "json_tools"
    assert call_format_for("qwen3_coder", tools=spec()).name == "qwen3_coder"
    # An unknown parser, or none: the generic format.
    assert call_format_for("no_such_parser") == GENERIC
    assert call_format_for(None) == GENERIC


@pytest.mark.parametrize("family", FAMILIES)
def test_tools_calls_and_results_round_trip_through_the_template(tokenizers, family):
    tokenizer = tokenizers[family]
    fmt = call_format_for(family)
    calls = [("get_weather", arguments(family)), ("ping", {})]
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": f"c{i}", "name": name, "arguments": json.dumps(args)}
                for i, (name, args) in enumerate(calls)
            ],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c1", "content": "pong"},
    ]
    rendered, extra = render(messages, spec(), fmt)
    assert [t["function"]["name"] for t in extra["tools"]] == ["get_weather", "ping"]
    prompt = tokenizer.apply_chat_template(
        rendered, add_generation_prompt=True, tokenize=False, **extra
    )
    assert '"name": "get_weather"' in prompt  # the tools, as the template lists them
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    assert "<tool_response>\npong\n</tool_response>" in prompt
    content, done = parse(family, written(tokenizer, family, calls))
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in done] == calls
    assert [c.index for c in done] == [0, 1]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(3))
def test_streaming_under_any_chunking_equals_the_whole_text(tokenizers, family, seed):
    text = "Let me check. " + written(
        tokenizers[family], family, [("get_weather", arguments(family)), ("ping", {})]
    )
    whole = parse(family, text)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 12)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert parse(family, text, chunks) == whole
    # One character at a time too: a start marker split anywhere is held back, never content.
    assert parse(family, text, list(text)) == whole
    assert whole[0] == "Let me check. "
    assert [c.name for c in whole[1]] == ["get_weather", "ping"]


def merged(pieces: list[Any]) -> list[Any]:
    """`pieces` with adjacent text (or argument deltas of one call) joined: what a client
    reads, whatever the commits' boundaries."""
    from jupyter_lmsp.protocol.output import CallArguments, Text

    out: list[Any] = []
    for piece in pieces:
        last = out[-1] if out else None
        if isinstance(piece, Text) and isinstance(last, Text):
            out[-1] = Text(last.choice, last.text + piece.text)
        elif (
            isinstance(piece, CallArguments)
            and isinstance(last, CallArguments)
            and last.index == piece.index
        ):
            out[-1] = CallArguments(last.choice, last.index, last.delta + piece.delta)
        else:
            out.append(piece)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_a_resumed_assembler_goes_on_as_an_uninterrupted_one(tokenizers, family):
    """The server's assembler (from `JobStarted.tool_format`): after a resume it is re-fed the
    committed text (`restore`) and makes exactly the pieces an uninterrupted run makes next."""
    from jupyter_lmsp.engine.messages import JobTokens
    from jupyter_lmsp.protocol.output import CallArguments, CallBegin, CallEnd, Text
    from jupyter_lmsp.services.assembly import OutputAssembler

    text = "Checking. " + written(
        tokenizers[family], family, [("get_weather", arguments(family)), ("ping", {})]
    )

    def run(assembler: OutputAssembler, part: str) -> list[Any]:
        pieces = []
        for i in range(0, len(part), 7):
            pieces += assembler.tokens(JobTokens("j", [0], part[i : i + 7])).pieces
        return pieces

    whole = OutputAssembler(family, NAMES, 1, (), tools=spec())
    expected = run(whole, text) + whole.end(0, "stop").pieces
    kinds = [type(p) for p in expected]
    assert kinds[:1] == [Text] and kinds.count(CallBegin) == 2 and kinds.count(CallEnd) == 2
    assert kinds.count(CallArguments) == 2
    for cut in (3, len(text) // 3, len(text) // 2, len(text) - 2):
        first = OutputAssembler(family, NAMES, 1, (), tools=spec())
        before = run(first, text[:cut])
        resumed = OutputAssembler(family, NAMES, 1, (), tools=spec())
        resumed.restore([text[:cut]])
        after = run(resumed, text[cut:]) + resumed.end(0, "stop").pieces
        assert merged(before + after) == merged(expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_call_that_cannot_be_read_fails_loudly(tokenizers, family):
    fmt = FORMATS[family]
    good = written(tokenizers[family], family, [("get_weather", {"city": "Oslo"})])
    # A function no tool has.
    with pytest.raises(ToolCallError):
        parse(family, good.replace("get_weather", "get_wether"))
    # Garbage between the markers.
    with pytest.raises(ToolCallError):
        parse(family, f"{fmt.start}(((not a call{fmt.end}")
    if fmt.end:
        # The output ends inside a call.
        with pytest.raises(ToolCallError):
            parse(family, good[: good.rindex(fmt.end)])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_grammar_takes_valid_calls_in_the_family_syntax(tokenizers, family):
    tokenizer = tokenizers[family]
    one = written(tokenizer, family, [("get_weather", arguments(family))])
    two = written(tokenizer, family, [("get_weather", {"city": "Oslo"}), ("ping", {})])
    required = grammar_for(tokenizer, spec("required"))
    assert accepts(tokenizer, required, one)
    assert accepts(tokenizer, required, two)
    assert not accepts(tokenizer, required, "Just text.")
    auto = grammar_for(tokenizer, spec("auto"))
    assert accepts(tokenizer, auto, "Just text.")
    assert accepts(tokenizer, auto, "Checking. " + one)
    # parallel_tool_calls false: one call only.
    single = grammar_for(tokenizer, ToolSpec(TOOLS, "required", parallel=False))
    assert accepts(tokenizer, single, one)
    assert not accepts(tokenizer, single, two)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_grammar_refuses_wrong_names_and_undeclared_keys(tokenizers, family):
    tokenizer = tokenizers[family]
    required = grammar_for(tokenizer, spec("required"))
    assert not accepts(
        tokenizer, required, written(tokenizer, family, [("get_wether", {"city": "Oslo"})])
    )
    extra = written(tokenizer, family, [("get_weather", {"city": "Oslo", "country": "NO"})])
    assert not accepts(tokenizer, required, extra)
    # A wrong type of a typed parameter, a value outside an enum.
    assert not accepts(
        tokenizer,
        required,
        written(tokenizer, family, [("get_weather", {"city": "Oslo", "days": "soon"})]),
    )
    assert not accepts(
        tokenizer,
        required,
        written(tokenizer, family, [("get_weather", {"city": "Oslo", "units": "k"})]),
    )
    # A missing required parameter.
    assert not accepts(
        tokenizer, required, written(tokenizer, family, [("get_weather", {"days": 3})])
    )
    # A named function: only its calls.
    named = grammar_for(tokenizer, spec("ping"))
    assert accepts(tokenizer, named, written(tokenizer, family, [("ping", {})]))
    assert not accepts(
        tokenizer, named, written(tokenizer, family, [("get_weather", {"city": "Oslo"})])
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_a_non_strict_tool_without_properties_takes_its_calls(tokenizers, family):
    tokenizer = tokenizers[family]
    loose = ToolSpec((FunctionTool("note", None, {"type": "object"}, strict=False),), "required")
    grammar = grammar_for(tokenizer, loose)
    if family in (
        "qwen3_coder",
        "glm47",
        "longcat",
        "minimax_m2",
        "minicpm5",
        "mistral",
        "kimi_k2",
    ):
        assert accepts(tokenizer, grammar, written(tokenizer, family, [("note", {"text": "hi"})]))
    assert accepts(tokenizer, grammar, written(tokenizer, family, [("note", {})]))


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_check_tools_compiles_each_format_and_refuses_with_a_path(family):
    fmt = call_format_for(family)
    # A property that refers to the root's definitions compiles alone too.
    defs = {
        "type": "object",
        "properties": {"when": {"$ref": "#/$defs/day"}, "city": {"type": "string"}},
        "required": ["when"],
        "$defs": {"day": {"type": "object", "properties": {"d": {"type": "integer"}}}},
    }
    assert check_tools(ToolSpec((FunctionTool("f", None, defs),), "required"), fmt) is None
    bad = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(?=a)b"}}}
    issue = check_tools(ToolSpec((FunctionTool("f", None, bad),), "required"), fmt)
    assert issue is not None
    assert issue.path == ("tools", 0, "parameters", "properties", "x", "pattern")


# --- end to end ------------------------------------------------------------------------------

E2E = ("qwen3_coder", "mistral", "kimi_k2")
SHELL = {
    "type": "function",
    "name": CALL_NAME,
    "description": "Run a command",
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}},
        "required": ["cmd"],
    },
}


@pytest.fixture(scope="module")
def family_server(tmp_path_factory) -> Iterator[Any]:
    """One server, a scripted model per family of `E2E` (named by its family)."""
    from familymodels import chat_template

    data = tmp_path_factory.mktemp("families-server")
    (data / "models").mkdir()
    for family in E2E:
        script = family_script(family)
        model_dir = make_scripted_model(
            tmp_path_factory.mktemp(f"scripted-{family}"),
            script=script.tokens,
            special=script.special,
            chat_template=chat_template(family),
        )
        (data / "models" / family).symlink_to(model_dir)
    with ServerProcess(data, default_model=E2E[0]).start() as server:
        yield server


@pytest.mark.parametrize("family", E2E)
def test_a_scripted_call_in_the_family_format_through_both_apis(family_server, family):
    server = family_server
    with server.client(timeout=120) as http:
        body = {
            "model": family,
            "input": "Run it.",
            "tools": [SHELL],
            "temperature": 0,
            "max_output_tokens": 64,
        }
        r = http.post("/responses", json=body)
        assert r.status_code == 200, r.text
        response = r.json()
        assert response["status"] == "completed", json.dumps(response)[:3000]
        [call] = [item for item in response["output"] if item["type"] == "function_call"]
        assert call["name"] == CALL_NAME
        assert json.loads(call["arguments"]) == CALL_ARGUMENTS
        assert [i["type"] for i in response["output"]] == ["function_call"]

        # Streamed: the call's events in order, the same arguments.
        events = _stream(http, {**body, "stream": True})
        kinds = [e["type"] for e in events]
        assert kinds.index("response.output_item.added") < kinds.index(
            "response.function_call_arguments.done"
        )
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
        assert json.loads(done["arguments"]) == CALL_ARGUMENTS

        # Forced (a grammar in the family's syntax), then Chat Completions.
        forced = http.post("/responses", json={**body, "tool_choice": "required"}).json()
        assert forced["status"] == "completed", forced
        assert forced["output"][0]["name"] == CALL_NAME
        chat = http.post(
            "/chat/completions",
            json={
                "model": family,
                "messages": [{"role": "user", "content": "Run it."}],
                "tools": [
                    {
                        "type": "function",
                        "function": {k: v for k, v in SHELL.items() if k != "type"},
                    }
                ],
                "temperature": 0,
                "max_tokens": 64,
            },
        )
        assert chat.status_code == 200, chat.text
        choice = chat.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        [tool_call] = choice["message"]["tool_calls"]
        assert tool_call["function"]["name"] == CALL_NAME
        assert json.loads(tool_call["function"]["arguments"]) == CALL_ARGUMENTS
        assert not choice["message"].get("content")

    # Batched: several requests at once (rows of one batch), each with its call.
    def one(_: int) -> dict[str, Any]:
        with server.client(timeout=120) as c:
            return dict(c.post("/responses", json={**body, "tool_choice": "required"}).json())

    with ThreadPoolExecutor(4) as pool:
        for result in pool.map(one, range(4)):
            assert result["status"] == "completed", result
            [item] = result["output"]
            assert json.loads(item["arguments"]) == CALL_ARGUMENTS
    assert family in E2E


def _stream(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with http.stream("POST", "/responses", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    return events


# --- kill -9 and resume ----------------------------------------------------------------------

BOUNDED = {
    "type": "object",
    "properties": {
        "days": {"type": "integer", "minimum": 0, "maximum": 30},
        "units": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["days", "units"],
}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_family_call_resumed_after_kill_ends_as_the_uninterrupted_run(
    tmp_path: Path, test_model_dir: Path
) -> None:
    """The random test model under qwen3_coder's template (mlx-lm infers the format from it),
    forced to call: killed mid-call and resumed, the call is the uninterrupted run's."""
    import shutil
    import time

    from familymodels import chat_template
    from serverproc import ServerProcess, with_test_model
    from test_crash_recovery import SLOW, TERMINAL, check_log, create, read_sse, wait_for

    model = tmp_path / "model"
    shutil.copytree(test_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = chat_template("qwen3_coder")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    request: dict[str, Any] = {
        "temperature": 0.8,
        "seed": 7,
        "on_restart": "resume",
        "tools": [{"type": "function", "name": "get_weather", "parameters": BOUNDED}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 300,
    }

    def done(task: dict[str, Any], _log: Any) -> bool:
        return task["state"] in ("completed", "failed", "cancelled")

    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    with ServerProcess(with_test_model(ref_dir, model)).start() as ref, ref.client() as c:
        _, ref_log = wait_for(c, create(c, **request)["task_id"], done)
    expected = check_log(ref_log)["response"]
    assert expected["status"] == "completed", expected
    [want] = expected["output"]
    assert want["type"] == "function_call" and want["name"] == "get_weather"
    assert set(json.loads(want["arguments"])) == {"days", "units"}
    assert expected["usage"]["output_tokens"] >= 40, expected["usage"]

    data = tmp_path / "data"
    data.mkdir()
    with_test_model(data, model)
    server = ServerProcess(data, **SLOW).start()
    with server.client() as c:
        resp = create(c, **request)
        # Killed about 20 tokens into the call (it streams only at its end: no delta to wait
        # for), well before its end (the reference's token count).
        wait_for(c, resp["task_id"], lambda task, log: task["state"] == "running")
        time.sleep(1.0)
        seen = c.get(f"/tasks/{resp['task_id']}/events", params={"limit": 1000}).json()["data"]
    server.kill()
    assert not any(e["type"] in TERMINAL for e in seen), "it finished before the kill"
    with ServerProcess(data).start() as server2:
        rest = read_sse(server2, f"/tasks/{resp['task_id']}/events", seen[-1]["sequence_number"])
    final = check_log(seen + rest)["response"]
    assert final["status"] == "completed", final
    [got] = final["output"]
    assert (got["type"], got["name"], got["arguments"]) == (
        want["type"],
        want["name"],
        want["arguments"],
    )
    assert final["usage"]["output_tokens"] == expected["usage"]["output_tokens"]


def test_glm_takes_the_newlines_of_the_older_templates(tokenizers):
    """GLM-4.5/4.6 templates write a newline after the name and after each tag, GLM-4.7's
    none: the glm47 grammar takes both, and mlx-lm's parser reads both."""
    tokenizer = tokenizers["glm47"]
    text = (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    )
    assert accepts(tokenizer, grammar_for(tokenizer, spec("required")), text)
    _, [call] = parse("glm47", text)
    assert json.loads(call.arguments) == {"city": "Oslo", "days": 3}
