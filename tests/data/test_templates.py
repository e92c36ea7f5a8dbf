"""encode_prompts: chat template and plain fallback, user template, max-prompt-length policy.

The reference ids are computed without the tokenizer: a word-level vocabulary, special tokens cut
out by a regex, the rest split on whitespace and looked up by hand.
"""

from __future__ import annotations

import re

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from delta_jax.data import DEMO_TEMPLATE, PromptRecord, encode_prompts, render_prompt

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>"]
CORPUS = (
    "system user assistant be brief you are kind what is one plus two say hi to the world "
    "a b c d e f g h Please reason step by step, and put your final answer within \\boxed{}."
)
VOCAB = {w: i for i, w in enumerate(SPECIALS + sorted(set(CORPUS.split())))}


def reference_ids(text: str, bos: bool = False) -> list[int]:
    ids = [VOCAB["<s>"]] if bos else []
    for piece in re.split(r"(<\|im_start\|>|<\|im_end\|>)", text):
        if piece in ("<|im_start|>", "<|im_end|>"):
            ids.append(VOCAB[piece])
        else:
            ids += [VOCAB[w] for w in piece.split()]
    return ids


def make_tokenizer(chat: bool) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    # A base-model tokenizer that prepends BOS when asked for special tokens.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", VOCAB["<s>"])]
    )
    kwargs = {"chat_template": CHAT_TEMPLATE} if chat else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", **kwargs
    )


@pytest.fixture(scope="module")
def chat_tok():
    return make_tokenizer(chat=True)


@pytest.fixture(scope="module")
def plain_tok():
    return make_tokenizer(chat=False)


RECORDS = [
    PromptRecord(prompt="what is one plus two", answer="3"),
    PromptRecord(prompt="say hi", answer=None, system="be brief"),
]


def test_chat_template_path(chat_tok):
    enc = encode_prompts(RECORDS, chat_tok, max_prompt_length=64, system_prompt="you are kind")
    texts = [
        "<|im_start|>system\nyou are kind<|im_end|>\n"
        "<|im_start|>user\nwhat is one plus two<|im_end|>\n<|im_start|>assistant\n",
        # The record's own system message wins over the default.
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nsay hi<|im_end|>\n<|im_start|>assistant\n",
    ]
    assert [render_prompt(r, chat_tok, system_prompt="you are kind") for r in RECORDS] == texts
    # No BOS added on top of the template.
    assert enc.ids == [reference_ids(t) for t in texts]
    assert enc.records == RECORDS
    assert (enc.dropped, enc.truncated) == (0, 0)
    no_system = encode_prompts(RECORDS[:1], chat_tok, max_prompt_length=64)
    text = "<|im_start|>user\nwhat is one plus two<|im_end|>\n<|im_start|>assistant\n"
    assert no_system.ids == [reference_ids(text)]


def test_plain_fallback_path(plain_tok):
    assert not plain_tok.chat_template
    enc = encode_prompts(RECORDS, plain_tok, max_prompt_length=64)
    texts = ["what is one plus two", "be brief\n\nsay hi"]
    assert [render_prompt(r, plain_tok) for r in RECORDS] == texts
    assert enc.ids == [reference_ids(t, bos=True) for t in texts]
    with_default = encode_prompts(RECORDS[:1], plain_tok, max_prompt_length=64, system_prompt="hi")
    assert with_default.ids == [reference_ids("hi\n\nwhat is one plus two", bos=True)]


def test_user_template_keeps_latex_braces(chat_tok):
    rec = PromptRecord(prompt="what is one plus two", answer="3")
    text = render_prompt(rec, chat_tok, template=DEMO_TEMPLATE)
    user = (
        "what is one plus two\nPlease reason step by step, and put your final answer within "
        "\\boxed{}."
    )
    assert text == f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    enc = encode_prompts([rec], chat_tok, max_prompt_length=64, template=DEMO_TEMPLATE)
    assert enc.ids == [reference_ids(text)]
    assert VOCAB["<unk>"] not in enc.ids[0]


LENGTH_RECORDS = [PromptRecord(prompt=" ".join("abcdefgh"[:n]), answer=None) for n in (1, 5, 3, 8)]


def test_max_prompt_length_drop(plain_tok):
    full = [reference_ids(r.prompt, bos=True) for r in LENGTH_RECORDS]  # lengths 2, 6, 4, 9
    enc = encode_prompts(LENGTH_RECORDS, plain_tok, max_prompt_length=4, truncation="drop")
    assert enc.ids == [full[0], full[2]]
    assert enc.records == [LENGTH_RECORDS[0], LENGTH_RECORDS[2]]
    assert (enc.dropped, enc.truncated) == (2, 0)
    # A prompt of exactly max_prompt_length tokens is kept.
    assert encode_prompts(LENGTH_RECORDS, plain_tok, max_prompt_length=9).dropped == 0


def test_max_prompt_length_left_truncate(plain_tok):
    full = [reference_ids(r.prompt, bos=True) for r in LENGTH_RECORDS]
    enc = encode_prompts(LENGTH_RECORDS, plain_tok, max_prompt_length=4, truncation="left")
    assert enc.ids == [full[0], full[1][-4:], full[2], full[3][-4:]]
    assert enc.ids[3] == [VOCAB[w] for w in "e f g h".split()]
    assert enc.records == LENGTH_RECORDS
    assert (enc.dropped, enc.truncated) == (0, 2)


def test_bad_arguments(plain_tok):
    with pytest.raises(ValueError, match="max_prompt_length must be a positive int"):
        encode_prompts(RECORDS, plain_tok, max_prompt_length=0)
    with pytest.raises(ValueError, match="truncation must be 'drop' or 'left', got 'right'"):
        encode_prompts(RECORDS, plain_tok, max_prompt_length=8, truncation="right")
    with pytest.raises(ValueError, match="template must contain the literal"):
        encode_prompts(RECORDS, plain_tok, max_prompt_length=8, template="{question}")
    empty = encode_prompts([], plain_tok, max_prompt_length=8)
    assert (empty.ids, empty.records, empty.dropped) == ([], [], 0)
