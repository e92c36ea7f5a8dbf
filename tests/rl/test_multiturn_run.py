"""Multi-turn RL steps through ``Trainer(environment=...)`` on the demo model: episodes whose
turns end at a stop string, observations as context, every loss training on them; and an
environment whose turns never end leaves a run exactly as the single-turn one."""

import numpy as np
import pytest

from delta_jax import Trainer
from delta_jax.config import ConfigError, load_config
from delta_jax.envs import StepResult
from tests.rl.conftest import tiny_overrides
from tests.rl.test_trainer import DEMO, _strip


class Echo:
    """Ends a turn at ``stop``; answers each turn with the same observation."""

    tools = ()

    def __init__(self, stop="er"):
        self.stop_strings = (stop,)

    def reset(self, row):
        return row["prompt"]

    def step(self, turn):
        return StepResult("OBS", False)


def saw_observation(prompts, completions, **columns):
    """1 for an episode that got an observation, plus a dense length term."""
    return [float("OBS" in c) + min(len(c), 40) / 40 for c in completions]


def _trainer(tmp_path, model_dir, *extra, **kw):
    overrides = tiny_overrides(tmp_path, model_dir, "run.steps=2", "rollout.max_new_tokens=32")
    config = load_config(DEMO, [*overrides, *extra])
    return Trainer(config, reward_fns=[saw_observation], **kw)


@pytest.mark.slow  # one trainer per loss
@pytest.mark.parametrize("loss", ["delta", "dapo", "grpo"])
def test_every_loss_trains_on_multi_turn_episodes(tmp_path, demo_model_dir, loss):
    extra = (f"algo.loss={loss}", "rollout.max_turns=3")
    with _trainer(tmp_path, demo_model_dir, *extra, environment=Echo()) as trainer:
        before = np.asarray(trainer.params["embed"][...]).copy()
        row = trainer.step()
        assert not np.array_equal(before, np.asarray(trainer.params["embed"][...]))
    # "Answer: ..." ends its first turn at "er": most episodes got an observation.
    assert row["reward/saw_observation"] > 1.0
    # Not every one, and none ends a second turn: the barely warmed-up demo model (30 warm-up
    # steps) writes "Answer" in 11 of the 16 episodes of the first step, and after the
    # observation never "er" again within its 32 tokens; measured 1.6875 turns an episode
    # (11 x 2 + 5 x 1) / 16 for every loss (the first rollout precedes any update), none at
    # the turn limit of 3. So: more than half the episodes took a second turn, none a third.
    assert 1.5 < row["episode/turns"] <= 2.0 and row["episode/turn_limit"] == 0
    assert row["episode/env_errors"] == 0 and row["episode/tool_calls"] == 0
    assert 0 < row["rollout/observation_share"] < 1
    assert 0 < row["batch/action_fraction"] < 1
    assert np.isfinite(row["loss"])
    # Echo answers at once: the engine waits for it only while no other sequence can run (a
    # part of the rollout's time; measured 0.0 s, the episodes without a turn's end decode
    # meanwhile). tests/sampling/test_multiturn.py shows the wait when nothing else can run.
    assert 0.0 <= row["time/tool_wait"] <= row["time/rollout"]


# Values computed from the sampler's hidden states (DelTA's coefficients where the update can
# run several micro-batches, `algo.micro_batch_rows=auto`) and what follows from them: the
# multi-turn engine's decode is another XLA program, whose float32 hidden states round
# differently (relative differences of 1e-7 to 2e-7 seen at step 2; step 1 exact).
FROM_SAMPLER_HIDDEN = ("delta/", "loss", "pg_loss", "grad_norm")


@pytest.mark.slow  # two trainers
@pytest.mark.parametrize("rows", ["bucketed", "auto"])
def test_turns_that_never_end_leave_the_single_turn_run_unchanged(tmp_path, demo_model_dir, rows):
    extra = (f"algo.micro_batch_rows={rows}",)
    with _trainer(tmp_path / "one", demo_model_dir, *extra) as trainer:
        single = [trainer.step(), trainer.step()]
    extra += ("rollout.max_turns=2",)
    with _trainer(tmp_path / "multi", demo_model_dir, *extra, environment=Echo("ZZZ")) as trainer:
        multi = [trainer.step(), trainer.step()]
    assert all(r["episode/turns"] == 1.0 for r in multi)
    assert all(r["rollout/observation_share"] == 0 for r in multi)
    # Everything else is the single-turn run's: rewards, loss, DelTA statistics, gradients.
    new = ("episode/", "rollout/observation_share", "batch/action_fraction", "time/")
    drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith(new)} for r in rows]
    got, want = drop(_strip(multi)), _strip(single)  # the same keys but the new ones
    assert [r.keys() for r in got] == [r.keys() for r in want]
    assert ("delta/computed_in_loss" in want[0]) == (rows == "bucketed")
    for r, w in zip(got, want, strict=True):
        near = [k for k in r if rows == "auto" and k.startswith(FROM_SAMPLER_HIDDEN)]
        assert {k: r[k] for k in r if k not in near} == {k: w[k] for k in w if k not in near}
        np.testing.assert_allclose([r[k] for k in near], [w[k] for k in near], rtol=1e-6)


def test_bad_environments_are_one_line_errors(tmp_path, demo_model_dir):
    with pytest.raises(ConfigError, match="rollout.max_turns=3 needs an environment"):
        _trainer(tmp_path, demo_model_dir, "rollout.max_turns=3")
    with pytest.raises(ConfigError, match="environment: environment must be an Environment"):
        _trainer(tmp_path, demo_model_dir, environment=42)
    with pytest.raises(ConfigError, match="rollout.environment: .*cannot import 'nowhere'"):
        _trainer(tmp_path, demo_model_dir, "rollout.environment=nowhere:env")
    with pytest.raises(ConfigError, match="needs rollout.engine=continuous"):
        _trainer(tmp_path, demo_model_dir, "rollout.environment=python_tool",
                 "rollout.engine=static")  # fmt: skip
    with pytest.raises(ConfigError, match="max_observation_tokens must be >= "):
        _trainer(tmp_path, demo_model_dir, "rollout.environment=python_tool",
                 "rollout.max_observation_tokens=2")  # fmt: skip
