"""Token-gradient proxies for DelTA, used without ever forming the ``[B, T, H]`` vectors ``v``.

DelTA (DELTA_SPEC §3) only ever needs two things from the per-token vectors ``v``:

* projections ``v · d`` of every token onto one direction ``d`` ``[H]`` (the margins), and
* weighted sums ``Σ_t w_t v_t`` ``[H]`` over all tokens (the centroids).

Each proxy below provides exactly these two operations over a list of micro-batch chunks, so the
caller's statistics code is the same for one batch, for micro-batches and for sharded batches.

Low-precision operands (bf16 / f16 ``hidden`` or LM-head weight) are multiplied with the float32
factor split into a high and a low part of the operand's dtype, ``x ≈ hi + lo``, stacked along a
size-2 axis of the same dot product: the big operand is read once and the accumulation is
float32 (``preferred_element_type``). The result then equals the float32 computation on the
stored low-precision values to about 16 mantissa bits. On TPU the operand enters the dot as is;
JAX's CPU and GPU lowerings convert it to float32 inside each dot (a transient copy of one
micro-batch on CPU; XLA usually fuses it into the GEMM on GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float, Int

_F32 = jnp.float32


def _accumulator(dtype: jnp.dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, _F32)


def _out_sharding(x: Array, *dims: int | None) -> NamedSharding | None:
    """Output sharding for a dot product whose contraction runs over sharded dimensions.

    Only needed (and only returned) when ``x`` lives on a mesh with Explicit axes, where JAX asks
    for it; ``dims`` picks, for each output dimension, the dimension of ``x`` whose sharding it
    keeps (None: replicated).
    """
    sharding = jax.typeof(x).sharding
    if not any(t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types):
        return None
    spec = PartitionSpec(*(None if d is None else sharding.spec[d] for d in dims))
    return NamedSharding(sharding.mesh, spec)


def _split(x: Float[Array, ...], dtype: jnp.dtype) -> Array:
    """Returns ``[2, ...]`` (hi, lo) in ``dtype`` with ``hi + lo ≈ x``, or ``[1, ...]`` if exact."""
    if jnp.finfo(dtype).bits >= 32:
        return x.astype(dtype)[None]
    hi = x.astype(dtype)
    lo = (x - hi.astype(x.dtype)).astype(dtype)
    return jnp.stack([hi, lo])


class LmHeadRow:
    """``v_t = (1 − p_t) · h_t``: gradient of ``log p_t(y_t)`` w.r.t. the LM-head row of ``y_t``.

    Args:
      hiddens: per chunk, ``[b, T, H]`` final hidden states in any float dtype.
      scales: per chunk, ``[b, T]`` float32 ``1 − p_t``, zero on padding.
    """

    def __init__(self, hiddens: list[Float[Array, "b T H"]], scales: list[Float[Array, "b T"]]):
        self.hiddens = hiddens
        self.scales = scales

    def project(self, d: Float[Array, " H"]) -> list[Float[Array, "b T"]]:
        out = []
        for h, s in zip(self.hiddens, self.scales, strict=True):
            parts = _split(d, h.dtype)  # [2|1, H]
            hd = jnp.einsum(
                "bth,kh->bt",
                h,
                parts,
                preferred_element_type=_accumulator(h.dtype),
                out_sharding=_out_sharding(h, 0, 1),
            )
            out.append(s * hd.astype(s.dtype))
        return out

    def weighted_sums(self, weights: list[Float[Array, "m b T"]]) -> Float[Array, "m H"]:
        total = None
        for h, s, w in zip(self.hiddens, self.scales, weights, strict=True):
            parts = _split(w * s, h.dtype)  # [2|1, m, b, T]
            acc = _accumulator(h.dtype)
            chunk = jnp.einsum(
                "kmbt,bth->mh",
                parts,
                h,
                preferred_element_type=acc,
                out_sharding=_out_sharding(h, None, 2),
            )
            chunk = chunk.astype(w.dtype)
            total = chunk if total is None else total + chunk
        return total


class HiddenTopk:
    """``v_t = W_{y_t} − Σ_{j ∈ topk_t} p̃_t(j) W_j``: top-k restricted gradient w.r.t. ``h_t``.

    With ``u = Wᵀ d`` ``[V]`` a projection is a gather, ``v_t · d = u[y_t] − Σ_j p̃_t(j) u[j]``;
    a weighted sum is ``W c`` with ``c`` ``[V]`` the scatter-added token weights. Both cost one
    ``H × V`` mat-vec per pass, independent of the number of tokens.

    Args:
      lm_head: ``[H, V]`` LM-head weight (logits = h @ W), any float dtype.
      token_ids: per chunk, ``[b, T]`` sampled token ids.
      topk_ids: per chunk, ``[b, T, k]`` ids of the top-k logits.
      probs: per chunk, ``[b, T, k]`` float32 top-k probabilities renormalised over the k,
        zero on padding.
      masks: per chunk, ``[b, T]`` bool, True on real tokens.
    """

    def __init__(
        self,
        lm_head: Float[Array, "H V"],
        token_ids: list[Int[Array, "b T"]],
        topk_ids: list[Int[Array, "b T k"]],
        probs: list[Float[Array, "b T k"]],
        masks: list[Bool[Array, "b T"]],
    ):
        self.lm_head = lm_head
        self.token_ids = token_ids
        self.topk_ids = topk_ids
        self.probs = probs
        self.masks = masks

    def project(self, d: Float[Array, " H"]) -> list[Float[Array, "b T"]]:
        w = self.lm_head
        parts = _split(d, w.dtype)
        u = jnp.einsum(
            "hv,kh->v",
            w,
            parts,
            preferred_element_type=_accumulator(w.dtype),
            out_sharding=_out_sharding(w, 1),
        )
        u = u.astype(self.probs[0].dtype)
        out = []
        for y, ids, p, m in zip(self.token_ids, self.topk_ids, self.probs, self.masks, strict=True):
            # Padding may hold any id; clipped gathers keep them in range and the mask zeroes them.
            own = u.at[y].get(mode="clip")
            rest = jnp.sum(p * u.at[ids].get(mode="clip"), axis=-1)
            out.append(jnp.where(m, own - rest, 0.0))
        return out

    def weighted_sums(self, weights: list[Float[Array, "m b T"]]) -> Float[Array, "m H"]:
        w = self.lm_head
        m_dim, vocab = weights[0].shape[0], w.shape[1]
        c = jnp.zeros((m_dim, vocab), weights[0].dtype)
        for y, ids, p, wt in zip(self.token_ids, self.topk_ids, self.probs, weights, strict=True):
            c = c.at[:, y.reshape(-1)].add(wt.reshape(m_dim, -1), mode="drop")
            spread = -(wt[..., None] * p[None]).reshape(m_dim, -1)  # [m, b*T*k]
            c = c.at[:, ids.reshape(-1)].add(spread, mode="drop")
        parts = _split(c, w.dtype)  # [2|1, m, V]
        out = jnp.einsum(
            "hv,kmv->mh",
            w,
            parts,
            preferred_element_type=_accumulator(w.dtype),
            out_sharding=_out_sharding(w, None, 0),
        )
        return out.astype(c.dtype)
