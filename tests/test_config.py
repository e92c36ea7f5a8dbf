"""Configs: every shipped file parses; overrides are type-checked; mistakes are one-line errors."""

from pathlib import Path

import pytest

from delta_jax.config import Config, ConfigError, load_config

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    for required in (
        "demo.yaml",
        "qwen3_8b_delta.yaml",
        "qwen3_8b_dapo.yaml",
        "qwen3_14b_delta.yaml",
        "qwen3_8b_grpo.yaml",
        "qwen3_8b_dr_grpo.yaml",
    ):
        assert required in names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    config = load_config(path)
    assert isinstance(config, Config)


def test_paper_recipe_values():
    c = load_config(CONFIGS[0].parent / "qwen3_8b_delta.yaml")
    assert (c.rollout.prompts_per_step, c.rollout.samples_per_prompt) == (128, 16)
    assert c.algo.mini_batches == 4  # 128 prompts, mini-batch 32 prompts
    assert (c.algo.loss, c.algo.refine_steps, c.algo.lam_min, c.algo.lam_max) == (
        "delta",
        1,
        0.8,
        1.2,
    )
    assert (c.optim.lr, c.optim.weight_decay, c.optim.grad_clip) == (1e-6, 0.1, 1.0)
    assert (c.rollout.max_new_tokens, c.data.max_prompt_length) == (20480, 2048)
    assert (c.reward.overlong_buffer, c.reward.overlong_factor) == (4096, 1.0)
    assert c.run.steps == 220
    dapo = load_config(CONFIGS[0].parent / "qwen3_8b_dapo.yaml")
    assert dapo.algo.loss == "dapo" and dapo.rollout == c.rollout and dapo.optim == c.optim
    assert load_config(CONFIGS[0].parent / "qwen3_14b_delta.yaml").run.steps == 300


def test_overrides_are_typed():
    c = load_config(None, ["algo.loss=dapo", "optim.lr=1e-6", "run.steps=3", "run.mesh=[2,2,2]"])
    assert c.algo.loss == "dapo"
    assert c.optim.lr == 1e-6 and isinstance(c.optim.lr, float)
    assert c.run.steps == 3
    assert c.run.mesh == (2, 2, 2)
    assert load_config(None, ["algo.clip_eps_low=null"]).algo.clip_eps_low is None
    speculate = [load_config(None, [f"rollout.speculate={v}"]).rollout.speculate for v in (
        "true", "off", "auto")]  # fmt: skip
    assert speculate == [True, False, "auto"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("algo.los=dapo", "unknown key algo.los; did you mean algo.loss"),
        ("algo.loss=foo", "algo.loss='foo' is not one of"),
        ("run.steps=1.5", "run.steps=1.5 must be an integer"),
        ("run.steps=many", "run.steps='many' must be an integer"),
        ("rollout.top_p=2", "rollout.top_p=2.0 must be in (0, 1]"),
        ("optim.lr=fast", "optim.lr='fast' must be a number"),
        ("run.tensorboard=maybe", "must be true or false"),
        ("rollout.speculate=maybe", "rollout.speculate='maybe' must be one of true, false, 'auto'"),
        ("rollot.top_p=0.5", "unknown section 'rollot'"),
        ("algo.mini_batches=3", "must divide the rollout batch"),
        ("algo.loss", "must look like section.key=value"),
        ("loss=dapo", "the key must be section.key"),
        # Upper bounds (the walk in tests/rl/test_config_boundaries.py covers 0 and -1).
        ("optim.b2=1", "optim.b2=1.0 must be in [0, 1)"),
        ("algo.clip_eps_low=1.5", "algo.clip_eps_low=1.5 must be in [0, 1]"),
        ("model.demo_warmup_noise=2", "model.demo_warmup_noise=2.0 must be in [0, 1]"),
        ("run.mesh=[-1,2,-1]", "run.mesh=[-1, 2, -1]: each entry must be >= 1, or -1"),
        ("reward.overlong_buffer=25", "must be <= rollout.max_new_tokens=24"),
    ],
)
def test_bad_overrides_are_one_line_errors(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_base_chain_and_file_errors(tmp_path):
    (tmp_path / "a.yaml").write_text("run:\n  steps: 7\n  dir: x\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nrun:\n  dir: y\n")
    c = load_config(tmp_path / "b.yaml")
    assert (c.run.steps, c.run.dir) == (7, "y")
    (tmp_path / "bad.yaml").write_text("run:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match="unknown key run.stepz; did you mean run.steps"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="circular"):
        load_config(tmp_path / "loop.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")


def test_builtin_defaults_are_the_demo():
    assert load_config(None) == load_config(CONFIGS[0].parent / "demo.yaml")
