"""The update plan: built once from the config, validated at load, per-shard DelTA wired."""

import jax
import numpy as np
import pytest

from delta_jax import sharding as sh
from delta_jax.config import ConfigError, load_config
from delta_jax.losses import delta_coefficients, seq_mean_token_mean
from delta_jax.rl.packing import bucket_rows, micro_batch_shape, row_buckets
from delta_jax.rl.prepare import make_sampler_coefficients
from delta_jax.rl.update_plan import UpdatePlan


def _plan(*overrides):
    return UpdatePlan.from_config(load_config(None, list(overrides)))


def test_plan_from_config():
    plan = _plan("data.max_prompt_length=16", "rollout.max_new_tokens=24")
    assert (plan.packing, plan.row_len, plan.score_from, plan.window) == (True, 39, 0, 39)
    padded = _plan("algo.packing=false", "data.max_prompt_length=16", "rollout.max_new_tokens=24")
    assert (padded.row_len, padded.score_from, padded.window) == (39, 15, 24)
    assert _plan("algo.tokens_per_row=128").row_len == 128
    assert (plan.old_pass, plan.reference, plan.prepares) == (False, False, False)
    assert plan.micro_batch_rows == 0 and plan.coefficients == "in_loss"  # bucketed
    # auto: the demo's DelTA update in micro-batches of 14 packed rows (546 tokens, about 512
    # on CPU): its coefficients come from the sampler's hidden states, before the update.
    one = _plan("data.max_prompt_length=16", "algo.micro_batch_rows=auto")
    assert (one.micro_batch_rows, one.coefficients, one.prepares) == (14, "sampler", True)
    paper = _plan("algo.mini_batches=4", "algo.kl_coef=0.1", "algo.loss=dapo_forking_tokens")
    assert (paper.old_pass, paper.reference, paper.fixed_token_mask) == (True, True, True)


def test_config_errors_at_load():
    with pytest.raises(ConfigError, match="algo.aggregation='token_mean' is not one of"):
        load_config(None, ["algo.aggregation=token_mean"])
    with pytest.raises(ConfigError, match="algo.tokens_per_row=20 must hold the longest"):
        load_config(None, ["algo.tokens_per_row=20"])
    assert _plan("algo.aggregation=seq-mean-token-mean").objective.aggregate is seq_mean_token_mean


def test_row_buckets_are_few():
    sizes = {bucket_rows(r, 8, 512) for r in range(1, 513)}
    assert sizes == {8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512}
    assert all(bucket_rows(r, 8, 512) >= r for r in range(1, 513))


def test_micro_batches_are_a_token_budget():
    """The paper's shape: 512 sequences per update, 16 micro-batches of 32 rows on 4 shards.
    Packed rows fill the micro-batches in order (the train step skips the empty ones): a step
    compiles one program per bucket of rows in one micro-batch, whatever its lengths."""
    paper = (
        "rollout.prompts_per_step=128",
        "rollout.samples_per_prompt=16",
        "algo.mini_batches=4",
        "algo.micro_batches=16",
    )
    packed = _plan(*paper, "algo.micro_batch_rows=bucketed")
    padded = _plan(*paper, "algo.packing=false")
    assert micro_batch_shape(padded, 100, 4) == (16, 32)  # the padded layout never changes
    assert micro_batch_shape(packed, 512, 4) == (16, 32)
    assert micro_batch_shape(packed, 100, 4) == (16, 32)  # 4 micro-batches run, 12 skipped
    assert micro_batch_shape(packed, 20, 4) == (16, 24)  # one, its rows a bucket
    assert row_buckets(packed, 4) == [4, 8, 12, 16, 24, 32]
    assert row_buckets(padded, 4) == [32]
    # One shape per run: micro-batches of micro_batch_rows (rounded up to the shards), as many
    # as one sequence per row needs; its rows never change.
    for rows, want in ((1, (128, 4)), (6, (64, 8)), (32, (16, 32))):
        one = _plan(*paper, f"algo.micro_batch_rows={rows}")
        assert {micro_batch_shape(one, r, 4) for r in (1, 20, 100, 512)} == {want}
        assert row_buckets(one, 4) == [want[1]]
    # auto: 2,048 tokens per shard on TPU, 512 on CPU, at most the micro-batch's rows.
    long = _plan(
        *paper,
        "data.max_prompt_length=64",
        "rollout.max_new_tokens=64",
        "algo.micro_batch_rows=auto",
    )
    assert long.micro_batch_rows == 5  # rows of 127 tokens on CPU
    tpu = UpdatePlan.from_config(load_config(None, [*paper, "algo.micro_batch_rows=auto"]), "tpu")
    assert tpu.micro_batch_rows == 32  # at most the budget (2,048 tokens: 53 rows of 39)
    with pytest.raises(ConfigError, match=r"algo.micro_batch_rows=33 must be in \[1, 32\]"):
        _plan(*paper, "algo.micro_batch_rows=33")


def test_delta_scope_per_shard_reaches_the_losses():
    """algo.delta_scope=per_shard: each batch shard's statistics alone (the reference recipe)."""
    G, H, B = 6, 16, 8
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(B, G, H)).astype(np.float32)
    logprobs = -rng.uniform(size=(B, G)).astype(np.float32)
    advantages = rng.normal(size=B).astype(np.float32)
    lengths = rng.integers(1, G + 1, B).astype(np.int32)
    mask = np.arange(G)[None] < lengths[:, None]
    mesh = sh.make_mesh(2, 1, 1, devices=jax.devices()[:2])
    common = ("rollout.max_new_tokens=6", "algo.micro_batches=2", "rollout.prompts_per_step=4")
    per_shard = _plan(*common, "algo.delta_scope=per_shard")
    inputs = (hidden, logprobs, advantages, lengths)
    coef, _ = make_sampler_coefficients(per_shard, mesh=mesh)(*inputs)
    options = per_shard.objective.delta
    halves = [
        delta_coefficients(hidden[s], logprobs[s], advantages[s], mask[s], options)
        for s in (slice(0, B // 2), slice(B // 2, B))
    ]
    np.testing.assert_allclose(np.asarray(coef), np.concatenate(halves), atol=1e-6)
    whole, _ = make_sampler_coefficients(_plan(*common), mesh=mesh)(*inputs)
    assert np.abs(np.asarray(whole) - np.asarray(coef)).max() > 1e-3  # a different statistic
    with pytest.raises(ValueError, match="needs the run's mesh"):
        make_sampler_coefficients(per_shard)(*inputs)


def test_sampler_coefficients_of_a_multi_turn_rollout():
    """The sampler's coefficients run DelTA over the response tokens the policy drew: the
    observations (False in the action mask) are in no statistic and get 0."""
    G, H, B = 6, 16, 8
    rng = np.random.default_rng(1)
    hidden = rng.normal(size=(B, G, H)).astype(np.float32)
    logprobs = -rng.uniform(size=(B, G)).astype(np.float32)
    advantages = rng.normal(size=B).astype(np.float32)
    lengths = rng.integers(3, G + 1, B).astype(np.int32)
    actions = np.ones((B, G), bool)
    actions[::2, 1:3] = False  # an observation after the first token of every other response
    hidden[~actions] *= 1e3  # far off: counted anywhere, it would show
    within = np.arange(G)[None] < lengths[:, None]
    plan = _plan("rollout.max_new_tokens=6", "algo.micro_batches=2", "rollout.prompts_per_step=4")
    sampler = make_sampler_coefficients(plan)
    options = plan.objective.delta
    coef, _ = sampler(hidden, logprobs, advantages, lengths, actions)
    # jit vs eager float32: summation order only (1e-6, as tests/losses/test_delta.py)
    want = delta_coefficients(hidden, logprobs, advantages, within & actions, options)
    np.testing.assert_allclose(np.asarray(coef), np.asarray(want), rtol=0, atol=1e-6)
    assert np.all(np.asarray(coef)[~actions] == 0)
    single, _ = sampler(hidden, logprobs, advantages, lengths)  # None: every response token
    want = delta_coefficients(hidden, logprobs, advantages, within, options)
    np.testing.assert_allclose(np.asarray(single), np.asarray(want), rtol=0, atol=1e-6)
