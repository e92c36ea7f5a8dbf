"""Rollout sampling: a KV-cache sampler and the strategies it draws tokens with."""

from delta_jax.sampling.buckets import Buckets
from delta_jax.sampling.output import SamplerOutput
from delta_jax.sampling.sampler import SAMPLING_RULES, Sampler
from delta_jax.sampling.spec import Turns
from delta_jax.sampling.strategies import Categorical, Greedy, SampleResult, make_strategy

__all__ = [
    "SAMPLING_RULES",
    "Buckets",
    "Categorical",
    "Greedy",
    "SampleResult",
    "Sampler",
    "SamplerOutput",
    "Turns",
    "make_strategy",
]
