"""Rollout sampling: the :class:`Sampler` and the strategies it draws tokens with.

Two decoders sit behind the sampler: the static KV-cache loop (:mod:`~delta_jax.sampling.static`)
and the continuous-batching engine (:mod:`~delta_jax.sampling.engine`), which runs on the paged
attention backends (:mod:`~delta_jax.sampling.attention`) and may speculate
(:mod:`~delta_jax.sampling.speculation`).
"""

from delta_jax.sampling.buckets import Buckets
from delta_jax.sampling.engine import Turns
from delta_jax.sampling.output import Carry, SamplerOutput
from delta_jax.sampling.sampler import SAMPLING_RULES, Sampler
from delta_jax.sampling.strategies import Categorical, Greedy, SampleResult, make_strategy

__all__ = [
    "SAMPLING_RULES",
    "Buckets",
    "Carry",
    "Categorical",
    "Greedy",
    "SampleResult",
    "Sampler",
    "SamplerOutput",
    "Turns",
    "make_strategy",
]
