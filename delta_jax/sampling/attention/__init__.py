"""Paged attention: the KV pages on the host (:mod:`~delta_jax.sampling.attention.pages`) and on
device (:mod:`~delta_jax.sampling.attention.paged`), the attention paths (XLA, the TPU kernels,
the dense CPU path) and the backends that pair each path with the page layout it reads, behind
one interface (:class:`PagedBackend`), picked once per engine."""

from delta_jax.sampling.attention.backends import (
    NAMES,
    PagedBackend,
    backend_for,
    resolve_attention,
)
from delta_jax.sampling.attention.pages import pages_for, pow2

__all__ = ["NAMES", "PagedBackend", "backend_for", "pages_for", "pow2", "resolve_attention"]
