"""A run's prompt sets from the ``data`` section and plain values (delta_jax.data.prompt_sets),
and the same sets through the config (delta_jax.rl.setup), whose errors are ConfigErrors."""

import pytest

from delta_jax import demo
from delta_jax.config import ConfigError, load_config
from delta_jax.data.prompt_sets import (
    DEMO_TRAIN_SIZE,
    IndexedPrompts,
    PromptSetError,
    eval_set_name,
    extra_eval_sets,
    make_encoder,
    prompt_sets,
)
from delta_jax.rl import setup

ROWS = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(3)]


@pytest.fixture(scope="module")
def tok():
    return demo.build_char_tokenizer()


def _config(*overrides):
    base = ["data.max_prompt_length=64", "rollout.prompts_per_step=4", "run.eval_prompts=8"]
    return load_config(None, [*base, *overrides])


def test_the_demo_sets_from_the_section_equal_the_config_s(tok):
    config = _config("run.seed=3")
    train, evals = prompt_sets(config.data, tok, batch_size=4, seed=3, eval_prompts=8)
    assert isinstance(train, IndexedPrompts) and len(train.ids) == DEMO_TRAIN_SIZE
    prompts = lambda records: [r.prompt for r in records]
    assert prompts(train.records) == prompts(demo.arithmetic_records(DEMO_TRAIN_SIZE, seed=3))
    assert prompts(evals.records) == prompts(demo.arithmetic_records(8, seed=4))  # next seed
    via_config = setup.prompt_sets(config, tok)
    assert via_config[0].ids == train.ids and via_config[1].ids == evals.ids


def test_too_few_prompts_is_one_line_here_and_a_config_error_there(tok):
    config = _config()
    message = r"^train_dataset: 3 usable prompts < rollout.prompts_per_step=4$"
    with pytest.raises(PromptSetError, match=message):
        prompt_sets(config.data, tok, batch_size=4, seed=0, eval_prompts=8, train_dataset=ROWS)
    with pytest.raises(ConfigError, match=message):
        setup.prompt_sets(config, tok, train_dataset=ROWS)
    assert issubclass(PromptSetError, ValueError)


def test_the_encoder_takes_each_prompt_from_the_first_turn(tok):
    records = demo.arithmetic_records(2, seed=0)
    encode = make_encoder(_config().data, tok, first_turn=lambda r: "turn " + r.prompt)
    enc = encode(records)
    assert [r.prompt for r in enc.records] == ["turn " + r.prompt for r in records]
    assert tok.decode(enc.ids[0], skip_special_tokens=True) == "turn " + records[0].prompt


def test_extra_sets_are_named_by_task_or_file_and_names_are_unique(tok):
    assert eval_set_name("reasoning_gym:chain_sum") == "chain_sum"
    assert eval_set_name("data/my-set.v2.jsonl") == "my_set_v2"
    assert eval_set_name("openai/gsm8k/") == "gsm8k"
    twice = _config("data.extra_eval_sources=[demo:products,other/demo:products]")
    with pytest.raises(PromptSetError, match=r"^data.extra_eval_sources: two sets are named"):
        extra_eval_sets(twice.data, tok, seed=0, eval_prompts=8)
    with pytest.raises(ConfigError, match=r"^data.extra_eval_sources: two sets are named"):
        setup.extra_eval_sets(twice, tok)
