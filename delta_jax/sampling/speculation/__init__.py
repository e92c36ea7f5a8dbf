"""Speculative rollouts without a draft model: drafts looked up in text the rollout already has
(:mod:`~delta_jax.sampling.speculation.drafts`, host side), their verification on device
(:mod:`~delta_jax.sampling.speculation.speculate`), and the ``auto`` policy that measures
whether speculating pays (:mod:`~delta_jax.sampling.speculation.auto_speculation`)."""

from delta_jax.sampling.speculation.auto_speculation import AutoSpeculation
from delta_jax.sampling.speculation.drafts import SOURCES, Drafter, Drafts
from delta_jax.sampling.speculation.speculate import DRAFT_OUTCOMES

__all__ = ["DRAFT_OUTCOMES", "SOURCES", "AutoSpeculation", "Drafter", "Drafts"]
