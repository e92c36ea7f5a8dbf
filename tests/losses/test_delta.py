"""Tests for delta_jax.losses.delta against the float64 oracle in delta_oracle.py.

Tolerances: 1e-5 max abs error against the float64 oracle (float32 arithmetic); 1e-6 between two
float32 computations that differ only in summation order (sharding, micro-batching, padding,
permutation); 1e-2 between bf16 and float32 hidden states; rtol 1e-10 between two float64
computations that differ only in summation order (float64 rounding, ~1e-16 per operation, stays
near 1e-14 through tens of tokens and a few refinement steps; a token more or less in a
statistic moves the coefficients by ~1e-2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from delta_jax.losses import DeltaOptions, TopkInputs
from delta_jax.losses.delta import delta_coefficients, delta_coefficients_microbatched
from tests.losses.delta_oracle import delta_oracle, hidden_topk_vectors, lm_head_row_vectors

ORACLE_TOL = 1e-5
ORDER_TOL = 1e-6
LAM_RANGES = [(0.8, 1.2), (0.5, 1.5), (0.0, 2.0), (1.0, 1.0)]
PATTERNS = ["mixed", "mixed_zero", "positive", "negative", "zero"]


def make_batch(seed, b=6, t=7, h=16, pattern="mixed", pad=True):
    """Random rollout batch: hidden states share a background direction (as real ones do)."""
    rng = np.random.default_rng(seed)
    background = rng.normal(size=h) * 2.0
    hidden = (background + rng.normal(size=(b, t, h))).astype(np.float32)
    logprobs = np.log(rng.uniform(0.05, 1.0, size=(b, t))).astype(np.float32)
    adv = rng.normal(size=b)
    adv = {
        "mixed": adv,
        "mixed_zero": np.where(np.arange(b) % 3 == 0, 0.0, adv),
        "positive": np.abs(adv) + 0.1,
        "negative": -np.abs(adv) - 0.1,
        "zero": np.zeros(b),
    }[pattern].astype(np.float32)
    lengths = rng.integers(1, t + 1, size=b) if pad else np.full(b, t)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    return hidden, logprobs, adv, mask


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ---------------------------------------------------------------- parity with the oracle


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_oracle_parity(k, pattern):
    hidden, logprobs, adv, mask = make_batch(10 * k + PATTERNS.index(pattern), pattern=pattern)
    v = lm_head_row_vectors(hidden, logprobs)
    for lam_min, lam_max in LAM_RANGES:
        options = DeltaOptions(refine_steps=k, lam_min=lam_min, lam_max=lam_max)
        got = delta_coefficients(hidden, logprobs, adv, mask, options)
        want, _ = delta_oracle(v, adv, mask, refine_steps=k, lam_min=lam_min, lam_max=lam_max)
        assert got.dtype == jnp.float32
        assert max_err(got, want) <= ORACLE_TOL, (k, pattern, lam_min, lam_max)


OPTION_CASES = {
    "hard": dict(assignment="hard"),
    "fixed_gamma": dict(adaptive_gamma=False),
    "no_range_map": dict(range_map=False),
    "count": dict(normalize="count"),
    "count_no_map": dict(normalize="count", range_map=False, lam_min=0.3),
}


@pytest.mark.parametrize("name", list(OPTION_CASES))
def test_option_parity(name):
    hidden, logprobs, adv, mask = make_batch(7, pattern="mixed_zero")
    v = lm_head_row_vectors(hidden, logprobs)
    for k in (1, 3):
        options = DeltaOptions(refine_steps=k, **OPTION_CASES[name])
        got = delta_coefficients(hidden, logprobs, adv, mask, options)
        want, _ = delta_oracle(v, adv, mask, refine_steps=k, **OPTION_CASES[name])
        assert max_err(got, want) <= ORACLE_TOL, (name, k)


def test_fixed_gamma_matters_only_after_one_step():
    hidden, logprobs, adv, mask = make_batch(8)
    for k, differs in [(1, False), (3, True)]:
        a = delta_coefficients(hidden, logprobs, adv, mask, DeltaOptions(refine_steps=k))
        fixed = DeltaOptions(refine_steps=k, adaptive_gamma=False)
        b = delta_coefficients(hidden, logprobs, adv, mask, fixed)
        assert (max_err(a, b) > 1e-4) == differs, k


def make_topk(seed, b=6, t=7, h=16, vocab=40, k=5):
    rng = np.random.default_rng(seed)
    lm_head = rng.normal(size=(h, vocab)).astype(np.float32) / 4.0
    token_ids = rng.integers(0, vocab, size=(b, t)).astype(np.int32)
    topk_ids = np.stack([rng.permutation(vocab)[:k] for _ in range(b * t)]).reshape(b, t, k)
    topk_logits = np.sort(rng.normal(size=(b, t, k)) * 2.0, axis=-1)[..., ::-1].astype(np.float32)
    return lm_head, token_ids, topk_logits, topk_ids.astype(np.int32)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_hidden_topk_parity(k):
    _, logprobs, adv, mask = make_batch(11, pattern="mixed_zero")
    lm_head, token_ids, topk_logits, topk_ids = make_topk(12)
    got, diag = delta_coefficients(
        None,
        logprobs,
        adv,
        mask,
        DeltaOptions(refine_steps=k, proxy="hidden_topk"),
        topk=TopkInputs(lm_head, token_ids, topk_logits, topk_ids),
        return_diagnostics=True,
    )
    v = hidden_topk_vectors(lm_head, token_ids, topk_logits, topk_ids)
    want, want_diag = delta_oracle(v, adv, mask, refine_steps=k)
    assert max_err(got, want) <= ORACLE_TOL
    for key, value in want_diag.items():
        np.testing.assert_allclose(diag[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("pattern", ["mixed", "positive", "zero"])
def test_diagnostics_parity(pattern):
    hidden, logprobs, adv, mask = make_batch(13, pattern=pattern)
    got, diag = delta_coefficients(
        hidden, logprobs, adv, mask, DeltaOptions(refine_steps=2), return_diagnostics=True
    )
    _, want = delta_oracle(lm_head_row_vectors(hidden, logprobs), adv, mask, refine_steps=2)
    assert set(diag) == set(want)
    for key, value in want.items():
        assert diag[key].dtype == jnp.float32 and np.isfinite(diag[key]), key
        np.testing.assert_allclose(diag[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


# ---------------------------------------------------------------- properties


def test_padding_invariance():
    hidden, logprobs, adv, mask = make_batch(20)
    fn = jax.jit(functools.partial(delta_coefficients, options=DeltaOptions(refine_steps=2)))
    base = fn(hidden, logprobs, adv, mask)
    rng = np.random.default_rng(21)
    b, t, h = hidden.shape
    rows = [0, 3, b + 2]  # indices of the inserted rows in the padded batch
    keep = np.setdiff1d(np.arange(b + 3), rows)

    def grow(x, fill):
        out = fill((b + 3, t + 4) + x.shape[2:]).astype(x.dtype)
        out[keep, :t] = x
        return out

    big_hidden = grow(hidden, lambda s: rng.normal(size=s) * 1e3)
    big_logprobs = grow(logprobs, lambda s: rng.normal(size=s) * 50)
    big_mask = grow(mask, np.zeros)
    big_adv = np.zeros(b + 3, np.float32)
    big_adv[keep], big_adv[rows] = adv, [1e6, -3.0, 7.0]
    got = fn(big_hidden, big_logprobs, big_adv, big_mask)
    assert max_err(got[keep, :t], base) <= ORDER_TOL
    assert np.all(np.asarray(got)[big_mask == 0] == 0)


@pytest.mark.parametrize("k", [1, 3])
def test_observation_tokens_are_not_in_the_statistics(k):
    """Multi-turn responses, observation spans masked out: at the action tokens the coefficients
    (and diagnostics) are those of the batch with the observations removed, in float64."""
    hidden, logprobs, adv, mask = make_batch(28, b=8, t=9, pattern="mixed_zero")
    rng = np.random.default_rng(25)
    lengths = mask.sum(1).astype(int)
    actions = mask != 0
    for i in np.flatnonzero(lengths >= 3):  # one span, after the first turn of the policy
        start = rng.integers(1, lengths[i] - 1)
        actions[i, start : rng.integers(start + 1, lengths[i])] = False
    observations = (mask != 0) & ~actions
    # Observation positions hold far-off values: counted anywhere, they would show.
    hidden[observations] = rng.normal(size=(observations.sum(), hidden.shape[-1])) * 1e3
    logprobs[observations] = -rng.uniform(0, 50, observations.sum())
    compact = lambda x: np.stack(  # each row's action tokens moved to its front
        [np.concatenate([r[a], np.zeros_like(r[~a])]) for r, a in zip(x, actions, strict=True)]
    )
    compact_mask = np.arange(9)[None] < actions.sum(1)[:, None]
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(x, jnp.float64)
        options = DeltaOptions(refine_steps=k)
        got, got_diag = delta_coefficients(
            f64(hidden), f64(logprobs), f64(adv), actions, options, return_diagnostics=True
        )
        want, want_diag = delta_coefficients(
            f64(compact(hidden)),
            f64(compact(logprobs)),
            f64(adv),
            compact_mask,
            options,
            return_diagnostics=True,
        )
    assert got.dtype == jnp.float64 and observations.sum() >= 8
    np.testing.assert_allclose(compact(np.asarray(got)), want, rtol=1e-10, atol=0)
    assert np.all(np.asarray(got)[~actions] == 0)
    for key, value in want_diag.items():
        np.testing.assert_allclose(got_diag[key], value, rtol=1e-10, atol=0, err_msg=key)


def test_permutation_of_responses():
    hidden, logprobs, adv, mask = make_batch(22)
    perm = np.random.default_rng(23).permutation(6)
    base = delta_coefficients(hidden, logprobs, adv, mask)
    got = delta_coefficients(hidden[perm], logprobs[perm], adv[perm], mask[perm])
    assert max_err(got, np.asarray(base)[perm]) <= ORDER_TOL


@pytest.mark.parametrize("pattern", PATTERNS)
def test_mean_is_one_and_range(pattern):
    hidden, logprobs, adv, mask = make_batch(30, pattern=pattern)
    valid = mask != 0
    for k in (0, 1, 3):
        coef = np.asarray(delta_coefficients(hidden, logprobs, adv, mask, DeltaOptions(k)))
        assert abs(coef[valid].mean() - 1.0) <= ORDER_TOL
        raw = np.asarray(
            delta_coefficients(
                hidden,
                logprobs,
                adv,
                mask,
                DeltaOptions(refine_steps=k, lam_min=0.7, lam_max=1.4, normalize="count"),
            )
        )
        scored = valid & (adv[:, None] != 0)
        assert np.all((raw[scored] >= 0.7) & (raw[scored] <= 1.4))
        assert np.all(raw[valid & ~scored] == np.float32(0.7))
        assert np.all(raw[~valid] == 0)


def _finite(coef, diag):
    assert np.all(np.isfinite(coef))
    for key, value in diag.items():
        assert np.isfinite(value), key


def test_degenerate_inputs():
    hidden, logprobs, adv, mask = make_batch(40)
    valid = mask != 0
    run = functools.partial(delta_coefficients, refine_steps=3, return_diagnostics=True)

    coef, diag = run(hidden, logprobs, np.zeros_like(adv), mask)  # all advantages zero
    _finite(coef, diag)
    np.testing.assert_allclose(coef, valid.astype(np.float32), atol=ORDER_TOL)
    np.testing.assert_allclose(diag["gamma_pos"], np.sqrt(1e-8), rtol=1e-6)

    for sign in (1.0, -1.0):  # one side only
        coef, diag = run(hidden, logprobs, sign * (np.abs(adv) + 0.1), mask)
        _finite(coef, diag)
        assert abs(np.asarray(coef)[valid].mean() - 1.0) <= ORDER_TOL

    coef, diag = run(hidden, logprobs, adv, np.zeros_like(mask))  # empty mask
    _finite(coef, diag)
    np.testing.assert_array_equal(coef, np.zeros_like(mask))

    one = np.zeros_like(mask)
    one[2, 0] = 1
    coef, diag = run(hidden, logprobs, adv, one)  # one token
    _finite(coef, diag)
    np.testing.assert_allclose(coef, one, atol=ORDER_TOL)

    same = np.broadcast_to(hidden[0, 0], hidden.shape).copy()  # identical states: zero variance
    coef, diag = run(same, np.zeros_like(logprobs) - 1.0, adv, mask)
    _finite(coef, diag)

    coef, diag = run(hidden, logprobs, np.zeros_like(adv), mask, range_map=False)
    _finite(coef, diag)
    np.testing.assert_array_equal(coef, np.zeros_like(mask))

    coef = delta_coefficients(hidden, logprobs, adv, mask, lam_min=1.0, lam_max=1.0)
    np.testing.assert_allclose(coef, valid.astype(np.float32), atol=ORDER_TOL)


def test_bf16_hidden():
    hidden, logprobs, adv, mask = make_batch(50, h=64)
    low = jnp.asarray(hidden, jnp.bfloat16)
    fn = jax.jit(delta_coefficients, static_argnames="refine_steps")
    for k in (1, 3):
        f32 = fn(hidden, logprobs, adv, mask, refine_steps=k)
        bf16 = fn(low, logprobs, adv, mask, refine_steps=k)
        assert bf16.dtype == jnp.float32
        assert max_err(bf16, f32) <= 1e-2
        # Nothing is lost beyond the bf16 rounding of `hidden` itself.
        v = lm_head_row_vectors(np.asarray(low.astype(jnp.float32)), logprobs)
        want, _ = delta_oracle(v, adv, mask, refine_steps=k)
        assert max_err(bf16, want) <= ORACLE_TOL


# ---------------------------------------------------------------- jit, sharding, micro-batches


def test_jit_equals_eager_no_recompile_and_zero_gradient():
    hidden, logprobs, adv, mask = make_batch(60)
    options = DeltaOptions(refine_steps=2)
    fn = jax.jit(functools.partial(delta_coefficients, options=options))
    eager = delta_coefficients(hidden, logprobs, adv, mask, options)
    assert max_err(fn(hidden, logprobs, adv, mask), eager) <= ORDER_TOL
    assert fn._cache_size() == 1
    hidden2, logprobs2, adv2, mask2 = make_batch(61)
    fn(hidden2, logprobs2, adv2, mask2).block_until_ready()
    assert fn._cache_size() == 1

    weights = jnp.asarray(np.random.default_rng(62).normal(size=mask.shape), jnp.float32)

    def objective(h, lp, a):
        return jnp.sum(weights * delta_coefficients(h, lp, a, mask, options))

    grads = jax.jit(jax.grad(objective, argnums=(0, 1, 2)))(hidden, logprobs, adv)
    for g in grads:
        assert np.all(np.asarray(g) == 0)


def make_mesh(axis_type=jax.sharding.AxisType.Auto):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake) devices")
    return jax.make_mesh((8,), ("data",), axis_types=(axis_type,))


@pytest.fixture(scope="module")
def mesh():
    return make_mesh()


@pytest.fixture(scope="module")
def big_batch():
    hidden, logprobs, adv, mask = make_batch(70, b=16, t=8, h=16)
    mask[5:8, 6:] = 0  # trailing padding that test_microbatched_equals_whole_batch trims
    return hidden, logprobs, adv, mask


def _shard(mesh, *arrays):
    return [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in arrays]


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_global_scope_sharded(axis_type, big_batch):
    mesh = make_mesh(getattr(jax.sharding.AxisType, axis_type))
    options = DeltaOptions(refine_steps=2)
    want = delta_coefficients(*big_batch, options)
    sharded = _shard(mesh, *big_batch)
    plain = jax.jit(functools.partial(delta_coefficients, options=options))(*sharded)
    assert max_err(plain, want) <= ORDER_TOL
    over_data = DeltaOptions(refine_steps=2, axis_name="data")
    wrapped = functools.partial(delta_coefficients, options=over_data, mesh=mesh)
    assert max_err(jax.jit(wrapped)(*sharded), want) <= ORDER_TOL


def test_per_shard_scope(mesh, big_batch):
    options = DeltaOptions(refine_steps=2)
    single = jax.jit(functools.partial(delta_coefficients, options=options))
    alone = [single(*(x[2 * i : 2 * i + 2] for x in big_batch)) for i in range(8)]
    want = np.concatenate(alone)
    assert max_err(want, delta_coefficients(*big_batch, options)) > 1e-3  # scope matters
    sharded = _shard(mesh, *big_batch)
    per_shard = DeltaOptions(refine_steps=2, scope="per_shard", axis_name="data")
    wrapped = functools.partial(
        delta_coefficients, options=per_shard, mesh=mesh, return_diagnostics=True
    )
    got, diag = jax.jit(wrapped)(*sharded)
    assert max_err(got, want) <= ORDER_TOL
    assert diag["gamma_pos"].shape == (8,)

    # Inside the caller's own shard_map, only axis_name is given.
    inner = functools.partial(delta_coefficients, options=per_shard)
    mapped = jax.shard_map(inner, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    assert max_err(jax.jit(mapped)(*sharded), want) <= ORDER_TOL


def test_microbatched_equals_whole_batch(big_batch):
    hidden, logprobs, adv, mask = big_batch
    low = np.asarray(jnp.asarray(hidden, jnp.bfloat16).astype(jnp.float32))
    options = DeltaOptions(refine_steps=3)
    want, want_diag = delta_coefficients(low, logprobs, adv, mask, options, return_diagnostics=True)
    cuts = [(0, 5, 8), (5, 8, 6), (8, 16, 8)]  # rows [lo, hi), kept columns
    for lo, hi, cols in cuts:
        assert np.all(mask[lo:hi, cols:] == 0)  # only trailing padding is trimmed
    pieces = [
        (
            jnp.asarray(hidden[lo:hi, :cols], jnp.bfloat16),
            logprobs[lo:hi, :cols],
            adv[lo:hi],
            mask[lo:hi, :cols],
        )
        for lo, hi, cols in cuts
    ]
    got, diag = jax.jit(
        functools.partial(delta_coefficients_microbatched, options=options, return_diagnostics=True)
    )(*(list(x) for x in zip(*pieces, strict=True)))
    for (lo, hi, cols), g in zip(cuts, got, strict=True):
        assert g.shape == (hi - lo, cols)
        assert max_err(g, np.asarray(want)[lo:hi, :cols]) <= ORDER_TOL
    for key in want_diag:
        # Diagnostics are unnormalised sums (norms ~5): summation order shows at ~2e-6 relative.
        np.testing.assert_allclose(diag[key], want_diag[key], rtol=1e-5, err_msg=key)


def test_microbatched_hidden_topk():
    _, logprobs, adv, mask = make_batch(80)
    lm_head, token_ids, topk_logits, topk_ids = make_topk(81)
    options = DeltaOptions(proxy="hidden_topk")
    topk = TopkInputs(lm_head, token_ids, topk_logits, topk_ids)
    want = jax.jit(delta_coefficients)(None, logprobs, adv, mask, options, topk=topk)
    split = [slice(0, 2), slice(2, 6)]
    pieces = lambda x: [x[s] for s in split]
    got = jax.jit(delta_coefficients_microbatched)(
        None,
        pieces(logprobs),
        pieces(adv),
        pieces(mask),
        options,
        topk=TopkInputs(lm_head, *(pieces(x) for x in topk[1:])),
    )
    assert max_err(np.concatenate(got), want) <= ORDER_TOL


# ---------------------------------------------------------------- bad input


def test_bad_shapes_and_dtypes():
    hidden, logprobs, adv, mask = make_batch(90)
    with pytest.raises(ValueError, match=r"hidden must have shape \[6, 7, \?\].*got \(6, 5, 16\)"):
        delta_coefficients(hidden[:, :5], logprobs, adv, mask)
    with pytest.raises(ValueError, match=r"advantages must have shape \[6\].*got \(5,\)"):
        jax.jit(delta_coefficients)(hidden, logprobs, adv[:5], mask)
    with pytest.raises(ValueError, match=r"mask must have shape \[6, 7\].*got \(7, 6\)"):
        delta_coefficients(hidden, logprobs, adv, mask.T)
    with pytest.raises(ValueError, match=r"logprobs must have shape \[\?, \?\], got \(6, 7, 1\)"):
        delta_coefficients(hidden, logprobs[..., None], adv, mask)
    with pytest.raises(ValueError, match="hidden must have a float dtype, got int32"):
        delta_coefficients(hidden.astype(np.int32), logprobs, adv, mask)
    with pytest.raises(ValueError, match=r"hidden\[1\] must have shape \[2, 7, 16\]"):
        delta_coefficients_microbatched(
            [hidden[:2], hidden[2:4, :, :8]], [logprobs[:2]] * 2, [adv[:2]] * 2, [mask[:2]] * 2
        )
    with pytest.raises(ValueError, match="masks has 1 micro-batches, logprobs has 2"):
        delta_coefficients_microbatched([hidden] * 2, [logprobs] * 2, [adv] * 2, [mask])
    lm_head, token_ids, topk_logits, topk_ids = make_topk(91)
    with pytest.raises(ValueError, match=r"\['lm_head'\] are only used by proxy='hidden_topk'"):
        delta_coefficients(hidden, logprobs, adv, mask, lm_head=lm_head)
    with pytest.raises(ValueError, match=r"needs \['topk_ids'\]"):
        delta_coefficients(
            None, logprobs, adv, mask, proxy="hidden_topk", lm_head=lm_head,
            token_ids=token_ids, topk_logits=topk_logits,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"topk_ids must have shape \[6, 7, 5\].*got \(6, 7, 4\)"):
        delta_coefficients(
            None, logprobs, adv, mask, proxy="hidden_topk", lm_head=lm_head,
            token_ids=token_ids, topk_logits=topk_logits, topk_ids=topk_ids[..., :4],
        )  # fmt: skip
    with pytest.raises(
        ValueError, match=r"hidden must have shape \[6, 7, 16\].*lm_head \(16, 40\)"
    ):
        delta_coefficients(
            hidden[..., :8], logprobs, adv, mask, proxy="hidden_topk", lm_head=lm_head,
            token_ids=token_ids, topk_logits=topk_logits, topk_ids=topk_ids,
        )  # fmt: skip


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(assignment="argmax"), "assignment must be one of"),
        (dict(normalize="mean"), "normalize must be one of"),
        (dict(refine_steps=-1), "refine_steps must be a non-negative int"),
        (dict(lam_min=1.3), "lam_min=1.3 must be <= lam_max=1.2"),
        (dict(eps=0.0), "eps must be > 0"),
        (dict(scope="per_shard"), "scope='per_shard' needs axis_name"),
        (dict(range_map=1), "range_map must be a bool"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        delta_coefficients(*make_batch(92), **options)


def test_mesh_batch_not_divisible(mesh):
    batch = make_batch(93, b=6)
    with pytest.raises(ValueError, match="batch size 6 is not divisible by the 8 shards"):
        delta_coefficients(*batch, axis_name="data", mesh=mesh)


def test_microbatched_with_mesh(mesh, big_batch):
    want = delta_coefficients(*big_batch, refine_steps=2)
    halves = [[x[:8], x[8:]] for x in big_batch]
    fn = functools.partial(
        delta_coefficients_microbatched, refine_steps=2, axis_name="data", mesh=mesh
    )
    got = jax.jit(fn)(*halves)
    assert max_err(np.concatenate(got), want) <= ORDER_TOL


def test_docstring_examples():
    import doctest

    import delta_jax.losses.delta as module

    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
