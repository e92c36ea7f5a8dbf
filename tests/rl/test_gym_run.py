"""A Trainer step on a reasoning-gym data set object, scored by the reasoning_gym reward."""

import reasoning_gym

from delta_jax import Trainer
from delta_jax.models import from_pretrained, load_tokenizer


def test_one_step_on_a_procedural_dataset(tmp_path, demo_model_dir):
    config = {
        "run.dir": str(tmp_path / "run"),
        "run.steps": 1,
        "run.eval_every": 0,
        "run.progress": False,
        "run.tensorboard": False,
        "rollout.prompts_per_step": 2,
        "rollout.samples_per_prompt": 4,
        "rollout.max_new_tokens": 4,
        "rollout.dynamic_sampling_rounds": 0,  # the row's reasons count the 8 rows it averages
        "data.max_prompt_length": 16,
        "data.truncation": "left",
        "reward.kind": "reasoning_gym",
        "reward.num_workers": 0,
    }
    options = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"]}
    with Trainer(
        config,
        model=from_pretrained(str(demo_model_dir)),
        tokenizer=load_tokenizer(str(demo_model_dir)),
        train_dataset=reasoning_gym.create_dataset("basic_arithmetic", size=8, seed=0, **options),
        eval_dataset=reasoning_gym.create_dataset("basic_arithmetic", size=4, seed=99, **options),
    ) as trainer:
        assert [r.extra["gym_entry"]["metadata"]["source_dataset"]
                for r in trainer.parts.eval_records] == ["basic_arithmetic"] * 4  # fmt: skip
        row = trainer.step()
    reasons = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("reward_reason/")}
    assert reasons and set(reasons) <= {"correct", "partial", "wrong"}, row
    assert sum(reasons.values()) == 8  # every row scored
    # Each row scores 1 (correct), 0 (wrong) or in between (partial credit).
    correct, partial = reasons.get("correct", 0), reasons.get("partial", 0)
    assert correct / 8 <= row["reward_mean"] <= (correct + partial) / 8


def test_extra_held_out_sets_are_reported_beside_the_main_one(tmp_path, demo_model_dir):
    config = {
        "model.path": str(demo_model_dir),
        "data.source": "reasoning_gym:basic_arithmetic",
        "data.gym_options": {"min_terms": 2, "max_terms": 2, "max_digits": 1},
        "data.extra_eval_sources": ["reasoning_gym:chain_sum", "reasoning_gym:leg_counting"],
        "data.max_prompt_length": 16,
        "data.truncation": "left",
        "run.dir": str(tmp_path / "run"),
        "run.steps": 1,
        "run.eval_every": 1,
        "run.eval_prompts": 3,
        "run.progress": False,
        "run.tensorboard": False,
        "rollout.prompts_per_step": 2,
        "rollout.samples_per_prompt": 2,
        "rollout.max_new_tokens": 4,
        "reward.kind": "reasoning_gym",
        "reward.num_workers": 0,
    }
    with Trainer(config) as trainer:
        extra = trainer.parts.extra_evals
        assert list(extra) == ["chain_sum", "leg_counting"]
        tasks = {
            r.extra["gym_entry"]["metadata"]["source_dataset"] for r in extra["chain_sum"].records
        }
        assert tasks == {"chain_sum"} and len(extra["leg_counting"].records) == 3
        metrics = trainer.evaluate()
    for prefix in ("eval/", "eval_chain_sum/", "eval_leg_counting/"):
        assert 0.0 <= metrics[prefix + "avg@1"] <= 1.0, metrics
        assert 1 <= metrics[prefix + "response_length_mean"] <= 4  # rollout.max_new_tokens


def test_extra_held_out_sets_need_evaluations():
    import pytest

    from delta_jax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="extra_eval_sources are evaluated every run.eval_every"):
        load_config(None, ["data.extra_eval_sources=[x.jsonl]", "run.eval_every=0"])
    with pytest.raises(ConfigError, match="data.extra_eval_sources=reasoning_gym:nope"):
        load_config(None, ["data.source=reasoning_gym:chain_sum",
                           "data.extra_eval_sources=[reasoning_gym:nope]"])  # fmt: skip
