"""Sampling strategies: one token per row from a batch of next-token logits.

A strategy is a tiny frozen pytree: its *structure* (which truncations are on, the static
``top_k``) selects the compiled program, its *values* (temperature, ``top_p``, ``min_p``) are
traced, so changing a value never recompiles. Every strategy returns three things per row:

* ``token``: the sampled id;
* ``logprob``: its log-prob under the distribution it was actually drawn from (temperature, then
  truncation, then renormalisation);
* ``untruncated_logprob``: its log-prob under the untruncated temperature-scaled distribution
  ``log_softmax(logits / temperature)``, which is what a trainer recomputes. The two differ exactly
  when truncation removed probability mass; mixing them up is a known source of off-policy bias.

Truncation, in this order (vLLM's order), applied to ``z = logits / temperature``:

1. top-k: keep the ``k`` largest ``z`` (tokens tied with the k-th value are kept as well);
2. top-p (nucleus) over the distribution renormalised after top-k: sort descending, keep token
   ``i`` while the mass strictly before it is ``< top_p`` (so the token that crosses ``top_p`` is
   kept, and the most likely token always is); ties with the last kept value are kept;
3. min-p: keep ``p_i >= min_p * max_j p_j``, i.e. ``z_i >= max(z) + log(min_p)``. The ratio is the
   same before and after renormalisation, so this is a plain intersection.

Greedy (temperature 0) has a point-mass behaviour distribution; its ``logprob`` and
``untruncated_logprob`` are both reported under the temperature-1 softmax, ``log_softmax(logits)``,
which is the useful quantity for scoring and for KL estimates.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Float, Int, PRNGKeyArray

__all__ = [
    "Categorical",
    "Greedy",
    "SampleResult",
    "make_strategy",
    "min_p_mask",
    "sample_categorical",
    "strategy_signature",
    "top_k_mask",
    "top_p_mask",
    "validate_sampling_args",
]


class SampleResult(NamedTuple):
    """What a strategy returns for a batch of rows (all shapes ``[B]``)."""

    token: Int[Array, " B"]
    logprob: Float[Array, " B"]
    untruncated_logprob: Float[Array, " B"]


def _pick(logp: Float[Array, "B V"], token: Int[Array, " B"]) -> Float[Array, " B"]:
    return jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def top_k_mask(z: Float[Array, "B V"], k: int) -> tuple[jax.Array, Float[Array, "B k"]]:
    """Marks the ``k`` largest entries of each row.

    Args:
      z: ``[B, V]`` scaled logits.
      k: static number of entries to keep, ``1 <= k`` (clipped to ``V``).

    Returns:
      ``(keep, top)``: ``keep`` bool ``[B, V]`` (ties with the k-th value included) and the ``k``
      largest values of each row in descending order, ``[B, k]``.

    Examples:
      >>> keep, _ = top_k_mask(jnp.array([[0.0, 2.0, 1.0]]), 2)
      >>> keep.tolist()
      [[False, True, True]]
    """
    top = jax.lax.top_k(z, min(k, z.shape[-1]))[0]
    # min(top) is the k-th value; slicing top[:, -1] instead makes XLA:CPU fall back to a full
    # sort of the row (about 100x slower at V = 32000).
    return z >= jnp.min(top, axis=-1, keepdims=True), top


def _wide(logits: Float[Array, ...]) -> Float[Array, ...]:
    """float32, or float64 logits kept as they are (x64 numerics checks)."""
    return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))


def _uint(dtype) -> Any:
    """The unsigned integer of a float's width: uint32 for float32, uint64 for float64."""
    return jnp.uint64 if jnp.dtype(dtype).itemsize == 8 else jnp.uint32


def _sortable(x: Float[Array, ...]) -> jax.Array:
    """Maps float32 (float64) to uint32 (uint64) with the same order (an involution up to the
    bit flips)."""
    ut = _uint(x.dtype)
    top = jnp.dtype(ut).itemsize * 8 - 1
    u = jax.lax.bitcast_convert_type(x, ut)
    return jnp.where((u >> top) == 1, ~u, u | (ut(1) << top))


def _unsortable(k: jax.Array, dtype) -> Float[Array, ...]:
    ut = k.dtype.type
    top = k.dtype.itemsize * 8 - 1
    u = jnp.where((k >> top) == 1, k & ~(ut(1) << top), ~k)
    return jax.lax.bitcast_convert_type(u, dtype)


def top_p_mask(
    z: Float[Array, "B V"], top_p: Float[Array, ""], sorted_z: Float[Array, "B M"] | None = None
) -> jax.Array:
    r"""Marks the nucleus: the smallest top set whose probability reaches ``top_p``.

    With :math:`q = \mathrm{softmax}` over the candidates, token :math:`i` is kept iff the mass
    of the candidates strictly above it is below ``top_p``,
    :math:`\sum_{j: z_j > z_i} q_j < p` (in sorted order: keep while the mass before a token is
    ``< p``, ties with the last kept value included).

    With ``sorted_z`` (the top-k survivors, descending) the cut-off is read off their cumulative
    sum. Without it a full sort of ``V`` entries per row would be slow on CPU, so the cut-off
    ``t* = min{t : mass(z > t) < p}``, which is one of the ``z`` values, is found exactly by a
    32-step bisection over the order-preserving integer image of float32 (64 steps for float64).

    Args:
      z: ``[B, V]`` scaled logits.
      top_p: scalar in ``(0, 1)`` (:func:`make_strategy` turns ``top_p == 1`` off; at exactly 1 a
        float32 cumulative sum can round up to 1 and drop the far tail).
      sorted_z: optional ``[B, M]`` descending candidate values (the top-k survivors); None means
        every token is a candidate.

    Returns:
      bool ``[B, V]``.

    Examples:
      >>> z = jnp.log(jnp.array([[0.1, 0.6, 0.3]]))
      >>> top_p_mask(z, jnp.float32(0.8)).tolist()
      [[False, True, True]]
    """
    if sorted_z is not None:
        q = jax.nn.softmax(sorted_z, axis=-1)
        kept = jnp.cumsum(q, axis=-1) - q < top_p
        cutoff = jnp.min(jnp.where(kept, sorted_z, jnp.inf), axis=-1, keepdims=True)
        return z >= cutoff

    q = jax.nn.softmax(z, axis=-1)

    def mass_above(t: Float[Array, "B 1"]) -> Float[Array, "B 1"]:
        return jnp.sum(jnp.where(z > t, q, 0.0), axis=-1, keepdims=True)

    lo = _sortable(jnp.min(z, axis=-1, keepdims=True))
    hi = _sortable(jnp.max(z, axis=-1, keepdims=True))  # mass above the max is 0 < p

    def bisect(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        below = mass_above(_unsortable(mid, z.dtype)) < top_p
        return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

    # Invariant: mass_above(hi) < p and (mass_above(lo) >= p or lo is the minimum).
    lo, hi = jax.lax.fori_loop(0, 8 * z.dtype.itemsize, bisect, (lo, hi))
    keep_all = mass_above(_unsortable(lo, z.dtype)) < top_p
    return z >= jnp.where(keep_all, _unsortable(lo, z.dtype), _unsortable(hi, z.dtype))


def min_p_mask(z: Float[Array, "B V"], min_p: Float[Array, ""]) -> jax.Array:
    """Marks tokens whose probability is at least ``min_p`` times the row's largest.

    Args:
      z: ``[B, V]`` scaled logits.
      min_p: scalar in ``[0, 1)``.

    Returns:
      bool ``[B, V]``.

    Examples:
      >>> min_p_mask(jnp.log(jnp.array([[0.5, 0.3, 0.05]])), jnp.float32(0.2)).tolist()
      [[True, True, False]]
    """
    return z >= jnp.max(z, axis=-1, keepdims=True) + jnp.log(min_p)


def sample_categorical(
    key: PRNGKeyArray, logits: Float[Array, "B V"], block: int = 128
) -> jax.Array:
    """Draws one id per row from ``softmax(logits)`` (``-inf`` entries are never drawn).

    Inverse-CDF sampling in two levels: a block of ``block`` ids by the blocks' masses, then an id
    inside it; ``P(id) = P(block) P(id | block)`` is exactly the softmax. It needs two uniforms
    per row instead of the ``V`` Gumbel draws of ``jax.random.categorical`` (whose random-bit
    generation dominated a CPU decode step), and only short cumulative sums.

    Args:
      key: PRNG key.
      logits: ``[B, V]`` float32, at least one finite entry per row.
      block: ids per block.

    Returns:
      int32 ``[B]``.

    Examples:
      >>> sample_categorical(jax.random.key(0), jnp.array([[0.0, -jnp.inf, 0.0]])).shape
      (1,)
    """
    B, V = logits.shape
    nb = -(-V // block)
    w = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    w = jnp.pad(w, ((0, 0), (0, nb * block - V))).reshape(B, nb, block)
    u = jax.random.uniform(key, (2, B, 1), w.dtype)

    def invert(weights: Float[Array, "B M"], u: Float[Array, "B 1"]) -> jax.Array:
        cdf = jnp.cumsum(weights, axis=-1)
        index = jnp.sum(cdf <= u * cdf[:, -1:], axis=-1)
        # Rounding can push u * total onto the total; never return a zero-mass entry.
        last = weights.shape[-1] - 1 - jnp.argmax(jnp.flip(weights, -1) > 0, axis=-1)
        return jnp.minimum(index, last)

    b = invert(jnp.sum(w, axis=-1), u[0])
    i = invert(jnp.take_along_axis(w, b[:, None, None], axis=1)[:, 0], u[1])
    return (b * block + i).astype(jnp.int32)


@struct.dataclass
class Greedy:
    """Arg-max decoding; log-probs under ``log_softmax(logits)`` (temperature 1).

    Examples:
      >>> Greedy()(jnp.array([[0.0, 3.0, 1.0]]), jax.random.key(0)).token.tolist()
      [1]
    """

    def __call__(self, logits: Float[Array, "B V"], key: PRNGKeyArray) -> SampleResult:
        del key
        logits = _wide(logits)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logp = _pick(jax.nn.log_softmax(logits, axis=-1), token)
        return SampleResult(token, logp, logp)


@struct.dataclass
class Categorical:
    """Ancestral sampling at a temperature, with optional top-k, top-p and min-p truncation.

    The behaviour distribution is ``softmax(where(keep, z, -inf))`` with ``z = logits /
    temperature`` and ``keep`` the intersection of the enabled masks (module docstring). A
    truncation is off when its field is ``None`` (``top_k == 0``); that is part of the pytree
    structure, so each combination compiles its own program and a disabled truncation costs
    nothing (no sort when top-p is off).

    Attributes:
      temperature: scalar > 0 (traced).
      top_p: scalar in ``(0, 1)`` or None (traced).
      min_p: scalar in ``(0, 1)`` or None (traced).
      top_k: static int, 0 for off.

    Examples:
      >>> s = Categorical(temperature=jnp.float32(0.7), top_k=2)
      >>> out = s(jnp.array([[0.0, 3.0, 1.0]]), jax.random.key(0))
      >>> int(out.token[0]) in (1, 2)
      True
    """

    temperature: Float[Array, ""]
    top_p: Float[Array, ""] | None = None
    min_p: Float[Array, ""] | None = None
    top_k: int = struct.field(pytree_node=False, default=0)

    def __call__(self, logits: Float[Array, "B V"], key: PRNGKeyArray) -> SampleResult:
        z = _wide(logits) / self.temperature
        keep = None
        sorted_z = None  # after top-k the nucleus only needs the k survivors, already sorted
        if self.top_k:
            keep, sorted_z = top_k_mask(z, self.top_k)
        if self.top_p is not None:
            nucleus = top_p_mask(z, self.top_p, sorted_z)
            keep = nucleus if keep is None else keep & nucleus
        if self.min_p is not None:
            floor = min_p_mask(z, self.min_p)
            keep = floor if keep is None else keep & floor
        truncated = z if keep is None else jnp.where(keep, z, -jnp.inf)
        token = sample_categorical(key, truncated)
        full_logp = _pick(jax.nn.log_softmax(z, axis=-1), token)
        logp = full_logp if keep is None else _pick(jax.nn.log_softmax(truncated, axis=-1), token)
        return SampleResult(token, logp, full_logp)


def validate_sampling_args(temperature: float, top_p: float, top_k: int, min_p: float) -> None:
    """Raises ``ValueError`` naming the first invalid sampling argument."""
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 means off), got {top_k!r}")
    if not isinstance(min_p, (int, float)) or not 0.0 <= min_p < 1.0:
        raise ValueError(f"min_p must be in [0, 1) (0 means off), got {min_p!r}")


def make_strategy(
    temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0
) -> Greedy | Categorical:
    """Builds the strategy for user-facing sampling arguments, after validating them.

    Args:
      temperature: 0 for greedy (the truncation arguments are then ignored), else > 0.
      top_p: nucleus mass in ``(0, 1]``; 1 is off.
      top_k: number of candidates, 0 is off.
      min_p: probability floor relative to the most likely token, in ``[0, 1)``; 0 is off.

    Returns:
      ``Greedy()`` or a ``Categorical`` with the disabled truncations set to None / 0.

    Examples:
      >>> make_strategy(0.0)
      Greedy()
      >>> make_strategy(1.0, top_k=5).top_k
      5
    """
    validate_sampling_args(temperature, top_p, top_k, min_p)
    if temperature == 0:
        return Greedy()
    return Categorical(
        temperature=np.float32(temperature),
        top_p=np.float32(top_p) if top_p < 1.0 else None,
        min_p=np.float32(min_p) if min_p > 0.0 else None,
        top_k=top_k,
    )


def strategy_signature(strategy: Greedy | Categorical) -> tuple:
    """The static part of a strategy (what selects a compiled program), for keys and logs."""
    if isinstance(strategy, Greedy):
        return ("greedy",)
    fields = {f.name: getattr(strategy, f.name) for f in dataclasses.fields(strategy)}
    return (
        "categorical",
        ("top_k", fields["top_k"]),
        ("top_p", fields["top_p"] is not None),
        ("min_p", fields["min_p"] is not None),
    )
