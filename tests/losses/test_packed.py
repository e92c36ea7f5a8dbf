"""Losses on packed rows (several responses per row, segment ids) equal the one-per-row layout."""

import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax.losses import PolicyLossOptions, delta_coefficients, loss_normalizer, policy_loss

LENGTHS = [3, 5, 2, 4, 6]  # response tokens of five responses
ROWS = [[0, 1, 2], [3, 4]]  # packed: responses 0-2 in row 0, 3-4 in row 1 (12 positions each)


def _layouts(seed=0):
    """The same per-token values one response per row ``[5, 6]`` and packed ``[2, 12]``."""
    rng = np.random.default_rng(seed)
    B, T = len(LENGTHS), max(LENGTHS)
    mask = np.arange(T)[None] < np.array(LENGTHS)[:, None]
    fields = {
        "logprobs": -rng.uniform(0.1, 2, (B, T)),
        "old": -rng.uniform(0.1, 2, (B, T)),
        "hidden": rng.normal(size=(B, T, 8)),
    }
    adv = np.array([1.0, -0.5, 0.0, 2.0, -1.5])
    packed = {k: np.zeros((2, 12, *v.shape[2:])) for k, v in fields.items()}
    seg, pmask, padv = np.zeros((2, 12), np.int32), np.zeros((2, 12), bool), np.zeros((2, 12))
    where = []  # (row, start) of each response
    for r, group in enumerate(ROWS):
        at = 1  # a padding position first: segments need not start at 0
        for k, b in enumerate(group, start=1):
            n = LENGTHS[b]
            for name, v in fields.items():
                packed[name][r, at : at + n] = v[b, :n]
            seg[r, at : at + n], pmask[r, at : at + n], padv[r, at : at + n] = k, True, adv[b]
            where.append((b, r, at))
            at += n
    padded = dict(fields, mask=mask, adv=adv)
    return padded, dict(packed, mask=pmask, adv=padv, seg=seg), where


@pytest.mark.parametrize(
    "loss_type,aggregation",
    [
        ("ppo", "token-mean"),
        ("ppo", "seq-mean-token-mean"),
        ("ppo", "seq-mean-token-sum"),
        ("ppo", "seq-mean-token-sum-norm"),
        ("gspo", "seq-mean-token-mean"),
        ("sapo", "seq-mean-token-mean"),
    ],
)
def test_policy_loss_on_packed_rows_equals_one_response_per_row(loss_type, aggregation):
    a, p, _ = _layouts()
    opts = PolicyLossOptions(loss_type=loss_type, aggregation=aggregation, max_response_length=6)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    want, want_m = policy_loss(f32(a["logprobs"]), f32(a["old"]), f32(a["adv"]), a["mask"], opts)
    got, got_m = policy_loss(
        f32(p["logprobs"]), f32(p["old"]), f32(p["adv"]), p["mask"], opts, segment_ids=p["seg"]
    )
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    for key in want_m:
        np.testing.assert_allclose(got_m[key], want_m[key], rtol=1e-6, atol=1e-7, err_msg=key)
    n = loss_normalizer(p["mask"], aggregation, p["seg"])
    assert float(n) == float(loss_normalizer(a["mask"], aggregation))


def test_delta_coefficients_with_per_token_advantages_are_layout_free():
    a, p, where = _layouts(1)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    want = delta_coefficients(f32(a["hidden"]), f32(a["old"]), f32(a["adv"]), a["mask"])
    got = delta_coefficients(f32(p["hidden"]), f32(p["old"]), f32(p["adv"]), p["mask"])
    for b, r, at in where:
        n = LENGTHS[b]
        np.testing.assert_allclose(got[r, at : at + n], want[b, :n], rtol=0, atol=1e-6)
    assert float(jnp.abs(got).sum()) > 0 and float(want[0, :3].std()) > 1e-4  # not constant
