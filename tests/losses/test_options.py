"""Options passed whole: each loss's options object gives exactly what the earlier loose keyword
flags gave (bit for bit), those flags still work for one release with a DeprecationWarning that
names the new form, an unknown keyword is a TypeError, and the options are static under jit."""

from __future__ import annotations

import ast
import dataclasses
import doctest
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import delta_jax.losses
from delta_jax.losses import (
    PRESETS,
    DeltaOptions,
    LossParts,
    PolicyLossOptions,
    TermInputs,
    TopkInputs,
    delta_coefficients,
    delta_coefficients_microbatched,
    kl_k2,
    policy_gradient_loss,
    policy_loss,
    seq_mean_token_mean,
)
from delta_jax.losses import options as options_module


def _delta_batch(seed: int = 0, b: int = 6, t: int = 7, h: int = 16, k: int = 5, v: int = 40):
    rng = np.random.default_rng(seed)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    mask = np.arange(t)[None] < rng.integers(1, t + 1, b)[:, None]
    arrays = (
        f32(rng.normal(size=(b, t, h))),
        f32(-rng.uniform(0.05, 3.0, (b, t))),
        f32(rng.normal(size=b)),
        jnp.asarray(mask),
    )
    topk = TopkInputs(
        f32(rng.normal(size=(h, v))),
        jnp.asarray(rng.integers(0, v, (b, t))),
        f32(rng.normal(size=(b, t, k))),
        jnp.asarray(rng.integers(0, v, (b, t, k))),
    )
    return arrays, topk


def _policy_batch(seed: int = 1, b: int = 5, t: int = 6):
    rng = np.random.default_rng(seed)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    old = -rng.uniform(0.1, 2.0, (b, t))
    return dict(
        logprobs=f32(old + rng.uniform(-0.4, 0.4, (b, t))),
        old_logprobs=f32(old),
        advantages=f32(rng.normal(size=b)),
        mask=jnp.asarray(np.arange(t)[None] < rng.integers(1, t + 1, b)[:, None]),
        coefficients=f32(rng.uniform(0.8, 1.2, (b, t))),
        terms=TermInputs(
            f32(old + rng.uniform(-0.3, 0.3, (b, t))),
            f32(old + rng.uniform(-0.3, 0.3, (b, t))),
            f32(rng.uniform(0.0, 2.0, (b, t))),
        ),
    )


def _legacy(fn, *args, **kwargs):
    """``fn`` called with loose keywords: must warn DeprecationWarning once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args, **kwargs)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in caught]
    assert deprecations[0].filename == __file__  # points at the caller's line
    return out, str(deprecations[0].message)


def _assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


DELTA_CASES = [
    {},
    dict(refine_steps=3, lam_min=0.5, lam_max=1.5),
    dict(refine_steps=2, assignment="hard", adaptive_gamma=False),
    dict(range_map=False, normalize="count", eps=1e-6),
]


@pytest.mark.parametrize("case", range(len(DELTA_CASES)))
def test_delta_options_equal_legacy_keywords(case):
    (hidden, logprobs, adv, mask), _ = _delta_batch(case)
    flags = DELTA_CASES[case]
    new = delta_coefficients(
        hidden, logprobs, adv, mask, DeltaOptions(**flags), return_diagnostics=True
    )
    if flags:
        old, message = _legacy(
            delta_coefficients, hidden, logprobs, adv, mask, return_diagnostics=True, **flags
        )
        assert "deprecated" in message
        assert f"DeltaOptions({', '.join(f'{k}=...' for k in flags)})" in message
    else:
        old = delta_coefficients(hidden, logprobs, adv, mask, return_diagnostics=True)
    _assert_same(new, old)


def test_delta_topk_inputs_equal_legacy_keywords():
    (hidden, logprobs, adv, mask), topk = _delta_batch(3)
    options = DeltaOptions(proxy="hidden_topk", refine_steps=2)
    new = delta_coefficients(None, logprobs, adv, mask, options, topk=topk)
    old, message = _legacy(
        delta_coefficients,
        None,
        logprobs,
        adv,
        mask,
        proxy="hidden_topk",
        refine_steps=2,
        **topk._asdict(),
    )  # a legacy call site: loose options and top-k arrays
    _assert_same(new, old)
    assert "topk=TopkInputs(lm_head=..., token_ids=..., topk_logits=..., topk_ids=...)" in message
    # micro-batched: per-token top-k arrays one per micro-batch
    halves = lambda x: [x[:3], x[3:]]
    per_mb = TopkInputs(topk.lm_head, *(halves(x) for x in topk[1:]))
    split = [halves(x) for x in (logprobs, adv, mask)]
    new_mb = delta_coefficients_microbatched(None, *split, options, topk=per_mb)
    old_mb, _ = _legacy(
        delta_coefficients_microbatched,
        None,
        *split,
        proxy="hidden_topk",
        refine_steps=2,
        **per_mb._asdict(),
    )
    _assert_same(new_mb, old_mb)


def test_policy_loss_options_equal_legacy_keywords():
    b = _policy_batch()
    flags = dict(
        clip_eps_high=0.2,
        aggregation="seq-mean-token-mean",
        tis_cap=2.0,
        kl_coef=0.1,
        kl_estimator="k2",
        entropy_coef=0.01,
    )
    args = [b[k] for k in ("logprobs", "old_logprobs", "advantages", "mask")]
    options = PolicyLossOptions(**flags)

    def new(lp, ent):
        terms = b["terms"]._replace(entropy=ent)
        return policy_loss(lp, *args[1:], options, coefficients=b["coefficients"], terms=terms)

    def old(lp, ent):
        return policy_loss(
            lp,
            *args[1:],
            coefficients=b["coefficients"],
            **flags,
            **b["terms"]._replace(entropy=ent)._asdict(),
        )

    grad = lambda f: jax.value_and_grad(f, (0, 1), has_aux=True)
    with pytest.warns(DeprecationWarning, match=r"policy_loss\(\.\.\., clip_eps_high=\.\.\."):
        legacy = grad(old)(args[0], b["terms"].entropy)
    _assert_same(grad(new)(args[0], b["terms"].entropy), legacy)
    # the preset table is the same object the options name
    _assert_same(
        policy_loss(*args, PRESETS["grpo"]),
        _legacy(policy_loss, *args, clip_eps_high=0.2, aggregation="seq-mean-token-mean")[0],
    )


def test_policy_gradient_loss_parts_equal_legacy_keywords():
    b = _policy_batch(2)
    args = [b[k] for k in ("logprobs", "old_logprobs", "advantages", "mask")]
    functions = dict(aggregate=seq_mean_token_mean, kl=kl_k2, kl_coef=0.05, tis_cap=1.5)
    new = policy_gradient_loss(*args, LossParts(**functions), terms=b["terms"])
    old, message = _legacy(policy_gradient_loss, *args, **functions, **b["terms"]._asdict())
    _assert_same(new, old)
    assert "LossParts(aggregate=..., kl=..., kl_coef=..., tis_cap=...)" in message
    assert "terms=TermInputs(rollout_logprobs=..., ref_logprobs=..., entropy=...)" in message


@pytest.mark.parametrize(
    "call",
    [
        lambda a: delta_coefficients(*a, refine_step=2),
        lambda a: delta_coefficients_microbatched(*([x] for x in a), lam=1.0),
        lambda a: policy_loss(a[1], a[1], a[2], a[3], clip_eps=0.2),
        lambda a: policy_gradient_loss(a[1], a[1], a[2], a[3], entropy_coeff=0.1),
    ],
)
def test_unknown_keyword_raises_type_error(call):
    arrays, _ = _delta_batch(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # raised before any warning
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            call(arrays)


def test_options_are_checked_when_built():
    with pytest.raises(ValueError, match="lam_min=1.3 must be <= lam_max=1.2"):
        DeltaOptions(lam_min=1.3)
    with pytest.raises(ValueError, match="scope='per_shard' needs axis_name"):
        DeltaOptions(scope="per_shard")
    with pytest.raises(ValueError, match=r"loss_type must be one of"):
        PolicyLossOptions(loss_type="grpo")
    with pytest.raises(ValueError, match="dual_clip_c must be > 1.0"):
        dataclasses.replace(PRESETS["dapo"], dual_clip_c=0.5)
    assert DeltaOptions(lam_min=1, refine_steps=np.int64(2)) == DeltaOptions(2, 1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        DeltaOptions().refine_steps = 2


def test_options_are_static_under_jit():
    """Options pass through jit as arguments: equal options reuse the program."""
    (hidden, logprobs, adv, mask), _ = _delta_batch(5)
    traces = []

    def coefficients(h, lp, a, m, options):
        traces.append(options)
        return delta_coefficients(h, lp, a, m, options)

    fn = jax.jit(coefficients)
    first = fn(hidden, logprobs, adv, mask, DeltaOptions(refine_steps=2))
    second = fn(hidden, logprobs, adv, mask, DeltaOptions(refine_steps=2))
    assert len(traces) == 1
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
    fn(hidden, logprobs, adv, mask, DeltaOptions(refine_steps=3))
    assert len(traces) == 2
    loss = jax.jit(policy_loss)(logprobs, logprobs, adv, mask, PRESETS["gspo"])[0]
    assert np.isfinite(float(loss))


def test_docstring_examples_run():
    result = doctest.testmod(options_module, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_losses_import_only_jax_numpy_jaxtyping_and_the_standard_library():
    allowed = {"jax", "numpy", "jaxtyping", "delta_jax", "__future__"}
    allowed |= set(sys.stdlib_module_names)
    package = Path(delta_jax.losses.__file__).parent
    found = set()
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add(node.module.split(".")[0])
    assert found - allowed == set()
