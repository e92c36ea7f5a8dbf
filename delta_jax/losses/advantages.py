"""Outcome-reward advantage estimators for group-sampled RLVR batches, in pure ``jax.numpy``.

Layout convention: ``rewards`` is ``[B]`` with ``B = G · group_size`` and the responses to one
prompt are **contiguous**: group ``g`` is ``rewards[g * group_size:(g + 1) * group_size]``.
Each estimator returns one advantage per response (``float32 [B]``); give it to
``policy_loss(advantages=...)``, which broadcasts it over the response's tokens.

Sample standard deviations use Bessel's correction (``ddof = 1``, as ``torch.std`` and the
verl recipes do) unless an argument says otherwise. Everything is jit-friendly; ``group_size``
and the other structural arguments are Python numbers.

References:
  Shao et al., "DeepSeekMath" (GRPO), 2024.
  Liu et al., "Understanding R1-Zero-Like Training" (Dr.GRPO), 2025.
  Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization" (RLOO), 2024.
  Hu, "REINFORCE++", 2025.
  Yu et al., "DAPO" (dynamic sampling, overlong reward shaping), 2025.
"""

from __future__ import annotations

import numbers

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float


def _groups(rewards: ArrayLike, group_size: int, *, min_size: int = 1) -> Float[Array, "G S"]:
    """Validates ``rewards`` / ``group_size`` and returns ``float32 [G, group_size]``."""
    r = jnp.asarray(rewards)
    if r.ndim != 1:
        raise ValueError(f"rewards must have shape [B], got {r.shape}")
    if not (
        jnp.issubdtype(r.dtype, jnp.floating)
        or jnp.issubdtype(r.dtype, jnp.integer)
        or jnp.issubdtype(r.dtype, jnp.bool_)
    ):
        raise ValueError(f"rewards must be real-valued, got dtype {r.dtype}")
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        raise ValueError(f"group_size must be a Python int, got {group_size!r}")
    if group_size < min_size:
        raise ValueError(f"group_size must be >= {min_size} here, got {group_size}")
    if r.shape[0] % group_size:
        raise ValueError(
            f"rewards has shape {r.shape}, not a whole number of groups of group_size={group_size}"
        )
    return r.astype(jnp.promote_types(r.dtype, jnp.float32)).reshape(-1, group_size)


def _whiten(values: Array, weights: Array, eps: float) -> Array:
    """``(x − mean) / sqrt(var + eps)`` with weighted mean and Bessel-corrected weighted var."""
    n = jnp.sum(weights)
    mean = jnp.sum(weights * values) / jnp.where(n > 0, n, 1)
    var = jnp.sum(weights * jnp.square(values - mean)) / jnp.maximum(n - 1, 1)
    return (values - mean) / jnp.sqrt(var + eps)


def grpo_advantages(
    rewards: Float[Array, " B"], group_size: int, *, eps: float = 1e-6, ddof: int = 1
) -> Float[Array, " B"]:
    """GRPO advantages: reward standardised within its group.

    ``Â_i = (r_i − mean_g(r)) / (std_g(r) + eps)`` with the sample std of the group
    (``ddof = 1`` by default; ``ddof = 0`` gives the population std). A group whose rewards are
    all equal gets ``Â = 0``.

    Args:
      rewards: ``[B]`` rewards, groups contiguous (module docstring).
      group_size: responses per prompt; must exceed ``ddof``.
      eps: added to the std (keeps equal-reward groups finite).
      ddof: delta degrees of freedom of the std, 0 or 1.

    Returns:
      ``float32 [B]`` advantages.

    Examples:
      >>> import jax.numpy as jnp
      >>> [round(a, 3) for a in grpo_advantages(jnp.array([1.0, 0.0, 0.0, 0.0]), 2).tolist()]
      [0.707, -0.707, 0.0, 0.0]
    """
    if ddof not in (0, 1):
        raise ValueError(f"ddof must be 0 or 1, got {ddof!r}")
    g = _groups(rewards, group_size, min_size=ddof + 1)
    mean = jnp.mean(g, axis=-1, keepdims=True)
    std = jnp.std(g, axis=-1, keepdims=True, ddof=ddof)
    return ((g - mean) / (std + eps)).reshape(-1)


def dr_grpo_advantages(rewards: Float[Array, " B"], group_size: int) -> Float[Array, " B"]:
    """Dr.GRPO advantages: reward minus its group mean, no std division.

    ``Â_i = r_i − mean_g(r)``.

    Args:
      rewards: ``[B]`` rewards, groups contiguous.
      group_size: responses per prompt.

    Returns:
      ``float32 [B]`` advantages.

    Examples:
      >>> import jax.numpy as jnp
      >>> dr_grpo_advantages(jnp.array([1.0, 0.0, 0.0, 0.0]), 2).tolist()
      [0.5, -0.5, 0.0, 0.0]
    """
    g = _groups(rewards, group_size)
    return (g - jnp.mean(g, axis=-1, keepdims=True)).reshape(-1)


def rloo_advantages(rewards: Float[Array, " B"], group_size: int) -> Float[Array, " B"]:
    """RLOO advantages: reward minus the mean of the *other* rewards of its group.

    ``Â_i = r_i − (Σ_{j∈g, j≠i} r_j) / (S − 1) = S/(S − 1) · (r_i − mean_g(r))``, ``S`` =
    ``group_size`` (>= 2).

    Args:
      rewards: ``[B]`` rewards, groups contiguous.
      group_size: responses per prompt, at least 2.

    Returns:
      ``float32 [B]`` advantages.

    Examples:
      >>> import jax.numpy as jnp
      >>> rloo_advantages(jnp.array([1.0, 0.0, 0.0]), 3).tolist()
      [1.0, -0.5, -0.5]
    """
    g = _groups(rewards, group_size, min_size=2)
    others = (jnp.sum(g, axis=-1, keepdims=True) - g) / (group_size - 1)
    return (g - others).reshape(-1)


def batch_normalize(
    values: Float[Array, ...], mask: ArrayLike | None = None, *, eps: float = 1e-8
) -> Float[Array, ...]:
    """Whitens values over the whole batch: ``(x − mean) / sqrt(var + eps)``.

    Mean and sample variance (``ddof = 1``; a single value gets variance 0) are taken over the
    entries where ``mask`` is non-zero (all entries when None); masked-out entries return 0.

    Args:
      values: array of any shape.
      mask: optional array of the same shape (non-zero = included).
      eps: added to the variance.

    Returns:
      ``float32`` array shaped like ``values``.

    Examples:
      >>> import jax.numpy as jnp
      >>> batch_normalize(jnp.array([1.0, 2.0, 3.0, 100.0]), jnp.array([1, 1, 1, 0])).tolist()
      [-1.0, 0.0, 1.0, 0.0]
    """
    x = jnp.asarray(values)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"values must have a floating dtype, got {x.dtype}")
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    if mask is None:
        return _whiten(x, jnp.ones_like(x), eps)
    mask = jnp.asarray(mask)
    if mask.shape != x.shape:
        raise ValueError(f"mask must have the shape of values {x.shape}, got {mask.shape}")
    keep = mask != 0
    return jnp.where(keep, _whiten(x, keep.astype(x.dtype), eps), 0)


def reinforce_pp_baseline_advantages(
    rewards: Float[Array, " B"],
    group_size: int,
    *,
    lengths: ArrayLike | None = None,
    eps: float = 1e-8,
) -> Float[Array, " B"]:
    """REINFORCE++-baseline: group-mean baseline, then whitening over the whole batch.

    ``a_i = r_i − mean_g(r)``, then ``Â_i = (a_i − m) / sqrt(v + eps)`` with ``m``, ``v`` the
    batch mean and sample variance (``ddof = 1``) of ``a``. With ``lengths`` the statistics are
    token-weighted, each response counting ``lengths_i`` times, which equals whitening the
    per-token advantages over all valid tokens (what the reference recipes do, with
    ``n = Σ lengths`` in the Bessel correction); without, each response counts once.

    Args:
      rewards: ``[B]`` rewards, groups contiguous.
      group_size: responses per prompt.
      lengths: optional ``[B]`` response lengths in tokens (>= 0).
      eps: added to the variance.

    Returns:
      ``float32 [B]`` advantages.

    Examples:
      >>> import jax.numpy as jnp
      >>> adv = reinforce_pp_baseline_advantages(jnp.array([1.0, 0.0, 1.0, 1.0]), 2)
      >>> [round(a, 3) for a in adv.tolist()]
      [1.225, -1.225, 0.0, 0.0]
    """
    g = _groups(rewards, group_size)
    a = (g - jnp.mean(g, axis=-1, keepdims=True)).reshape(-1)
    if lengths is None:
        return _whiten(a, jnp.ones_like(a), eps)
    lengths = jnp.asarray(lengths)
    if lengths.shape != a.shape:
        raise ValueError(
            f"lengths must have shape {a.shape} (that of rewards), got {lengths.shape}"
        )
    return _whiten(a, lengths.astype(a.dtype), eps)


def informative_groups(rewards: Float[Array, " B"], group_size: int) -> Bool[Array, " G"]:
    """Dynamic-sampling filter: True for the groups whose rewards are not all equal.

    A group with identical rewards has zero advantage under every group baseline, so it
    contributes no policy gradient; DAPO drops such groups and samples more. Equality is exact.

    Args:
      rewards: ``[B]`` rewards, groups contiguous.
      group_size: responses per prompt.

    Returns:
      ``bool [G]``, ``G = B / group_size``.

    Examples:
      >>> import jax.numpy as jnp
      >>> informative_groups(jnp.array([1.0, 1.0, 0.0, 1.0]), 2).tolist()
      [False, True]
    """
    g = _groups(rewards, group_size)
    return jnp.max(g, axis=-1) != jnp.min(g, axis=-1)


def overlong_penalty(
    lengths: ArrayLike, *, max_response_length: int, buffer: int, factor: float = 1.0
) -> Float[Array, " B"]:
    """DAPO soft overlong punishment, in tokens, added to the reward.

    With ``L`` the response length and ``L_exp = max_response_length − buffer``:
    ``0`` if ``L <= L_exp``; ``(L_exp − L) / buffer · factor`` if ``L_exp < L <= max``
    (linear from 0 down to ``−factor``); ``−factor`` if ``L > max``.

    Args:
      lengths: ``[B]`` response lengths in tokens.
      max_response_length: the generation limit (> 0).
      buffer: length of the punishment interval, ``0 < buffer <= max_response_length``
        (the paper recipe: 4096).
      factor: the penalty at the limit (the paper recipe: 1.0).

    Returns:
      ``float32 [B]`` penalties (<= 0 for ``factor >= 0``).

    Examples:
      >>> import jax.numpy as jnp
      >>> overlong_penalty(jnp.array([6, 14, 16, 20]), max_response_length=16, buffer=8).tolist()
      [0.0, -0.75, -1.0, -1.0]
    """
    lengths = jnp.asarray(lengths)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must have shape [B], got {lengths.shape}")
    if not isinstance(max_response_length, numbers.Real) or max_response_length <= 0:
        raise ValueError(f"max_response_length must be a number > 0, got {max_response_length!r}")
    if not isinstance(buffer, numbers.Real) or not 0 < buffer <= max_response_length:
        raise ValueError(
            f"buffer must be in (0, max_response_length={max_response_length}], got {buffer!r}"
        )
    length = lengths.astype(jnp.float32)
    expected = max_response_length - buffer
    inside = (expected - length) / buffer * factor
    return jnp.where(
        length <= expected, 0.0, jnp.where(length <= max_response_length, inside, -factor)
    ).astype(jnp.float32)
