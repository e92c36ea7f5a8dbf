"""Speculative rollouts in a training run: ``rollout.speculate=true`` changes how the rollout's
tokens come (verify steps of drafted tokens: a line of them, or with ``rollout.draft_depth`` a
trie), not which, so the run is the plain one; ``rollout.speculate=auto`` never speculates on
CPU."""

import numpy as np
import pytest

from delta_jax import Trainer
from delta_jax.config import load_config
from tests.rl.conftest import tiny_overrides
from tests.rl.test_trainer import DEMO


@pytest.mark.slow  # four short runs
def test_speculative_rollouts_train_as_plain_ones(tmp_path, demo_model_dir):
    rows = {}
    modes = {
        "false": ("rollout.speculate=false",),
        "true": ("rollout.speculate=true", "rollout.draft_tokens=3"),
        "trie": ("rollout.speculate=true", "rollout.draft_tokens=6", "rollout.draft_depth=3"),
        "auto": ("rollout.speculate=auto", "rollout.draft_tokens=3"),
    }
    for mode, extra in modes.items():
        config = load_config(
            DEMO, tiny_overrides(tmp_path / mode, demo_model_dir, "run.steps=2", *extra)
        )
        with Trainer(config) as trainer:
            rows[mode] = [trainer.step() for _ in range(1 if mode == "auto" else 2)]
            depth = trainer.sampler.draft_depth
        assert depth == (3 if mode == "trie" else 0)
    # auto on CPU (a compute-bound decode): the plain rollout, and says so.
    auto, off = rows["auto"][0], rows["false"][0]
    assert auto["speculate/on"] == 0 and auto["reward_mean"] == off["reward_mean"]
    assert [k for k in auto if k.startswith("speculate/")] == ["speculate/on"]
    pairs = [zip(rows["false"], rows[mode], strict=True) for mode in ("true", "trie")]
    for off, on in (pair for modes in pairs for pair in modes):
        # The same tokens, so the same rewards and groups; the loss from the same rollouts'
        # log-probs (another attention path on CPU: float32 rounding only).
        for key in ("reward_mean", "response_length_mean", "dynamic/informative_groups"):
            assert on[key] == off[key], key
        np.testing.assert_allclose(on["loss"], off["loss"], rtol=1e-4, atol=1e-6)
        assert not any(k.startswith("speculate/") for k in off)
        # Each verify step emits one token and each accepted draft: the steps saved are the
        # accepted drafts.
        sources = [k.rsplit("/", 1)[1] for k in on if k.startswith("speculate/drafted/")]
        drafted = {s: on[f"speculate/drafted/{s}"] for s in sources}
        accepted = sum(on[f"speculate/acceptance/{s}"] * drafted[s] for s in sources)
        assert sum(drafted.values()) > 0
        assert on["speculate/steps_saved"] == pytest.approx(accepted)
        assert on["speculate/on"] == 1
