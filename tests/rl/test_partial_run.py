"""Partial rollouts in the trainer (``rollout.over_provision``): each step trains whole groups
within the staleness bound, the buffer of partial sequences rides in the checkpoint (a run
stopped with sequences in flight resumes to the uninterrupted run's metrics and parameters,
bitwise), tokens drawn by older policies carry their own behaviour log-probs, and the config
refuses what partial rollouts cannot do.

The tiny demo model on 4 prompts x 4 samples, with one further batch of 4 groups asked for in
every sampler call (``over_provision=1``) on 16 decode slots (4 per data group of the suite's
8 fake devices): a call stops when 4 groups have ended, the rows still decoding or queued are
carried."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from delta_jax.config import ConfigError, load_config
from delta_jax.data import PromptRecord
from delta_jax.envs import StepResult
from delta_jax.losses import truncated_importance_weight
from delta_jax.models import token_logprobs
from delta_jax.rl.partial import PartialRollouts
from delta_jax.rl.trainer import Trainer
from delta_jax.sampling import Sampler
from tests.rl.conftest import tiny_overrides
from tests.rl.test_loop import DEMO, _params
from tests.rl.test_multiturn_run import saw_observation
from tests.sampling.helpers import peaked_model

PARTIAL = (
    "rollout.over_provision=1",
    "rollout.decode_slots=16",
    "algo.tis_cap=2.0",
    "run.save_every=2",
    "reward.num_workers=0",
)


def _config(run_dir, model_dir, *extra):
    return load_config(DEMO, tiny_overrides(run_dir, model_dir, *PARTIAL, *extra))


def _run(config, steps: int) -> list[dict]:
    with Trainer(config) as trainer:
        rows = [trainer.step() for _ in range(steps)]
        trainer.checkpointer.wait()
    return rows


def _comparable(rows):
    """Rows without timings and compile counts (a resumed process compiles again)."""
    drop = lambda k: k.startswith(("time/", "compiles"))
    return [{k: v for k, v in r.items() if not drop(k)} for r in rows]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, demo_model_dir):
    """Four uninterrupted steps with max_staleness=1: (run folder, metrics rows)."""
    run = tmp_path_factory.mktemp("straight") / "run"
    config = _config(run, demo_model_dir, "run.steps=4", "rollout.max_staleness=1")
    return run, _run(config, 4)


def test_steps_train_whole_groups_with_carried_tokens_and_weights(straight):
    _, rows = straight
    for row in rows:
        calls = row["dynamic/rounds"]
        # Every sampler call returns a batch's worth of finished groups (one per prompt).
        assert row["partial/groups_returned"] == 4 * calls
        assert row["partial/groups_carried"] == 4 * calls  # the over-provision, kept
        ages = [int(k.rsplit("_", 1)[1]) for k in row if k.startswith("partial/staleness_")]
        assert max(ages) <= 1
        assert sum(row[f"partial/staleness_{a}"] for a in ages) == 4 * calls
        assert 0 < row["rollout/occupancy"] <= 1
        assert {"tis_weight_mean", "tis_weight_max", "tis_truncated_fraction"} <= set(row)
    assert sum(r["partial/tokens_carried"] for r in rows) > 0  # rows stopped mid-way
    # Groups carried across an update were trained: their older tokens weigh != 1.
    assert any(r.get("partial/staleness_1", 0) for r in rows)
    assert max(r["tis_weight_max"] for r in rows) > 1.05


def test_a_run_stopped_with_partial_sequences_resumes_exactly(tmp_path, demo_model_dir, straight):
    reference, rows = straight
    run = tmp_path / "run"
    _run(_config(run, demo_model_dir, "run.steps=2", "rollout.max_staleness=1"), 2)
    host = json.loads((run / "checkpoints" / "2" / "host" / "metadata").read_text())
    held = PartialRollouts.from_json(host["partial"])
    rows_held = [c for g in held.held for c in g.rows]
    assert len(held.held) == 4 and any(not c.finished and c.tokens for c in rows_held)
    # A new trainer (a new process would do the same): the step-2 checkpoint, to step 4.
    with Trainer(_config(run, demo_model_dir, "run.steps=4", "rollout.max_staleness=1")) as t:
        assert t.step_count == 2 and len(t.partial.held) == 4
        resumed = [t.step() for _ in range(2)]
        t.checkpointer.wait()
    assert _comparable(resumed) == _comparable(rows[2:])
    for x, y in zip(_params(reference, 4), _params(run, 4), strict=True):
        np.testing.assert_array_equal(x, y)


class Counting:
    """Ends a turn at "er", answers with the number of turns it was given and scores an
    episode by that number: an environment with state, which a resumed run must rebuild
    (replaying its turns) to answer and score as before."""

    tools = ()
    stop_strings = ("er",)

    def reset(self, row):
        self.turns = 0
        return row["prompt"]

    def step(self, turn):
        self.turns += 1
        return StepResult(f"OBS{self.turns}", False, reward=float(self.turns))


def _episodes_run(run, model_dir, steps: int, total: int) -> list[dict]:
    extra = (f"run.steps={total}", "rollout.max_staleness=1", "rollout.max_turns=3")
    config = _config(run, model_dir, *extra, "rollout.max_new_tokens=32")
    with Trainer(config, reward_fns=[saw_observation], environment=Counting()) as trainer:
        assert trainer.step_count == total - steps
        rows = [trainer.step() for _ in range(steps)]
        trainer.checkpointer.wait()
    return rows


@pytest.mark.slow  # three trainers of multi-turn episodes
def test_multi_turn_episodes_are_carried_and_resume_exactly(tmp_path, demo_model_dir):
    """Partial rollouts of multi-turn episodes in the trainer: episodes stopped inside or
    between turns are carried with their environments and trained whole; a run saved at step
    2 with episodes in flight (their environments rebuilt from the checkpoint by replaying
    their turns) resumes to the uninterrupted run's metrics and parameters, bitwise."""
    rows = _episodes_run(tmp_path / "straight", demo_model_dir, 4, 4)
    assert sum(r["partial/tokens_carried"] for r in rows) > 0
    assert all(r["partial/groups_returned"] == 4 * r["dynamic/rounds"] for r in rows)
    # Observations in every step (the rows of a call that never started count 0 turns).
    assert all(r["rollout/observation_share"] > 0 for r in rows)
    run = tmp_path / "resumed"
    _episodes_run(run, demo_model_dir, 2, 2)
    host = json.loads((run / "checkpoints" / "2" / "host" / "metadata").read_text())
    held = PartialRollouts.from_json(host["partial"])
    in_flight = [
        (c, e) for g in held.held for c, e in zip(g.rows, g.episodes, strict=True)
        if not c.finished and e["steps"]
    ]  # fmt: skip
    assert in_flight, "no episode was carried after a turn"
    assert all(len(c.observed) == len(e["steps"]) == c.turns for c, e in in_flight)
    resumed = _episodes_run(run, demo_model_dir, 2, 4)
    assert _comparable(resumed) == _comparable(rows[2:])
    for x, y in zip(_params(tmp_path / "straight", 4), _params(run, 4), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow  # two LoRA trainers
def test_lora_runs_carry_partial_groups_and_resume_exactly(tmp_path, demo_model_dir):
    """LoRA with partial rollouts: the sampler draws with base + adapters, groups carried
    across an update are trained against it, and a run saved with sequences in flight resumes
    to the uninterrupted run's metrics and adapters, bitwise."""
    lora = ("model.lora_rank=4", "model.lora_targets=[q_proj,v_proj]", "rollout.max_staleness=1")
    straight = _run(_config(tmp_path / "a", demo_model_dir, "run.steps=3", *lora), 3)
    assert any(r.get("partial/staleness_1", 0) for r in straight)
    assert sum(r["partial/tokens_carried"] for r in straight) > 0
    _run(_config(tmp_path / "b", demo_model_dir, "run.steps=2", *lora), 2)
    with Trainer(_config(tmp_path / "b", demo_model_dir, "run.steps=3", *lora)) as trainer:
        assert trainer.step_count == 2 and trainer.partial.held
        resumed = [trainer.step()]
        trainer.checkpointer.wait()
    assert _comparable(resumed) == _comparable(straight[2:])
    for x, y in zip(_params(tmp_path / "a", 3), _params(tmp_path / "b", 3), strict=True):
        np.testing.assert_array_equal(x, y)


def test_max_staleness_zero_drops_carried_groups(tmp_path, demo_model_dir):
    rows = _run(
        _config(tmp_path / "run", demo_model_dir, "run.steps=3", "rollout.max_staleness=0"), 3
    )
    assert all(not k.startswith("partial/staleness_") or k.endswith("_0") for r in rows for k in r)
    assert sum(r["partial/groups_dropped"] for r in rows) > 0


@pytest.mark.parametrize(
    "extra, message",
    [
        (("rollout.engine=static",), "needs rollout.engine=continuous"),
        (("algo.tis_cap=null",), "needs algo.tis_cap"),
    ],
)
def test_partial_rollouts_refuse_what_they_cannot_do(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO, ["rollout.over_provision=1", "algo.tis_cap=2.0", *extra])


def test_max_staleness_without_partial_rollouts_is_refused():
    with pytest.raises(ConfigError, match="set rollout.over_provision >= 1"):
        load_config(DEMO, ["rollout.max_staleness=1"])


def test_behaviour_logprobs_are_those_of_the_policy_that_drew_each_token():
    """Groups continued under new weights: each token's behaviour log-prob is its drawing
    policy's (a forward pass of that policy), and the importance weight against the update's
    policy is ``min(exp(logpi_update - logpi_behaviour), cap)`` per token."""
    model = peaked_model()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    noise = lambda k, x: x + 0.3 * jax.random.normal(k, x.shape, x.dtype) * jnp.std(x)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(0), 2 * len(leaves))
    versions = [
        params,
        jax.tree.unflatten(
            tree, [noise(k, x) for k, x in zip(keys[: len(leaves)], leaves, strict=True)]
        ),
        jax.tree.unflatten(
            tree, [noise(k, x) for k, x in zip(keys[len(leaves) :], leaves, strict=True)]
        ),
    ]
    sampler = Sampler(
        model, engine="continuous", stop_token_ids=(), decode_slots=4, page_size=4, decode_chunk=4
    )
    rng = np.random.default_rng(1)
    prompts = [
        (rng.integers(1, 96, int(rng.integers(3, 9))).tolist(), PromptRecord(f"q{i}", "0", row=i))
        for i in range(12)
    ]
    buffer, given, drawn = PartialRollouts(2, 2, 2), 0, {}  # (row key) -> tokens under v0
    for version in (0, 1):
        fresh = prompts[given : given + buffer.fresh_needed]
        given += len(fresh)
        plan = buffer.plan(fresh, version=version, seed=7 + version)
        out = sampler.generate(
            plan.prompts,
            max_new_tokens=24,
            temperature=1.0,
            stop_token_ids=[11, 40],
            params=versions[version],
            **plan.generate_kwargs(),
        )
        groups, _ = buffer.take(plan, out)
        if version == 0:
            drawn = {
                (c.seed, c.prompt, c.sample): len(c.tokens) for g in buffer.held for c in g.rows
            }
    assert any(0 < cut for cut in drawn.values())  # rows carried mid-way into version 1
    checked = 0
    for group in groups:
        for r, (tokens, behaviour) in enumerate(
            zip(group.tokens, group.untruncated_logprobs, strict=True)
        ):
            key = tuple(int(k) for k in out.key_array[group.rows[r]])
            cut = drawn.get(key, 0) if group.versions[r] == 0 else 0
            ids = jnp.asarray([list(group.prompt_ids) + tokens])
            by_version = [
                np.asarray(
                    token_logprobs(nnx.merge(graphdef, v, rest), ids[:, :-1], ids[:, 1:]).logprobs
                )[0, len(group.prompt_ids) - 1 :]
                for v in versions
            ]
            expected = np.concatenate([by_version[0][:cut], by_version[1][cut:]])
            np.testing.assert_allclose(behaviour, expected, rtol=1e-4, atol=1e-4)
            update = by_version[2]  # the policy at the start of the next update
            weight = truncated_importance_weight(
                jnp.asarray(update[None]),
                jnp.asarray(behaviour)[None],
                jnp.ones((1, len(tokens))),
                2.0,
            )
            np.testing.assert_allclose(
                weight[0], np.minimum(np.exp(update - expected), 2.0), rtol=1e-4, atol=1e-5
            )
            checked += cut > 0
    assert checked  # at least one returned row holds tokens of both versions
