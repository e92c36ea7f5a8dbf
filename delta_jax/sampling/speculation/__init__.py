"""Speculative rollouts without a draft model: drafts looked up in text the rollout already has
(:mod:`~delta_jax.sampling.speculation.drafts`, host side), their verification on device
(:mod:`~delta_jax.sampling.speculation.speculate`), the ``auto`` policy that measures
whether speculating pays (:mod:`~delta_jax.sampling.speculation.auto_speculation`), and the one
object the engine calls whichever way a request decodes
(:mod:`~delta_jax.sampling.speculation.decoding`: plain decoding drafts nothing)."""

from delta_jax.sampling.speculation.auto_speculation import AutoSpeculation
from delta_jax.sampling.speculation.decoding import (
    PLAIN,
    AutoDrafting,
    Drafting,
    PlainDecoding,
    Speculation,
    speculation_for,
)
from delta_jax.sampling.speculation.drafts import SOURCES, Drafter, Drafts
from delta_jax.sampling.speculation.speculate import DRAFT_OUTCOMES

__all__ = [
    "DRAFT_OUTCOMES",
    "PLAIN",
    "SOURCES",
    "AutoDrafting",
    "AutoSpeculation",
    "Drafter",
    "Drafting",
    "Drafts",
    "PlainDecoding",
    "Speculation",
    "speculation_for",
]
