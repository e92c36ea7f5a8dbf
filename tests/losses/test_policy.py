"""delta_jax.losses.policy against the float64 NumPy oracle in policy_oracle.py.

Tolerances (float32 JAX vs float64 oracle, values of order 1): rtol 1e-5, atol 1e-6 for losses,
metrics and gradients. Oracle hand gradients vs its own central finite differences (float64):
rtol 1e-6, atol 1e-9. jit vs eager: rtol 1e-6, atol 1e-7 (XLA may reorder float32 sums).
"""

from __future__ import annotations

import dataclasses
import doctest
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from delta_jax.losses import PolicyLossOptions, TermInputs, advantages, policy
from delta_jax.losses.policy import (
    AGGREGATIONS,
    LOSS_TYPES,
    forking_tokens_mask,
    loss_normalizer,
    policy_loss,
)
from tests.losses.policy_oracle import forking_mask_ref, policy_loss_ref

RTOL, ATOL = 1e-5, 1e-6
_OPTION_FIELDS = {f.name for f in dataclasses.fields(PolicyLossOptions)}


def new_form_loss(lp, old, adv, mask, **kwargs):
    """policy_loss in the options form, given the earlier loose keywords (the oracle's); the
    loose form itself is checked in test_bad_input_raises and tests/losses/test_options.py."""
    options = PolicyLossOptions(**{k: v for k, v in kwargs.items() if k in _OPTION_FIELDS})
    terms = TermInputs(**{k: v for k, v in kwargs.items() if k in TermInputs._fields})
    rest = {k: v for k, v in kwargs.items() if k not in _OPTION_FIELDS | set(TermInputs._fields)}
    return policy_loss(lp, old, adv, mask, options, terms=terms, **rest)


B, T = 7, 8
LENGTHS = np.array([8, 5, 1, 0, 7, 3, 6])
ADV = np.array([1.2, -0.7, 0.0, 0.9, -1.3, -0.4, 0.8])
# GSPO: per-response mean log-ratio, placed to reach every region of the 3e-4 / 4e-4 clip:
# inside (rows 0, 1), upper clip (6), lower clip (5), dual clip r = 12 (4); row 2 has Â = 0.
SEQ_LOG_RATIO = np.array([1e-4, -1e-4, 0.1, 0.0, math.log(12.0), -0.3, 0.3])
OPTIONS = (
    "plain",
    "coef",
    "no_dual",
    "tis",
    "tis_uncapped",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "entropy",
    "token_mask",
    "token_adv",
    "normalizer",
    "all",
)


def make_batch(loss_type: str, seed: int = 0) -> dict[str, np.ndarray]:
    """A padded batch whose log-ratios hit every clip region and stay >= 0.02 from its kinks."""
    rng = np.random.default_rng(seed)
    mask = np.arange(T)[None, :] < LENGTHS[:, None]
    old = -rng.uniform(0.05, 3.0, (B, T))
    delta = rng.uniform(-0.6, 0.6, (B, T))
    if loss_type == "gspo":
        row_mean = (delta * mask).sum(1) / np.maximum(mask.sum(1), 1)
        delta = delta - row_mean[:, None] + SEQ_LOG_RATIO[:, None]
    else:
        delta[0, 3] = delta[6, 1] = math.log(11.0)
        delta[1, 2] = delta[4, 5] = math.log(12.0)  # past the dual clip, negative advantage
        kinks = np.log([0.8, 1.28, 10.0])
        near = np.min(np.abs(delta[..., None] - kinks), axis=-1) < 0.02
        delta[near] += 0.05
    lp = old + delta
    # Finite garbage on padding (NaN padding has its own test).
    lp[~mask], old[~mask] = 0.5, -7.0
    return {
        "lp": lp,
        "old": old,
        "adv": ADV.copy(),
        "adv_tok": rng.normal(0.0, 1.0, (B, T)),
        "mask": mask,
        "coef": rng.uniform(0.7, 1.4, (B, T)),
        "rollout": old + rng.uniform(-0.8, 0.8, (B, T)),
        "ref": lp + rng.uniform(-0.5, 0.5, (B, T)),
        "entropy": rng.uniform(0.0, 2.0, (B, T)),
        "token_mask": rng.uniform(size=(B, T)) < 0.6,
    }


BATCHES = {name: make_batch(name) for name in LOSS_TYPES}


def options(name: str, batch: dict) -> dict:
    """Keyword arguments of policy_loss (and the oracle) for one named option set."""
    kl = {"ref_logprobs": batch["ref"], "kl_coef": 0.1}
    table = {
        "plain": {},
        "coef": {"coefficients": batch["coef"]},
        "no_dual": {"coefficients": batch["coef"], "dual_clip_c": None},
        "tis": {"rollout_logprobs": batch["rollout"], "tis_cap": 1.5},
        "tis_uncapped": {"rollout_logprobs": batch["rollout"]},
        "kl_k1": {**kl, "kl_estimator": "k1"},
        "kl_k2": {**kl, "kl_estimator": "k2"},
        "kl_k3": {**kl, "kl_estimator": "k3"},
        "entropy": {"entropy": batch["entropy"], "entropy_coef": 0.05},
        "token_mask": {"token_mask": batch["token_mask"], "coefficients": batch["coef"]},
        "token_adv": {"advantages": batch["adv_tok"]},
        "normalizer": {"normalizer": 37.0, "max_response_length": 16},
        "all": {
            "coefficients": batch["coef"],
            "rollout_logprobs": batch["rollout"],
            "tis_cap": 2.0,
            **kl,
            "entropy": batch["entropy"],
            "entropy_coef": 0.02,
            "token_mask": batch["token_mask"],
        },
    }
    return table[name]


def jax_loss(lp, old, adv, mask, kwargs):
    """(loss, metrics), d/d logprobs and d/d entropy (None without entropy), eagerly."""
    kwargs = dict(kwargs)
    entropy = kwargs.pop("entropy", None)

    def f(x, ent):
        return new_form_loss(x, old, adv, mask, entropy=ent, **kwargs)

    if entropy is None:
        (loss, metrics), g = jax.value_and_grad(lambda x: f(x, None), has_aux=True)(lp)
        return loss, metrics, g, None
    (loss, metrics), (g, g_ent) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
        lp, jnp.asarray(entropy, jnp.float32)
    )
    return loss, metrics, g, g_ent


def to_f32(kwargs: dict) -> dict:
    return {
        k: jnp.asarray(v, jnp.float32) if isinstance(v, np.ndarray) and v.dtype != bool else v
        for k, v in kwargs.items()
    }


def check_against_oracle(loss_type: str, opts: dict) -> None:
    batch = BATCHES[loss_type]
    kwargs = {"loss_type": loss_type, **opts}
    adv = kwargs.pop("advantages", batch["adv"])
    ref = policy_loss_ref(batch["lp"], batch["old"], adv, batch["mask"], **kwargs)
    loss, metrics, grad, grad_ent = jax_loss(
        jnp.asarray(batch["lp"], jnp.float32),
        jnp.asarray(batch["old"], jnp.float32),
        jnp.asarray(adv, jnp.float32),
        batch["mask"],
        to_f32(kwargs),
    )
    np.testing.assert_allclose(loss, ref[0], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, ref[1], rtol=RTOL, atol=ATOL)
    if ref[2] is not None:
        np.testing.assert_allclose(grad_ent, ref[2], rtol=RTOL, atol=ATOL)
    assert sorted(metrics) == sorted(ref[3])
    for key, value in ref[3].items():
        np.testing.assert_allclose(metrics[key], value, rtol=RTOL, atol=ATOL, err_msg=key)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_aggregations_match_oracle(loss_type, aggregation):
    batch = BATCHES[loss_type]
    check_against_oracle(loss_type, {"aggregation": aggregation, "coefficients": batch["coef"]})
    opts = {"aggregation": aggregation, **options("all", batch), "max_response_length": 12}
    check_against_oracle(loss_type, opts)


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_options_match_oracle(loss_type, option):
    check_against_oracle(loss_type, options(option, BATCHES[loss_type]))


def test_gspo_with_ppo_clip_range_matches_oracle():
    opts = {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "aggregation": "seq-mean-token-mean"}
    check_against_oracle("gspo", opts)


def test_defaults_are_the_spec_dapo_objective():
    """DELTA_SPEC §4: ε_low 0.2, ε_high 0.28, dual clip c = 10, token-mean."""
    batch = BATCHES["ppo"]
    args = (batch["lp"], batch["old"], batch["adv"], batch["mask"])
    spec = {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip_c": 10.0}
    ref = policy_loss_ref(*args, coefficients=batch["coef"], **spec)
    loss, _ = policy_loss(*(jnp.asarray(a) for a in args), coefficients=batch["coef"])
    np.testing.assert_allclose(loss, ref[0], rtol=RTOL, atol=ATOL)
    # Sanity of the oracle itself on one token: A > 0, r inside the clip range.
    assert math.isclose(policy_loss_ref([[0.1]], [[0.0]], [2.0], [[1]])[0], -2 * math.exp(0.1))


@pytest.mark.parametrize(
    "loss_type, option",
    [(lt, op) for lt in ("ppo", "sapo") for op in OPTIONS]
    + [("gspo", op) for op in ("plain", "no_dual", "kl_k1", "kl_k2", "kl_k3", "entropy")],
)
def test_oracle_gradient_matches_finite_differences(loss_type, option):
    """The oracle's hand-derived gradient is the derivative of its value.

    For GSPO this holds only when the per-token weights are constant within each response
    (then the GSPO-token gradient equals the sequence-level one), hence the restricted options
    and no coefficients.
    """
    batch = BATCHES[loss_type]
    opts = {"loss_type": loss_type, **options(option, batch)}
    if loss_type == "gspo":
        opts.pop("coefficients", None)
    adv = opts.pop("advantages", batch["adv"])
    _, grad, _, _ = policy_loss_ref(batch["lp"], batch["old"], adv, batch["mask"], **opts)
    h = 1e-6
    fd = np.zeros_like(grad)
    for i, t in zip(*np.nonzero(batch["mask"]), strict=True):
        up, down = batch["lp"].copy(), batch["lp"].copy()
        up[i, t] += h
        down[i, t] -= h
        fd[i, t] = (
            policy_loss_ref(up, batch["old"], adv, batch["mask"], **opts)[0]
            - policy_loss_ref(down, batch["old"], adv, batch["mask"], **opts)[0]
        ) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_unit_coefficients_equal_no_coefficients(loss_type):
    batch = BATCHES[loss_type]
    args = [jnp.asarray(batch[k], jnp.float32) for k in ("lp", "old", "adv")] + [batch["mask"]]
    plain = jax_loss(*args, {"loss_type": loss_type})
    ones = jax_loss(*args, {"loss_type": loss_type, "coefficients": jnp.ones((B, T))})
    np.testing.assert_array_equal(plain[0], ones[0])
    np.testing.assert_array_equal(plain[2], ones[2])


@pytest.mark.parametrize(
    "loss_type, option",
    [("ppo", "all"), ("ppo", "kl_k1"), ("ppo", "kl_k2"), ("ppo", "no_dual"), ("sapo", "all")]
    + [("gspo", "plain"), ("gspo", "no_dual"), ("gspo", "kl_k3"), ("gspo", "entropy")],
)
def test_check_grads(loss_type, option):
    """Reverse-mode gradients equal numerical ones (float64, points away from the clip kinks).

    GSPO uses per-response-constant weights: its token-level form is only then the exact
    gradient of its own value (see test_oracle_gradient_matches_finite_differences).
    """
    batch = BATCHES[loss_type]
    with jax.enable_x64(True):
        opts = {
            k: jnp.asarray(v, jnp.float64) if isinstance(v, np.ndarray) and v.dtype != bool else v
            for k, v in options(option, batch).items()
            if not (loss_type == "gspo" and k == "coefficients")
        }
        entropy = opts.pop("entropy", None)
        lp, old, adv = (jnp.asarray(batch[k], jnp.float64) for k in ("lp", "old", "adv"))

        def f(x, ent):
            return new_form_loss(
                x, old, adv, batch["mask"], loss_type=loss_type, entropy=ent, **opts
            )[0]

        if entropy is None:
            check_grads(lambda x: f(x, None), (lp,), order=1, modes=["rev"])
        else:
            check_grads(f, (lp, entropy), order=1, modes=["rev"])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_jit_equals_eager(loss_type):
    batch = BATCHES[loss_type]
    kwargs = to_f32(
        {"loss_type": loss_type, "aggregation": "seq-mean-token-mean", **options("all", batch)}
    )
    entropy = kwargs.pop("entropy")
    args = [jnp.asarray(batch[k], jnp.float32) for k in ("lp", "old", "adv")] + [batch["mask"]]

    def f(lp, ent, old, adv, mask):
        return new_form_loss(lp, old, adv, mask, entropy=ent, **kwargs)

    vg = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)
    eager = vg(args[0], entropy, *args[1:])
    jitted = jax.jit(vg)(args[0], entropy, *args[1:])
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_second_call_does_not_recompile():
    @functools.partial(jax.jit, static_argnames=("loss_type",))
    def step(lp, old, adv, mask, coef, clip_low, kl_coef, ref, loss_type):
        def f(x):
            return new_form_loss(
                x,
                old,
                adv,
                mask,
                coefficients=coef,
                loss_type=loss_type,
                clip_eps_low=clip_low,
                ref_logprobs=ref,
                kl_coef=kl_coef,
            )

        return jax.value_and_grad(f, has_aux=True)(lp)

    first, second = make_batch("ppo", seed=1), make_batch("ppo", seed=2)
    calls = [
        [jnp.asarray(b[k], jnp.float32) for k in ("lp", "old", "adv", "mask", "coef")]
        + [clip, kl, jnp.asarray(b["ref"], jnp.float32)]
        for b, clip, kl in ((first, 0.2, 0.1), (second, 0.25, 0.3))
    ]
    compiles = []
    listener = lambda event, duration, **kw: (  # noqa: ARG005
        compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
    )
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        step(*calls[0], loss_type="ppo")[0][0].block_until_ready()
        n_first = len(compiles)
        out = step(*calls[1], loss_type="ppo")
        out[0][0].block_until_ready()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert n_first >= 1
    assert len(compiles) == n_first, "second call with the same shapes recompiled"
    assert step._cache_size() == 1
    assert not np.isclose(out[0][0], step(*calls[0], loss_type="ppo")[0][0])


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_sum_to_full_batch(loss_type, aggregation):
    """Split rows into micro-batches (each trimmed to its own longest response) and pass the
    full batch's normaliser: losses and gradients add up to the full-batch ones."""
    batch = BATCHES[loss_type]
    kw = {"loss_type": loss_type, "aggregation": aggregation, "max_response_length": T}
    kw.update(coefficients=batch["coef"], ref_logprobs=batch["ref"], kl_coef=0.1)
    kw = to_f32(kw)
    full_norm = loss_normalizer(batch["mask"], aggregation)
    lp = jnp.asarray(batch["lp"], jnp.float32)
    args = (jnp.asarray(batch["old"], jnp.float32), jnp.asarray(batch["adv"]), batch["mask"])
    full_loss, _, full_grad, _ = jax_loss(lp, *args, kw)

    total, grads, norms = 0.0, [], 0.0
    for rows in (slice(0, 3), slice(3, 7)):
        width = max(int(LENGTHS[rows].max()), 1)

        def cut(x, rows=rows, width=width):
            return x[rows] if x.ndim == 1 else x[rows, :width]

        sub = {k: cut(v) if isinstance(v, jax.Array) and v.ndim == 2 else v for k, v in kw.items()}
        loss, _, grad, _ = jax_loss(
            cut(lp), *(cut(jnp.asarray(a)) for a in args), {**sub, "normalizer": full_norm}
        )
        total += float(loss)
        grads.append(np.pad(grad, ((0, 0), (0, T - width))))
        norms += float(loss_normalizer(cut(jnp.asarray(batch["mask"])), aggregation))
    assert norms == float(full_norm)
    np.testing.assert_allclose(total, full_loss, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.concatenate(grads), full_grad, rtol=1e-6, atol=1e-9)


def test_loss_normalizer_counts():
    mask = BATCHES["ppo"]["mask"]
    assert float(loss_normalizer(mask)) == LENGTHS.sum()
    for agg in AGGREGATIONS[1:]:
        assert float(loss_normalizer(mask, agg)) == np.count_nonzero(LENGTHS)


def test_nan_padding_does_not_leak():
    batch = BATCHES["gspo"]
    pad = ~batch["mask"]

    def run(fill):
        arrays = {
            k: np.where(pad, fill, batch[k])
            for k in ("lp", "old", "coef", "rollout", "ref", "entropy")
        }
        kw = {
            "loss_type": "gspo",
            "coefficients": arrays["coef"],
            "tis_cap": 2.0,
            "rollout_logprobs": arrays["rollout"],
            "ref_logprobs": arrays["ref"],
            "kl_coef": 0.1,
            "entropy": arrays["entropy"],
            "entropy_coef": 0.1,
        }
        args = [jnp.asarray(arrays[k], jnp.float32) for k in ("lp", "old")]
        return jax_loss(args[0], args[1], jnp.asarray(batch["adv"]), batch["mask"], to_f32(kw))

    clean, dirty = run(0.0), run(np.nan)
    for a, b in zip(jax.tree.leaves(clean), jax.tree.leaves(dirty), strict=True):
        np.testing.assert_array_equal(a, b)
    assert np.all(np.asarray(dirty[2])[pad] == 0)


def test_low_precision_inputs_compute_in_float32():
    """bf16 log-probs are upcast: same loss as float32 on the same (rounded) values."""
    batch = BATCHES["ppo"]
    lp16, old16 = (jnp.asarray(batch[k], jnp.bfloat16) for k in ("lp", "old"))
    kw = to_f32(options("all", batch))
    adv = jnp.asarray(batch["adv"])
    loss16, _, grad16, _ = jax_loss(lp16, old16, adv, batch["mask"], kw)
    loss32, _, grad32, _ = jax_loss(
        lp16.astype(jnp.float32), old16.astype(jnp.float32), adv, batch["mask"], kw
    )
    assert loss16.dtype == jnp.float32 and grad16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(loss16, loss32)
    np.testing.assert_allclose(grad16.astype(jnp.float32), grad32, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_empty_mask_gives_zero_loss_and_finite_metrics(loss_type):
    batch = BATCHES[loss_type]
    kw = to_f32({"loss_type": loss_type, **options("all", batch)})
    loss, metrics, grad, grad_ent = jax_loss(
        jnp.asarray(batch["lp"], jnp.float32),
        jnp.asarray(batch["old"], jnp.float32),
        jnp.asarray(batch["adv"]),
        np.zeros((B, T), bool),
        kw,
    )
    assert float(loss) == 0.0
    assert all(np.isfinite(v) for v in metrics.values())
    assert not np.any(grad) and not np.any(grad_ent)


def test_extreme_log_ratios_stay_finite():
    """|log-ratio| = 100 (exp overflows float32; clamped to 20 inside): everything finite."""
    batch = BATCHES["ppo"]
    old = jnp.asarray(batch["old"], jnp.float32)
    lp = old + jnp.where(jnp.arange(T) % 2 == 0, 100.0, -100.0)
    for adv in (jnp.ones(B), -jnp.ones(B)):
        tis = {"rollout_logprobs": old - jnp.where(jnp.arange(T) % 3 == 0, 100.0, -100.0)}
        for kw in ({}, {"dual_clip_c": None}, {"loss_type": "sapo"}, {"loss_type": "gspo"}, tis):
            loss, metrics, grad, _ = jax_loss(lp, old, adv, batch["mask"], kw)
            assert np.isfinite(loss) and np.all(np.isfinite(grad)), kw
            assert all(np.isfinite(v) for v in metrics.values()), kw


@pytest.mark.parametrize("top_q", [0.0, 0.05, 0.2, 0.3, 0.5, 0.999, 1.0])
def test_forking_tokens_mask_matches_oracle(top_q):
    rng = np.random.default_rng(3)
    mask = BATCHES["ppo"]["mask"]
    # One decimal: many ties, which must go to the earlier row-major position.
    entropy = np.round(rng.uniform(0.0, 1.0, (B, T)), 1)
    entropy[~mask] = 9.0  # padding must never be picked, however high
    got = np.asarray(forking_tokens_mask(jnp.asarray(entropy, jnp.float32), mask, top_q))
    np.testing.assert_array_equal(got, forking_mask_ref(entropy, mask, top_q))
    assert got.sum() == math.ceil(round(top_q * 10_000) * mask.sum() / 10_000)
    if top_q == 0.2:
        jitted = jax.jit(forking_tokens_mask, static_argnames="top_q")
        np.testing.assert_array_equal(jitted(entropy.astype(np.float32), mask, top_q=top_q), got)


def test_forking_tokens_mask_exact_count_and_use_as_token_mask():
    mask = np.ones((3, 10), bool)
    entropy = np.arange(30, dtype=np.float32).reshape(3, 10)
    keep = np.asarray(forking_tokens_mask(entropy, mask, top_q=0.2))
    assert keep.sum() == 6 and keep[2, 4:].all()  # ceil(0.2 * 30) = 6, float 0.2*30 > 6
    keep = forking_tokens_mask(entropy, np.zeros_like(mask), top_q=0.5)
    assert not np.asarray(keep).any()
    batch = BATCHES["ppo"]
    fork = forking_tokens_mask(jnp.asarray(batch["entropy"], jnp.float32), batch["mask"])
    check_against_oracle("ppo", {"token_mask": np.asarray(fork)})


BAD_INPUTS = [
    ({"logprobs": np.zeros(8, np.float32)}, r"logprobs must have shape \[B, T\], got \(8,\)"),
    ({"old_logprobs": np.zeros((B, 3), np.float32)}, r"old_logprobs must have shape \(7, 8\)"),
    ({"advantages": np.zeros(5, np.float32)}, r"advantages must have shape \(7,\) or \(7, 8\)"),
    ({"mask": np.ones((B, 9))}, r"mask must have shape \(7, 8\).*got \(7, 9\)"),
    ({"coefficients": np.ones((B,), np.float32)}, r"coefficients must have shape \(7, 8\)"),
    ({"token_mask": np.ones((1, T))}, r"token_mask must have shape"),
    ({"ref_logprobs": np.zeros((B, T - 1), np.float32)}, r"ref_logprobs must have shape"),
    ({"entropy": np.zeros((B, T), np.int32)}, r"entropy must have a floating dtype, got int32"),
    ({"logprobs": np.zeros((B, T), np.int32)}, r"logprobs must have a floating dtype, got int32"),
    ({"advantages": np.zeros(B, np.int32)}, r"advantages must have a floating dtype"),
    ({"mask": np.ones((B, T), np.complex64)}, r"mask must be boolean, integer or floating"),
    ({"loss_type": "grpo"}, r"loss_type must be one of \('ppo', 'gspo', 'sapo'\), got 'grpo'"),
    ({"aggregation": "mean"}, r"aggregation must be one of .*token-mean.*got 'mean'"),
    ({"kl_estimator": "k4"}, r"kl_estimator must be one of \('k1', 'k2', 'k3'\)"),
    ({"kl_coef": 0.1}, r"kl_coef=0.1 needs ref_logprobs"),
    ({"entropy_coef": 0.1}, r"entropy_coef=0.1 needs entropy"),
    ({"tis_cap": 2.0}, r"tis_cap was given without rollout_logprobs"),
    ({"clip_eps_low": -0.1}, r"clip_eps_low must be >= 0.0, got -0.1"),
    ({"dual_clip_c": 0.5}, r"dual_clip_c must be > 1.0, got 0.5"),
    ({"sapo_tau_neg": 0.0}, r"sapo_tau_neg must be > 0.0"),
    (
        {"aggregation": "seq-mean-token-sum-norm", "max_response_length": 0},
        r"max_response_length must be > 0.0",
    ),
]


@pytest.mark.parametrize("change, message", BAD_INPUTS)
def test_bad_input_raises(change, message):
    batch = BATCHES["ppo"]
    args = {
        "logprobs": batch["lp"].astype(np.float32),
        "old_logprobs": batch["old"],
        "advantages": batch["adv"],
        "mask": batch["mask"],
    }
    kwargs = {k: v for k, v in change.items() if k not in args}
    args.update({k: v for k, v in change.items() if k in args})
    with pytest.raises(ValueError, match=message):
        policy_loss(*args.values(), **kwargs)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: forking_tokens_mask(np.ones((2, 3)), np.ones((2, 3)), top_q=1.5), "top_q"),
        (lambda: forking_tokens_mask(np.ones((2, 3)), np.ones((3, 2))), r"mask must have shape"),
        (lambda: forking_tokens_mask(np.ones(3), np.ones(3)), r"entropy must have shape \[B, T\]"),
        (lambda: loss_normalizer(np.ones((2, 3)), "sum"), "aggregation must be one of"),
    ],
)
def test_bad_input_raises_helpers(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("module", [policy, advantages])
def test_docstring_examples_run(module):
    result = doctest.testmod(module, verbose=False)
    assert result.attempted > 0 and result.failed == 0
