"""The task list's prompt excerpt (issue 40, jupyter_lmsp.protocol.excerpt): which message it
is taken from and how it is cut."""

from __future__ import annotations

import json

from jupyter_lmsp.protocol.excerpt import output_tokens, prompt_excerpt, shorten


def request(conversation: list[dict], input_count: int, instructions: str | None = None) -> str:
    return json.dumps(
        {"conversation": conversation, "input_count": input_count, "instructions": instructions}
    )


def test_the_first_user_message_of_the_own_input_not_the_earlier_turns():
    turns = [
        {"role": "user", "content": "An earlier question."},
        {"role": "assistant", "content": "An earlier answer."},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "  The new\n\tquestion.  "},
    ]
    assert prompt_excerpt(request(turns, 2), "{}") == "The new question."


def test_parts_instructions_and_the_older_layout():
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "From parts."}]}]
    assert prompt_excerpt(request(parts, 1), "{}") == "From parts."
    assert prompt_excerpt(request([], 0, "Only instructions."), "{}") == "Only instructions."
    assert prompt_excerpt(request([], 0), "{}") is None
    older = json.dumps({"messages": [{"role": "user", "content": "Kept in params."}]})
    assert prompt_excerpt(json.dumps({}), older) == "Kept in params."


def test_cut_at_a_word_within_80_characters():
    words = "word " * 40
    cut = shorten(words)
    assert len(cut) <= 80 and cut.endswith("…") and cut[:-1] == cut[:-1].rstrip()
    assert set(cut[:-1].split(" ")) == {"word"}  # no word cut in half
    one_long_word = "x" * 200
    assert shorten(one_long_word) == "x" * 79 + "…"  # no space to cut at: cut inside it
    assert shorten("short") == "short"


def test_output_tokens_from_usage():
    assert output_tokens(json.dumps({"input_tokens": 5, "output_tokens": 7})) == 7
    assert output_tokens(None) is None
