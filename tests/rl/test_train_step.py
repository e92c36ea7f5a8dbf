"""The jitted update: micro-batching, fixed coefficients, skipping, recompilation, objectives."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from delta_jax.config import load_config
from delta_jax.losses import delta_coefficients
from delta_jax.models import ModelConfig, Transformer
from delta_jax.rl.objectives import resolve_objective
from delta_jax.rl.train_step import (
    TrainBatch,
    init_train_state,
    make_old_pass,
    make_optimizer,
    make_train_step,
)

P, G, B = 6, 10, 8


@pytest.fixture(scope="module")
def setup():
    model = Transformer(ModelConfig.tiny("qwen3"), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 256, (B, P + G)).astype(np.int32)
    mask = np.ones((B, P + G), bool)
    mask[:3, :2] = False  # left-padded prompts
    lengths = rng.integers(3, G + 1, B)
    response = np.arange(G)[None] < lengths[:, None]
    mask[:, P:] = response
    # Mixed advantages plus one zero-advantage group, as GRPO produces.
    advantages = np.array([1.2, -0.4, 0.8, -1.6, 0.0, 0.0, 0.5, -0.5], np.float32)
    return graphdef, params, ids, mask, response, advantages


def _objective(loss, **kw):
    overrides = [f"algo.loss={loss}", *(f"algo.{k}={v}" for k, v in kw.items())]
    return resolve_objective(load_config(None, overrides).algo, max_response_length=G)


def _batch(ids, mask, response, advantages, micro, **extra):
    split = lambda x: None if x is None else jnp.asarray(x).reshape(micro, -1, *x.shape[1:])
    return TrainBatch(
        input_ids=split(ids),
        attention_mask=split(mask),
        response_mask=split(response),
        advantages=split(advantages),
        **{k: split(v) for k, v in extra.items()},
    )


def _run(graphdef, params, objective, batch, lr=1e-2, optimizer=None):
    optimizer = optimizer or make_optimizer(load_config(None, [f"optim.lr={lr}"]).optim, 10)
    step = make_train_step(graphdef, optimizer, objective, temperature=1.0, gen_len=G)
    state = init_train_state(jax.tree.map(jnp.copy, params), optimizer)
    return step(state, batch)


def _max_diff(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


# Plain SGD with lr 1: the parameter change *is* the accumulated gradient, so comparing
# parameters compares gradients. (Adam's first step is ~lr*sign(g) per coordinate, which turns
# float32 rounding in near-zero gradient entries into lr-sized differences.)
SGD = optax.sgd(1.0)


def test_four_micro_batches_equal_the_whole_batch(setup):
    """DelTA inline on the whole batch == 4 micro-batches with the coefficients fixed up front."""
    graphdef, params, ids, mask, response, adv = setup
    objective = _objective("delta")
    whole_state, whole = _run(
        graphdef, params, objective, _batch(ids, mask, response, adv, 1), optimizer=SGD
    )
    # Coefficients from one old-policy pass (the same parameters), held fixed.
    old_pass = make_old_pass(graphdef, temperature=1.0, gen_len=G, return_entropy=False)
    logp, _, hidden = old_pass(params, jnp.asarray(ids), jnp.asarray(mask))
    coef = delta_coefficients(hidden, logp, jnp.asarray(adv), jnp.asarray(response))
    micro_batch = _batch(ids, mask, response, adv, 4, coefficients=coef)
    micro_state, micro = _run(graphdef, params, objective, micro_batch, optimizer=SGD)
    assert abs(float(whole["loss"]) - float(micro["loss"])) <= 1e-5
    assert abs(float(whole["grad_norm"]) - float(micro["grad_norm"])) <= 1e-5
    assert _max_diff(whole_state.params, micro_state.params) <= 1e-5
    # And the update actually moved the parameters (the comparison is not vacuous).
    assert _max_diff(whole_state.params, params) > 1e-4
    assert float(whole["delta/gamma_pos"]) > 0
    # The real optimiser (AdamW) sees the same loss and gradient norm.
    _, whole_adam = _run(graphdef, params, objective, _batch(ids, mask, response, adv, 1))
    _, micro_adam = _run(graphdef, params, objective, micro_batch)
    assert abs(float(whole_adam["loss"]) - float(micro_adam["loss"])) <= 1e-5
    assert abs(float(whole_adam["grad_norm"]) - float(micro_adam["grad_norm"])) <= 1e-5


@pytest.mark.parametrize("loss", ["dapo", "grpo", "dr_grpo", "gspo", "sapo"])
def test_micro_batching_is_exact_for_every_objective(setup, loss):
    graphdef, params, ids, mask, response, adv = setup
    objective = _objective(loss)
    s1, m1 = _run(graphdef, params, objective, _batch(ids, mask, response, adv, 1), optimizer=SGD)
    s4, m4 = _run(graphdef, params, objective, _batch(ids, mask, response, adv, 4), optimizer=SGD)
    assert abs(float(m1["loss"]) - float(m4["loss"])) <= 1e-5
    assert _max_diff(s1.params, s4.params) <= 1e-5


def test_delta_with_unit_range_equals_dapo(setup):
    graphdef, params, ids, mask, response, adv = setup
    batch = _batch(ids, mask, response, adv, 1)
    s_delta, m_delta = _run(graphdef, params, _objective("delta", lam_min=1.0, lam_max=1.0), batch)
    s_dapo, m_dapo = _run(graphdef, params, _objective("dapo"), batch)
    assert abs(float(m_delta["loss"]) - float(m_dapo["loss"])) <= 1e-6
    assert _max_diff(s_delta.params, s_dapo.params) <= 1e-6


def test_delta_changes_the_update(setup):
    """With the default range the coefficients are not all one, so the update differs from DAPO."""
    graphdef, params, ids, mask, response, adv = setup
    batch = _batch(ids, mask, response, adv, 1)
    s_delta, m_delta = _run(graphdef, params, _objective("delta"), batch)
    s_dapo, _ = _run(graphdef, params, _objective("dapo"), batch)
    assert float(m_delta["coef_std"]) > 1e-3
    assert _max_diff(s_delta.params, s_dapo.params) > 1e-6


def test_non_finite_gradient_skips_the_update(setup):
    graphdef, params, ids, mask, response, adv = setup
    objective = _objective("dapo")
    bad = adv.copy()
    bad[0] = np.nan
    optimizer = make_optimizer(load_config(None).optim, 10)
    step = make_train_step(graphdef, optimizer, objective, temperature=1.0, gen_len=G)
    state = init_train_state(jax.tree.map(jnp.copy, params), optimizer)
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = step(state, _batch(ids, mask, response, bad, 1))
    assert float(metrics["update_skipped"]) == 1.0
    assert int(state.skipped) == 1 and int(state.step) == 0
    assert _max_diff(state.params, before) == 0.0
    state, metrics = step(state, _batch(ids, mask, response, adv, 1))
    assert float(metrics["update_skipped"]) == 0.0 and int(state.step) == 1


def test_step_compiles_once(setup):
    graphdef, params, ids, mask, response, adv = setup
    optimizer = make_optimizer(load_config(None).optim, 10)
    step = make_train_step(graphdef, optimizer, _objective("delta"), temperature=1.0, gen_len=G)
    state = init_train_state(jax.tree.map(jnp.copy, params), optimizer)
    for i in range(3):
        state, _ = step(state, _batch(ids, mask, response, adv * (i + 1), 1))
    assert step._cache_size() == 1


def test_inline_delta_refuses_micro_batches(setup):
    graphdef, params, ids, mask, response, adv = setup
    with pytest.raises(ValueError, match="micro_batches > 1"):
        _run(graphdef, params, _objective("delta"), _batch(ids, mask, response, adv, 2))
