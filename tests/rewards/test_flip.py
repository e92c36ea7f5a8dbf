"""Reward noise (``reward.flip_fraction``): which rewards flip, reproducibly, only in training."""

import numpy as np
import pytest

from delta_jax.config import ConfigError, load_config
from delta_jax.rewards import FlippedRewards, RewardScorer, RewardSet


@pytest.fixture(scope="module")
def serial_math():
    with RewardScorer("math", num_workers=0) as scorer:
        yield scorer


def _batch(n: int, seed: int):
    rng = np.random.default_rng(seed)
    answers = [str(a) for a in rng.integers(10, 99, size=n)]
    responses = [f"\\boxed{{{a if rng.random() < 0.5 else 0}}}" for a in answers]
    return ["q"] * n, responses, [{"answer": a} for a in answers]


def test_flips_a_fraction_exactly_where_it_says(serial_math):
    prompts, responses, items = _batch(500, seed=0)
    clean = serial_math.score(prompts, responses, items)
    noisy = FlippedRewards(serial_math, 0.3, seed=7).score(prompts, responses, items)
    flipped = noisy.rewards != clean.rewards
    # Every changed reward is 1 - r, and the count reported is the count changed.
    np.testing.assert_array_equal(noisy.rewards[flipped], 1.0 - clean.rewards[flipped])
    assert noisy.counts["flipped"] == flipped.sum()
    # Binomial(500, 0.3): mean 150, sd 10.2; 5 sd either side.
    assert 99 < flipped.sum() < 201
    assert noisy.reasons == clean.reasons


def test_same_batch_same_flips_other_seed_or_batch_other_flips(serial_math):
    prompts, responses, items = _batch(200, seed=1)
    a = FlippedRewards(serial_math, 0.5, seed=3).score(prompts, responses, items).rewards
    b = FlippedRewards(serial_math, 0.5, seed=3).score(prompts, responses, items).rewards
    c = FlippedRewards(serial_math, 0.5, seed=4).score(prompts, responses, items).rewards
    np.testing.assert_array_equal(a, b)  # a resumed run re-scores the same samples the same
    assert (a != c).any()
    responses2 = [*responses[:-1], responses[-1] + " "]
    d = FlippedRewards(serial_math, 0.5, seed=3).score(prompts, responses2, items).rewards
    assert (a[:-1] != d[:-1]).any()  # a different batch draws different flips


def test_zero_and_one(serial_math):
    prompts, responses, items = _batch(50, seed=2)
    clean = serial_math.score(prompts, responses, items).rewards
    np.testing.assert_array_equal(
        FlippedRewards(serial_math, 0.0, seed=0).score(prompts, responses, items).rewards, clean
    )
    np.testing.assert_array_equal(
        FlippedRewards(serial_math, 1.0, seed=0).score(prompts, responses, items).rewards,
        1.0 - clean,
    )
    assert FlippedRewards(serial_math, 0.1, seed=0).kind == "math"  # delegated attributes


def test_config_range_and_wiring():
    with pytest.raises(ConfigError, match="reward.flip_fraction"):
        load_config(None, ["reward.flip_fraction=1.5"])
    from delta_jax.rl.setup import make_scorers

    noisy = load_config(None, ["reward.flip_fraction=0.25", "run.seed=5", "reward.num_workers=0"])
    train, evaluation = make_scorers(noisy)
    assert isinstance(train, FlippedRewards) and (train.fraction, train.seed) == (0.25, 5)
    assert train.scorer is evaluation and isinstance(evaluation, RewardSet)
    clean = load_config(None, ["reward.num_workers=0"])
    train, evaluation = make_scorers(clean)
    assert train is evaluation and isinstance(train, RewardSet)
