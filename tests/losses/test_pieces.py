"""The pieces of policy_loss on their own: surrogates, aggregations, KL estimators, the
truncated importance weight, and their composition.

Each against the float64 NumPy oracle of policy_oracle.py (per-token surrogate and KL values and
derivatives) or a plain loop over responses written here. Tolerances as test_policy.py: float32
JAX vs float64 oracle rtol 1e-5, atol 1e-6; composition vs policy_loss exact (the same
operations).
"""

from __future__ import annotations

import doctest
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from delta_jax.losses import aggregation, kl, surrogates
from delta_jax.losses.aggregation import (
    NAMED_AGGREGATIONS,
    response_count,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_count,
    token_mean,
)
from delta_jax.losses.kl import KL_ESTIMATOR_FNS
from delta_jax.losses.options import LossParts, PolicyLossOptions, TermInputs
from delta_jax.losses.policy import policy_gradient_loss, policy_loss
from delta_jax.losses.surrogates import (
    clipped_surrogate,
    gspo_surrogate,
    sapo_surrogate,
    truncated_importance_weight,
)
from tests.losses.policy_oracle import kl_token, surrogate_token
from tests.losses.test_policy import BATCHES

RTOL, ATOL = 1e-5, 1e-6
f32 = functools.partial(jnp.asarray, dtype=jnp.float32)

# name -> (surrogate with its hyperparameters, the oracle's settings)
SURROGATES = {
    "clipped": (
        functools.partial(clipped_surrogate, clip_eps_low=0.2, clip_eps_high=0.28),
        dict(loss_type="ppo", eps_low=0.2, eps_high=0.28, dual_c=10.0),
    ),
    "clipped_no_dual": (
        functools.partial(clipped_surrogate, clip_eps_high=0.2, dual_clip_c=None),
        dict(loss_type="ppo", eps_low=0.2, eps_high=0.2, dual_c=None),
    ),
    "gspo": (gspo_surrogate, dict(loss_type="gspo", eps_low=3e-4, eps_high=4e-4, dual_c=10.0)),
    "sapo": (
        functools.partial(sapo_surrogate, tau_pos=1.0, tau_neg=1.05),
        dict(loss_type="sapo", eps_low=0.0, eps_high=0.0, dual_c=None),
    ),
}


def _batch(name):
    return BATCHES["gspo" if name == "gspo" else "ppo"]


def _per_token_oracle(name, batch, adv):
    """Per-token value and d/d logprobs of the surrogate, float64, 0 off the mask."""
    _, settings = SURROGATES[name]
    lp, old, m = batch["lp"], batch["old"], batch["mask"]
    value, grad = np.zeros_like(lp), np.zeros_like(lp)
    for i, t in zip(*np.nonzero(m), strict=True):
        seq = (lp[i] - old[i])[m[i]].mean()
        x = seq if name == "gspo" else lp[i, t] - old[i, t]
        value[i, t], grad[i, t] = surrogate_token(
            x, adv[i, t], tau_pos=1.0, tau_neg=1.05, **settings
        )
    return value, grad


@pytest.mark.parametrize("name", list(SURROGATES))
def test_surrogate_matches_oracle(name):
    """Value per token and the gradient of their mean over valid tokens, the token-mean loss
    (GSPO's token form: each token's derivative is its own, ``s_i ∇logπ_t``), against the
    oracle's surrogate."""
    batch = _batch(name)
    adv = batch["adv"][:, None] * batch["coef"]
    if name == "gspo":  # the oracle's sequence-level gradient needs weights constant per row
        adv = np.repeat(batch["adv"][:, None], adv.shape[1], 1)
    fn, settings = SURROGATES[name]
    args = (f32(batch["old"]), f32(adv), batch["mask"])
    loss, metrics = fn(f32(batch["lp"]), *args)
    n = batch["mask"].sum()
    grad = jax.grad(lambda x: jnp.sum(fn(x, *args)[0]) / n)(f32(batch["lp"]))
    want, want_grad = _per_token_oracle(name, batch, adv)
    np.testing.assert_allclose(loss, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, want_grad / n, rtol=RTOL, atol=ATOL)
    clipped = settings["loss_type"] != "sapo"
    assert {"ratio_mean", "ratio_min", "ratio_max"} <= set(metrics)
    assert ("clip_frac_upper" in metrics) == clipped
    assert ("dual_clip_frac" in metrics) == (settings["dual_c"] is not None)


@pytest.mark.parametrize("name", list(SURROGATES))
def test_surrogate_ignores_padding(name):
    """NaN and inf on padding reach neither the per-token loss nor the gradient."""
    batch = _batch(name)
    fn, _ = SURROGATES[name]
    pad = ~batch["mask"]
    lp, old, adv = (np.array(batch[k], np.float32) for k in ("lp", "old", "coef"))
    lp[pad], old[pad], adv[pad] = np.nan, np.inf, np.nan
    value = lambda x: jnp.sum(fn(x, f32(old), f32(adv), batch["mask"])[0])
    loss, grad = jax.value_and_grad(value)(f32(lp))
    assert np.isfinite(loss) and np.all(np.asarray(grad)[pad] == 0)


@pytest.mark.parametrize("name", ["clipped", "sapo", "gspo"])
def test_surrogate_check_grads(name):
    """Reverse-mode gradients equal numerical ones (float64, away from the clip kinks; GSPO
    with per-row-constant advantages, where its token form is the exact gradient)."""
    batch = _batch(name)
    fn, _ = SURROGATES[name]
    with jax.enable_x64(True):
        adv = np.repeat(batch["adv"][:, None], batch["lp"].shape[1], 1)
        args = (jnp.asarray(batch["old"]), jnp.asarray(adv), batch["mask"])
        check_grads(lambda x: jnp.sum(fn(x, *args)[0]), (jnp.asarray(batch["lp"]),), 1, ["rev"])


def test_surrogate_jit_equals_eager_and_does_not_recompile():
    batch = BATCHES["ppo"]
    fn = jax.jit(lambda lp, old, adv, m, eps: clipped_surrogate(lp, old, adv, m, clip_eps_low=eps))
    args = [f32(batch[k]) for k in ("lp", "old", "coef")] + [batch["mask"]]
    eager = clipped_surrogate(*args, clip_eps_low=0.2)
    jitted = fn(*args, 0.2)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    fn(*args, 0.25)
    assert fn._cache_size() == 1


def test_truncated_importance_weight():
    batch = BATCHES["ppo"]
    m = batch["mask"]
    want = np.where(m, np.minimum(np.exp(batch["old"] - batch["rollout"]), 1.5), 1.0)
    got = truncated_importance_weight(f32(batch["old"]), f32(batch["rollout"]), m, cap=1.5)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    uncapped = truncated_importance_weight(f32(batch["old"]), f32(batch["rollout"]), m)
    assert float(jnp.max(uncapped)) > 1.5


@pytest.mark.parametrize("name", list(KL_ESTIMATOR_FNS))
def test_kl_estimator_matches_oracle(name):
    batch = BATCHES["ppo"]
    m = batch["mask"]
    fn = KL_ESTIMATOR_FNS[name]
    lp, ref = f32(batch["lp"]), f32(batch["ref"])
    value = fn(lp, ref, m)
    grad = jax.grad(lambda x: jnp.sum(fn(x, ref, m)))(lp)
    want = np.zeros_like(batch["lp"])
    want_grad = np.zeros_like(want)
    for i, t in zip(*np.nonzero(m), strict=True):
        want[i, t], want_grad[i, t] = kl_token(batch["lp"][i, t], batch["ref"][i, t], name)
    np.testing.assert_allclose(value, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, want_grad, rtol=RTOL, atol=ATOL)


# --- aggregations ------------------------------------------------------------------------------


def _responses(mask, segment_ids):
    """Lists of (row, t) per response: each row, or each (row, segment) of packed rows."""
    groups = {}
    for i, t in zip(*np.nonzero(mask), strict=True):
        key = (i, 0 if segment_ids is None else int(segment_ids[i, t]))
        groups.setdefault(key, []).append((i, t))
    return list(groups.values())


def _aggregate_ref(fn, x, mask, segment_ids, C):
    """float64 loop over responses; returns the loss and its derivative w.r.t. x."""
    responses = _responses(mask, segment_ids)
    n_tokens, n_responses = int(mask.sum()), len(responses)
    total, grad = 0.0, np.zeros_like(x)
    for tokens in responses:
        if fn is token_mean:
            share = 1.0 / max(n_tokens, 1)
        elif fn is seq_mean_token_mean:
            share = 1.0 / (len(tokens) * n_responses)
        elif fn is seq_mean_token_sum:
            share = 1.0 / n_responses
        else:
            share = 1.0 / (C * n_responses)
        for i, t in tokens:
            total += share * x[i, t]
            grad[i, t] = share
    return total, grad


def _packed(mask):
    """Segment ids splitting each row's valid tokens into runs of 3 (1, 2, ...; 0 on padding)."""
    return np.where(mask, np.arange(mask.shape[1])[None] // 3 + 1, 0).astype(np.int32)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("name", list(NAMED_AGGREGATIONS))
def test_aggregation_matches_loop_oracle(name, packed):
    batch = BATCHES["ppo"]
    fn, count = NAMED_AGGREGATIONS[name]
    mask = batch["mask"]
    seg = _packed(mask) if packed else None
    C = 12 if packed else mask.shape[1]
    if fn is seq_mean_token_sum_norm and packed:
        fn = functools.partial(fn, max_response_length=C)
    x = np.where(mask, batch["entropy"], np.nan)  # padding never read
    value, grad = jax.value_and_grad(lambda y: fn(y, mask, segment_ids=seg))(f32(x))
    base = getattr(fn, "func", fn)
    want, want_grad = _aggregate_ref(base, np.nan_to_num(x), mask, seg, C)
    np.testing.assert_allclose(value, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, want_grad, rtol=RTOL, atol=ATOL)
    n = len(_responses(mask, seg)) if count is response_count else mask.sum()
    assert float(count(mask, seg)) == n
    # An explicit normaliser replaces the count; an empty batch's loss is 0.
    explicit = fn(f32(x), mask, normalizer=37.0, segment_ids=seg)
    np.testing.assert_allclose(explicit * 37.0, value * n, rtol=RTOL, atol=ATOL)
    empty = np.zeros_like(mask)
    assert float(fn(f32(x), empty, segment_ids=None if seg is None else seg * 0)) == 0.0


def test_counts():
    mask = np.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 1]])
    seg = np.array([[1, 2, 0, 0], [0, 0, 0, 0], [1, 0, 2, 2]], np.int32)
    assert float(token_count(mask)) == 5.0
    assert float(response_count(mask)) == 2.0
    assert float(response_count(mask, seg)) == 4.0
    with pytest.raises(ValueError, match="segment_ids must be integer with shape"):
        response_count(mask, seg[:, :3])
    with pytest.raises(ValueError, match="needs max_response_length"):
        seq_mean_token_sum_norm(f32(mask), mask, segment_ids=seg)


# --- composition -------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation_name", list(NAMED_AGGREGATIONS))
@pytest.mark.parametrize("loss_type", ["ppo", "gspo", "sapo"])
def test_policy_gradient_loss_is_policy_loss_by_function(loss_type, aggregation_name):
    """The functions passed by hand give exactly policy_loss's named result."""
    batch = BATCHES[loss_type]
    surrogate = {
        "ppo": functools.partial(clipped_surrogate, clip_eps_high=0.2, dual_clip_c=3.0),
        "gspo": functools.partial(gspo_surrogate, clip_eps_low=0.01, clip_eps_high=0.02),
        "sapo": functools.partial(sapo_surrogate, tau_pos=0.5, tau_neg=2.0),
    }[loss_type]
    named = {
        "ppo": dict(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=3.0),
        "gspo": dict(clip_eps_low=0.01, clip_eps_high=0.02),
        "sapo": dict(sapo_tau_pos=0.5, sapo_tau_neg=2.0),
    }[loss_type]
    aggregate, _ = NAMED_AGGREGATIONS[aggregation_name]
    if aggregation_name == "seq-mean-token-sum-norm":
        aggregate = functools.partial(aggregate, max_response_length=16)
    args = [f32(batch[k]) for k in ("lp", "old", "adv")] + [batch["mask"]]
    data = dict(
        coefficients=f32(batch["coef"]),
        token_mask=batch["token_mask"],
        terms=TermInputs(f32(batch["rollout"]), f32(batch["ref"]), f32(batch["entropy"])),
    )
    weights = dict(tis_cap=2.0, kl_coef=0.1, entropy_coef=0.02)
    parts = LossParts(surrogate=surrogate, aggregate=aggregate, kl=kl.kl_k2, **weights)
    by_function = policy_gradient_loss(*args, parts, **data)
    options = PolicyLossOptions(
        loss_type=loss_type,
        aggregation=aggregation_name,
        max_response_length=16,
        kl_estimator="k2",
        **named,
        **weights,
    )
    by_name = policy_loss(*args, options, **data)
    assert jax.tree.structure(by_function) == jax.tree.structure(by_name)
    for a, b in zip(jax.tree.leaves(by_function), jax.tree.leaves(by_name), strict=True):
        np.testing.assert_array_equal(a, b)


def test_on_policy_loss_is_minus_mean_advantage():
    """Sanity of the composition: r = 1 everywhere, so every surrogate is −A per token."""
    batch = BATCHES["ppo"]
    lp = f32(batch["lp"])
    adv = f32(batch["adv"])
    for surrogate in (clipped_surrogate, gspo_surrogate):
        parts = LossParts(surrogate=surrogate)
        loss, metrics = policy_gradient_loss(lp, lp, adv, batch["mask"], parts)
        n = batch["mask"].sum()
        want = -(batch["adv"][:, None] * batch["mask"]).sum() / n
        assert math.isclose(float(loss), want, rel_tol=1e-6, abs_tol=1e-7)
        assert float(metrics["ratio_max"]) == 1.0


@pytest.mark.parametrize("module", [surrogates, aggregation, kl])
def test_docstring_examples_run(module):
    result = doctest.testmod(module, verbose=False)
    assert result.attempted > 0 and result.failed == 0
