"""Sampling strategies against a float64 NumPy oracle: exact log-probs, chi-square frequencies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax.sampling.strategies import (
    Categorical,
    Greedy,
    make_strategy,
    sample_categorical,
    top_p_mask,
)
from tests.sampling.helpers import chisquare_pvalue, truncated_distribution

# A tiny vocabulary whose sorted order is not the id order, so cut-offs must map back correctly.
LOGITS = np.array([0.3, 2.0, -1.0, 1.4, 0.9, -0.2, 1.7, -2.5])
NUM_DRAWS = 100_000
# A correct sampler at a fixed seed passes with p > ACCEPT; the wrong distributions below must be
# rejected with p < REJECT, which shows the test has power at this sample size.
ACCEPT = 1e-3
REJECT = 1e-8

CASES = [
    dict(temperature=0.8),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.3, top_p=0.7),
    dict(temperature=0.9, top_k=5, top_p=0.8),
    dict(temperature=1.0, min_p=0.15),
    dict(temperature=1.2, top_k=6, top_p=0.9, min_p=0.1),
]


def _draw(strategy, seed=0):
    logits = jnp.broadcast_to(jnp.asarray(LOGITS, jnp.float32), (NUM_DRAWS, LOGITS.size))
    out = jax.jit(lambda s, x, k: s(x, k))(strategy, logits, jax.random.key(seed))
    return jax.tree.map(np.asarray, out)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_frequencies_match_truncated_distribution(case):
    out = _draw(make_strategy(**case))
    exact = truncated_distribution(LOGITS, **case)
    assert chisquare_pvalue(out.token, exact) > ACCEPT

    # Power: the same draws reject the untruncated distribution (when truncation is on) and a
    # 15% different temperature.
    untruncated = truncated_distribution(LOGITS, temperature=case["temperature"])
    if not np.allclose(untruncated, exact):
        assert chisquare_pvalue(out.token, untruncated) < REJECT
    wrong_temperature = dict(case, temperature=case["temperature"] * 1.15)
    assert chisquare_pvalue(out.token, truncated_distribution(LOGITS, **wrong_temperature)) < REJECT


@pytest.mark.parametrize("case", CASES[1:], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_logprobs_are_exact(case):
    out = _draw(make_strategy(**case), seed=1)
    exact = truncated_distribution(LOGITS, **case)
    z = LOGITS / case["temperature"]
    full = z - np.log(np.exp(z - z.max()).sum()) - z.max()
    np.testing.assert_allclose(out.logprob, np.log(exact[out.token]), atol=1e-5)
    np.testing.assert_allclose(out.untruncated_logprob, full[out.token], atol=1e-5)
    # Truncation only removes mass, so the behaviour log-prob is never below the untruncated one.
    assert np.all(out.logprob >= out.untruncated_logprob - 1e-6)


def test_untruncated_temperature_has_equal_logprobs():
    out = _draw(make_strategy(temperature=0.8), seed=2)
    np.testing.assert_array_equal(out.logprob, out.untruncated_logprob)


def test_same_seed_same_draws_other_seed_differs():
    s = make_strategy(temperature=1.0, top_p=0.9)
    a, b, c = _draw(s, 3), _draw(s, 3), _draw(s, 4)
    np.testing.assert_array_equal(a.token, b.token)
    assert np.mean(a.token != c.token) > 0.3


def test_greedy_is_argmax_with_temperature_one_logprobs():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 11)) * 3
    out = jax.tree.map(np.asarray, Greedy()(jnp.asarray(logits, jnp.float32), jax.random.key(0)))
    np.testing.assert_array_equal(out.token, logits.argmax(-1))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprob, logp.max(-1), atol=1e-5)
    np.testing.assert_array_equal(out.logprob, out.untruncated_logprob)


def test_make_strategy_disables_no_op_truncations():
    assert make_strategy(0.0, top_k=3, top_p=0.5) == Greedy()
    s = make_strategy(1.0, top_p=1.0, top_k=0, min_p=0.0)
    assert isinstance(s, Categorical)
    assert (s.top_k, s.top_p, s.min_p) == (0, None, None)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=1.0), "min_p"),
        (dict(min_p=-0.1), "min_p"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        make_strategy(**kwargs)


def test_sample_categorical_over_several_blocks():
    """A vocabulary of 300 spans three 128-id blocks (the last one padded), with masked ids."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=300) * 1.5
    logits[[0, 127, 128, 200, 299]] = -np.inf  # block edges and the last id
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (300_000, 300))
    tokens = np.asarray(jax.jit(sample_categorical)(jax.random.key(0), rows))
    assert chisquare_pvalue(tokens, probs) > ACCEPT
    sharper = np.exp(1.1 * (logits - logits.max()))
    assert chisquare_pvalue(tokens, sharper / sharper.sum()) < REJECT


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.9, 0.99])
def test_top_p_bisection_matches_sorted_definition(top_p):
    """The bisection cut-off equals the sort-based nucleus on wide rows, including ties."""
    rng = np.random.default_rng(1)
    z = rng.normal(size=(16, 1000)) * rng.uniform(0.2, 4.0, size=(16, 1))
    z[:4, :10] = z[:4, :1]  # ties at the top
    z[4:8] = np.round(z[4:8], 1)  # many ties everywhere
    z = z.astype(np.float32)
    got = np.asarray(top_p_mask(jnp.asarray(z), jnp.float32(top_p)))
    expected = np.stack([truncated_distribution(row, top_p=top_p) > 0 for row in z])
    np.testing.assert_array_equal(got, expected)
    # The sorted-candidates path gives the same set.
    full_sorted = -np.sort(-z, axis=-1)
    via_sorted = np.asarray(
        top_p_mask(jnp.asarray(z), jnp.float32(top_p), jnp.asarray(full_sorted))
    )
    np.testing.assert_array_equal(via_sorted, expected)
