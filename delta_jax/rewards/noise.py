"""Reward noise for controlled experiments: a verifier that is wrong on a fixed share of items."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from delta_jax.rewards.batch import RewardBatch, RewardScorer


class FlippedRewards:
    """A scorer whose rewards are flipped ``r -> 1 - r`` on a random ``fraction`` of items.

    Reward noise for controlled experiments (``reward.flip_fraction``): a verifier that is wrong
    on a fixed share of items, the case where DelTA's contrast between positive and negative
    responses is itself noisy. Which items flip depends only on ``seed`` and the batch's text
    (a digest of its prompts and responses seeds the choice), so a resumed run, whose sampled
    responses are the same, flips the same items. Meant for 0/1 rewards. The wrapped scorer's
    other attributes (``kind``, ``close``...) are its own; ``counts["flipped"]`` says how many
    rewards flipped.
    """

    def __init__(self, scorer: RewardScorer, fraction: float, seed: int):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction={fraction} must be in [0, 1]")
        self.scorer, self.fraction, self.seed = scorer, fraction, seed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scorer, name)

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        items: Sequence[Mapping[str, Any]],
        **kwargs: Any,
    ) -> RewardBatch:
        batch = self.scorer.score(prompts, responses, items, **kwargs)
        return self.finish(batch, prompts, responses)

    def submit(self, prompts, responses, items, **kwargs: Any):
        """The wrapped scorer's submission; flip the whole batch with :meth:`finish`."""
        return self.scorer.submit(prompts, responses, items, **kwargs)

    def finish(self, batch: RewardBatch, prompts, responses) -> RewardBatch:
        """Flips the rewards of a whole scored batch (which items depends on all its text)."""
        digest = hashlib.blake2b("\0".join([*prompts, *responses]).encode(), digest_size=8)
        rng = np.random.default_rng([self.seed, int.from_bytes(digest.digest(), "little")])
        flip = rng.random(len(batch.rewards)) < self.fraction
        rewards = np.where(flip, 1.0 - batch.rewards, batch.rewards).astype(np.float32)
        counts = {**batch.counts, "flipped": int(flip.sum())}
        return RewardBatch(rewards, batch.reasons, counts, batch.components)
