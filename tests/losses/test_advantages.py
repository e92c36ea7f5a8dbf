"""delta_jax.losses.advantages against the float64 NumPy oracles in policy_oracle.py.

Tolerance (float32 JAX vs float64 oracle, values of order 1): rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax.losses.advantages import (
    batch_normalize,
    dr_grpo_advantages,
    grpo_advantages,
    informative_groups,
    overlong_penalty,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from tests.losses import policy_oracle as oracle

RTOL, ATOL = 1e-5, 1e-6
GROUP = 4
_rng = np.random.default_rng(0)
# 5 groups of 4: binary rewards (one all-correct, one all-wrong group), then continuous ones.
REWARDS = np.concatenate(
    [[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0], _rng.normal(size=4), _rng.uniform(-1, 2, size=4)]
).astype(np.float32)
LENGTHS = _rng.integers(0, 40, size=REWARDS.size)


def close(got, want):
    np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("ddof", [0, 1])
def test_grpo(ddof):
    got = grpo_advantages(jnp.asarray(REWARDS), GROUP, ddof=ddof)
    close(got, oracle.grpo_ref(REWARDS, GROUP, ddof=ddof))
    assert got.dtype == jnp.float32
    assert not np.any(np.asarray(got)[4:12])  # equal-reward groups: exactly zero


def test_grpo_eps_and_integer_rewards():
    ints = np.array([1, 0, 0, 0, 1, 1], np.int32)
    close(grpo_advantages(ints, 3, eps=0.5), oracle.grpo_ref(ints, 3, eps=0.5))


def test_dr_grpo():
    close(dr_grpo_advantages(REWARDS, GROUP), oracle.dr_grpo_ref(REWARDS, GROUP))


@pytest.mark.parametrize("group_size", [2, 4])
def test_rloo(group_size):
    close(rloo_advantages(REWARDS, group_size), oracle.rloo_ref(REWARDS, group_size))


def test_reinforce_pp_baseline():
    close(reinforce_pp_baseline_advantages(REWARDS, GROUP), oracle.reinforce_pp_ref(REWARDS, GROUP))
    close(
        reinforce_pp_baseline_advantages(REWARDS, GROUP, lengths=LENGTHS, eps=1e-4),
        oracle.reinforce_pp_ref(REWARDS, GROUP, lengths=LENGTHS, eps=1e-4),
    )


def test_reinforce_pp_lengths_equal_token_level_whitening():
    """Weighting by lengths = whitening the advantage broadcast over every valid token."""
    got = reinforce_pp_baseline_advantages(REWARDS, GROUP, lengths=LENGTHS)
    tokens = np.repeat(oracle.dr_grpo_ref(REWARDS, GROUP), LENGTHS)
    whitened = oracle.whiten_ref(list(tokens), [1.0] * tokens.size, 1e-8)
    close(np.repeat(np.asarray(got), LENGTHS), whitened)


def test_batch_normalize():
    values = _rng.normal(3.0, 2.0, size=(4, 6)).astype(np.float32)
    mask = _rng.uniform(size=(4, 6)) < 0.7
    close(
        batch_normalize(values),
        oracle.whiten_ref(list(values.ravel()), [1.0] * 24, 1e-8).reshape(4, 6),
    )
    want = np.zeros((4, 6))
    want[mask] = oracle.whiten_ref(list(values[mask]), [1.0] * int(mask.sum()), 1e-8)
    close(batch_normalize(values, mask), want)
    # Degenerate: one value, or nothing, stays finite.
    close(batch_normalize(np.array([5.0]), np.array([1])), [0.0])
    close(batch_normalize(np.array([5.0, 1.0]), np.array([0, 0])), [0.0, 0.0])


def test_informative_groups():
    got = informative_groups(REWARDS, GROUP)
    assert got.dtype == jnp.bool_
    np.testing.assert_array_equal(got, oracle.informative_ref(REWARDS, GROUP))
    np.testing.assert_array_equal(got, [True, False, False, True, True])


def test_overlong_penalty():
    max_len, buffer = 64, 16
    lengths = np.array([0, 47, 48, 49, 56, 63, 64, 65, 500])
    for factor in (1.0, 0.5):
        got = overlong_penalty(lengths, max_response_length=max_len, buffer=buffer, factor=factor)
        close(got, oracle.overlong_ref(lengths, max_len, buffer, factor))
    got = overlong_penalty(lengths, max_response_length=max_len, buffer=buffer)
    # The documented anchor points: 0 up to max − buffer, −factor/2 halfway, −factor at the limit.
    np.testing.assert_array_equal(np.asarray(got)[[2, 4, 6, 7]], [0.0, -0.5, -1.0, -1.0])


def test_jit_equals_eager():
    fns = [
        lambda r: grpo_advantages(r, GROUP),
        lambda r: dr_grpo_advantages(r, GROUP),
        lambda r: rloo_advantages(r, GROUP),
        lambda r: reinforce_pp_baseline_advantages(r, GROUP, lengths=LENGTHS),
        lambda r: batch_normalize(r),
        lambda r: informative_groups(r, GROUP),
        lambda r: overlong_penalty(r * 10, max_response_length=16, buffer=4),
    ]
    rewards = jnp.asarray(REWARDS)
    for fn in fns:
        np.testing.assert_allclose(jax.jit(fn)(rewards), fn(rewards), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: grpo_advantages(np.ones((2, 4)), 4),
            r"rewards must have shape \[B\], got \(2, 4\)",
        ),
        (lambda: grpo_advantages(np.ones(6), 4), r"shape \(6,\), not a whole number.*group_size=4"),
        (lambda: grpo_advantages(np.ones(4), 1), r"group_size must be >= 2 here, got 1"),
        (lambda: grpo_advantages(np.ones(4), 2, ddof=2), r"ddof must be 0 or 1, got 2"),
        (lambda: rloo_advantages(np.ones(4), 1), r"group_size must be >= 2"),
        (lambda: dr_grpo_advantages(np.ones(4), 2.0), r"group_size must be a Python int, got 2.0"),
        (lambda: dr_grpo_advantages(np.ones(4, np.complex64), 2), r"rewards must be real-valued"),
        (
            lambda: reinforce_pp_baseline_advantages(np.ones(4), 2, lengths=np.ones(3)),
            r"lengths must have shape \(4,\).*got \(3,\)",
        ),
        (lambda: batch_normalize(np.ones(4), np.ones(3)), r"mask must have the shape of values"),
        (lambda: batch_normalize(np.ones(4, np.int32)), r"values must have a floating dtype"),
        (lambda: informative_groups(np.ones(5), 2), r"group_size=2"),
        (
            lambda: overlong_penalty(np.ones(3), max_response_length=8, buffer=9),
            r"buffer must be in \(0, max_response_length=8\], got 9",
        ),
        (
            lambda: overlong_penalty(np.ones(3), max_response_length=0, buffer=1),
            r"max_response_length must be a number > 0, got 0",
        ),
        (
            lambda: overlong_penalty(np.ones((3, 1)), max_response_length=8, buffer=2),
            r"lengths must have shape \[B\]",
        ),
    ],
)
def test_bad_input_raises(call, message):
    with pytest.raises(ValueError, match=message):
        call()
