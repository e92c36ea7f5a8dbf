"""render_observation against apply_chat_template of the whole conversation; truncate_middle."""

import pytest

from delta_jax.envs import (
    PLAIN_OBSERVATION,
    PythonTool,
    observation_length,
    render_observation,
    truncate_middle,
)
from delta_jax.rewards.code import OUTPUT_CUT
from tests.envs.helpers import word_tokenizer

CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
THINKING_CALL = "<think>\nI should compute it.\n</think>\n\n" + CALL


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer()


def _render(tok, messages, tools, **kwargs):
    return tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
    )


@pytest.mark.parametrize("turn", [CALL, THINKING_CALL])
@pytest.mark.parametrize("earlier_rounds", [0, 1])
@pytest.mark.parametrize("with_tools", [False, True])
def test_context_plus_observation_is_the_template_of_the_whole_conversation(
    tok, turn, earlier_rounds, with_tools
):
    # The context is the prompt as rendered with a generation prompt, then the turn as the
    # model wrote it; appending the rendered observation must give what the template renders
    # for the conversation with the assistant turn and the tool message added.
    tools = list(PythonTool().tools) if with_tools else None
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "6 * 7 ?"}]
    for i in range(earlier_rounds):
        messages += [
            {"role": "assistant", "content": THINKING_CALL},
            {"role": "tool", "content": f"earlier output {i}"},
        ]
    context = _render(tok, messages, tools) + turn
    observation = "42\nline two"
    rendered = render_observation(observation, tok, messages=messages, tools=tools)
    whole = messages + [
        {"role": "assistant", "content": turn},
        {"role": "tool", "content": observation},
    ]
    assert context + rendered == _render(tok, whole, tools)
    assert rendered == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\nline two\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_that_rewrites_the_turn_still_gives_what_follows_it(tok):
    # With enable_thinking=False the prompt ends in an empty think block that the template
    # drops when it re-renders the turn; the history is never re-rendered in the engine, so
    # only the text after the turn's content matters, and it is the template's.
    messages = [{"role": "user", "content": "6 * 7 ?"}]
    rendered = render_observation("42", tok, messages=messages, enable_thinking=False)
    whole = _render(
        tok,
        messages + [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "42"}],
        None,
        enable_thinking=False,
    )
    assert whole.endswith(CALL + rendered)
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_plain_rendering_without_a_chat_template():
    assert render_observation("42") == "\n```output\n42\n```\n" == PLAIN_OBSERVATION.format("42")
    assert render_observation("42", word_tokenizer(chat_template=None)) == PLAIN_OBSERVATION.format(
        "42"
    )


def test_template_without_the_content_is_a_clear_error():
    tok = word_tokenizer(chat_template="{% for m in messages %}{{ m.role }}{% endfor %}")
    with pytest.raises(ValueError, match="drops the assistant's content"):
        render_observation("42", tok, messages=[{"role": "user", "content": "q"}])


def test_truncation_by_tokens_keeps_exact_head_and_tail(tok):
    words = [f"w{i}" for i in range(50)]
    text = " ".join(words)
    cut = len(OUTPUT_CUT.split())  # The word tokenizer's count of the marker: 4.
    assert observation_length(OUTPUT_CUT, tok) == cut == 4
    out = truncate_middle(text, 21, tok)
    keep = 21 - cut
    head, tail = keep // 2, keep - keep // 2
    assert (head, tail) == (8, 9)
    assert out == " ".join(words[:head]) + OUTPUT_CUT + " ".join(words[-tail:])
    assert observation_length(out, tok) == 21
    # At the limit nothing is cut; one token over, the middle goes.
    assert truncate_middle(" ".join(words[:21]), 21, tok) == " ".join(words[:21])
    over = truncate_middle(" ".join(words[:22]), 21, tok)
    assert over.split() == words[:8] + OUTPUT_CUT.split() + words[22 - 9 : 22]


def test_truncation_by_characters():
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    out = truncate_middle(text, 100)
    keep = 100 - len(OUTPUT_CUT)
    assert out == text[: keep // 2] + OUTPUT_CUT + text[-(keep - keep // 2) :]
    assert len(out) == 100
    assert truncate_middle(text[:100], 100) == text[:100]


def test_a_budget_without_room_is_refused(tok):
    with pytest.raises(ValueError, match="max_observation_tokens must be >= 6"):
        truncate_middle("w1 w2 w3 w4 w5 w6 w7", 5, tok)
    with pytest.raises(ValueError, match="max_observation_tokens must be >= 6"):
        PythonTool(max_observation_tokens=5, tokenizer=tok)
