"""Shared fixtures for the trainer tests: one tiny warmed-up demo model for the whole session."""

import pytest

from delta_jax.demo import warm_up_demo_model


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    """A briefly warmed-up demo policy saved as a Hugging Face directory (built once)."""
    return warm_up_demo_model(tmp_path_factory.mktemp("demo") / "model", steps=30, lr=3e-3)


def tiny_overrides(run_dir, model_dir, *extra: str) -> list[str]:
    """Overrides that make the demo config a seconds-long run on the shared tiny model."""
    return [
        f"model.path={model_dir}",
        f"run.dir={run_dir}",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=24",
        "data.max_prompt_length=16",
        "reward.num_workers=1",
        # Dense test reward: the barely warmed-up model is never right, so the math reward
        # would leave every group uninformative (tests that need the math reward override it).
        "reward.kind=tests.rl.reward_fns:graded_length",
        "run.eval_every=0",
        "run.progress=false",
        "run.tensorboard=false",
        "optim.lr=0.001",
        *extra,
    ]
