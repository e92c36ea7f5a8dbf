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
    reasons = {k.split("/", 1)[1] for k in row if k.startswith("reward_reason/")}
    assert reasons and reasons <= {"correct", "partial", "wrong"}, row
    assert 0.0 <= row["reward_mean"] <= 1.0
