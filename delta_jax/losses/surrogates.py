"""Per-token policy-gradient surrogates: the clipped objective (PPO / DAPO / GRPO), GSPO, SAPO.

Every surrogate has one signature, its hyperparameters bound by keyword (``functools.partial``)::

  surrogate(logprobs, old_logprobs, advantages, mask, *, segment_ids=None) -> (ℓ, metrics)

with ``logprobs`` / ``old_logprobs`` ``[B, T]`` the log-probs of the sampled tokens under the
current policy and the policy the ratio is taken against, ``advantages`` ``[B, T]`` the
effective per-token advantage ``A`` (e.g. ``Â · λ̄``, advantage times DelTA coefficient) and
``mask`` ``[B, T]`` the valid tokens (non-zero). It returns the per-token loss ``ℓ`` ``[B, T]``
(0 off ``mask``) and a dict of scalar metrics over the valid tokens: ``ratio_mean`` /
``ratio_min`` / ``ratio_max`` of the ratio it used and, for the clipped ones,
``clip_frac_upper`` (``A > 0`` and ``r > 1+ε_high``), ``clip_frac_lower`` (``A < 0`` and
``r < 1−ε_low``), the fractions of tokens whose gradient the clip removes, and
``dual_clip_frac`` (``A < 0``, ``r > c``) when the dual clip is on. ``segment_ids`` (packed rows,
see :mod:`~delta_jax.losses.aggregation`) matters to GSPO's sequence ratio only.

Gradients flow into ``logprobs`` only (``old_logprobs`` and ``advantages`` are constants).
Arithmetic runs in the dtype of ``logprobs``; padding may hold anything, NaN and inf included.
Log-ratios are clamped to ``[-20, 20]`` before ``exp`` (no gradient beyond): a token that far
off-policy is outside every clip range, and the clamp keeps ``float32`` finite.

References:
  Schulman et al., "Proximal Policy Optimization Algorithms", 2017.
  Ye et al., "Mastering Complex Control in MOBA Games with Deep RL" (dual clip), 2020.
  Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", 2025.
  Zheng et al., "Group Sequence Policy Optimization", 2025.
  Gao et al., "Soft Adaptive Policy Optimization", 2025 (arXiv 2511.20347).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from delta_jax.losses.aggregation import (
    masked_max,
    masked_mean,
    masked_min,
    per_response_sum,
    valid_tokens,
)

Surrogate = Callable[..., tuple[Float[Array, "B T"], dict[str, Float[Array, ""]]]]
"""``(logprobs, old_logprobs, advantages, mask, *, segment_ids=None) -> (ℓ [B, T], metrics)``."""
MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to ``[-MAX_LOG_RATIO, MAX_LOG_RATIO]`` before ``exp``."""

_sg = jax.lax.stop_gradient


def token_log_ratio(
    logprobs: Float[Array, "B T"], old_logprobs: Float[Array, "B T"], mask: ArrayLike
) -> Float[Array, "B T"]:
    """``log r = logπ − logπ_old`` per token, clamped to ``±20``; 0 off ``mask``."""
    valid = valid_tokens(mask)
    log_ratio = jnp.where(valid, logprobs - _sg(old_logprobs), 0)
    return jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO)


def sequence_log_ratio(
    logprobs: Float[Array, "B T"],
    old_logprobs: Float[Array, "B T"],
    mask: ArrayLike,
    segment_ids: ArrayLike | None = None,
) -> Float[Array, "B T"]:
    """GSPO's log-ratio in its token form: value ``log s_i``, gradient ``∇logπ_t``.

    ``log s_i = mean_t (logπ − logπ_old)`` over the valid tokens of response ``i`` (the row,
    or its segment), written as ``sg[log s_i] + logπ_t − sg[logπ_t]`` so that ``exp`` of it has
    value ``s_i`` and gradient ``s_i ∇logπ_t``; clamped to ``±20``; 0 off ``mask``.
    """
    valid = valid_tokens(mask)
    lengths = jnp.maximum(per_response_sum(valid.astype(logprobs.dtype), segment_ids), 1)
    token = jnp.where(valid, logprobs - _sg(old_logprobs), 0)
    sequence = per_response_sum(token, segment_ids) / lengths
    lp_valid = jnp.where(valid, logprobs, 0)
    return jnp.clip(_sg(sequence) + lp_valid - _sg(lp_valid), -MAX_LOG_RATIO, MAX_LOG_RATIO)


def ratio_metrics(ratio: Float[Array, "B T"], mask: ArrayLike) -> dict[str, Float[Array, ""]]:
    """``ratio_mean`` / ``ratio_min`` / ``ratio_max`` over the valid tokens (0 when none)."""
    return {
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_min": masked_min(ratio, mask),
        "ratio_max": masked_max(ratio, mask),
    }


def clip_objective(
    ratio: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: ArrayLike,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip_c: float | None,
) -> tuple[Float[Array, "B T"], dict[str, Float[Array, ""]]]:
    """``ℓ = −min(r A, clip(r, 1−ε_low, 1+ε_high) A)``, for ``A < 0`` also ``ℓ ← min(ℓ, −c A)``.

    The clipped objective at a given ratio ``r`` (token-level or GSPO's), with its clip
    metrics. ``advantages`` must be 0 off ``mask``.
    """
    dtype = ratio.dtype
    low, high = 1 - clip_eps_low, 1 + clip_eps_high
    adv = advantages
    loss = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, low, high))
    metrics = {
        "clip_frac_upper": masked_mean(((adv > 0) & (ratio > high)).astype(dtype), mask),
        "clip_frac_lower": masked_mean(((adv < 0) & (ratio < low)).astype(dtype), mask),
    }
    if dual_clip_c is not None:
        loss = jnp.where(adv < 0, jnp.minimum(loss, -adv * dual_clip_c), loss)
        metrics["dual_clip_frac"] = masked_mean(
            ((adv < 0) & (ratio > dual_clip_c)).astype(dtype), mask
        )
    return loss, metrics


def clipped_surrogate(
    logprobs: Float[Array, "B T"],
    old_logprobs: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: ArrayLike,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.28,
    dual_clip_c: float | None = 10.0,
    segment_ids: ArrayLike | None = None,
) -> tuple[Float[Array, "B T"], dict[str, Float[Array, ""]]]:
    """Token-level clipped surrogate, as in PPO, DAPO and GRPO (DELTA_SPEC §4).

    ``ℓ = −min(r A, clip(r, 1−ε_low, 1+ε_high) A)`` with ``r = exp(logπ − logπ_old)``, and for
    ``A < 0`` the dual clip ``ℓ ← min(ℓ, −c A)`` (each token's loss capped at ``c |A|``).
    DAPO's clip-higher range 0.2 / 0.28 is the default; GRPO uses 0.2 / 0.2.

    Args:
      logprobs: ``[B, T]`` current-policy log-probs of the sampled tokens (differentiated).
      old_logprobs: ``[B, T]`` log-probs under the policy the ratio is taken against.
      advantages: ``[B, T]`` effective per-token advantages ``A``.
      mask: ``[B, T]`` valid-token mask (non-zero = valid).
      clip_eps_low: ``ε_low`` of the clip range ``[1−ε_low, 1+ε_high]``.
      clip_eps_high: ``ε_high`` of the clip range.
      dual_clip_c: ``c > 1`` for ``A < 0``; None disables the dual clip.
      segment_ids: unused (one signature for every surrogate).

    Returns:
      ``(ℓ, metrics)``: ``[B, T]`` per-token loss (0 off ``mask``) and the ratio and clip
      metrics (module docstring).

    Examples:
      >>> import jax.numpy as jnp
      >>> lp = jnp.log(jnp.array([[1.5, 1.0]]))  # ratios 1.5 and 1 against old log-probs 0
      >>> loss, m = clipped_surrogate(lp, jnp.zeros((1, 2)), jnp.array([[1.0, -1.0]]),
      ...                             jnp.ones((1, 2)))
      >>> loss.tolist(), float(m["clip_frac_upper"])  # r = 1.5 clipped to 1.28
      ([[-1.2799999713897705, 1.0]], 0.5)
    """
    del segment_ids
    valid = valid_tokens(mask)
    log_ratio = token_log_ratio(logprobs, old_logprobs, valid)
    clip = dict(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, dual_clip_c=dual_clip_c)
    return _clipped_at(log_ratio, advantages, valid, **clip)


def gspo_surrogate(
    logprobs: Float[Array, "B T"],
    old_logprobs: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: ArrayLike,
    *,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float = 4e-4,
    dual_clip_c: float | None = 10.0,
    segment_ids: ArrayLike | None = None,
) -> tuple[Float[Array, "B T"], dict[str, Float[Array, ""]]]:
    """GSPO (Zheng et al., 2025): the clipped objective at the sequence-level ratio.

    ``s_i = exp(mean_t (logπ − logπ_old))`` over the valid tokens of response ``i``, used in the
    token form ``s_{i,t} = sg[s_i] · π_t / sg[π_t]`` (value ``s_i``, gradient ``s_i ∇logπ_t``,
    :func:`sequence_log_ratio`) inside :func:`clip_objective`, so per-token weights in ``A``
    still apply. Defaults ε = 3e-4 / 4e-4 (the GSPO paper); the paper aggregates with
    :func:`~delta_jax.losses.aggregation.seq_mean_token_mean`.

    Args:
      logprobs: ``[B, T]`` current-policy log-probs of the sampled tokens (differentiated).
      old_logprobs: ``[B, T]`` log-probs under the policy the ratio is taken against.
      advantages: ``[B, T]`` effective per-token advantages ``A``.
      mask: ``[B, T]`` valid-token mask (non-zero = valid).
      clip_eps_low: ``ε_low`` of the clip range ``[1−ε_low, 1+ε_high]``.
      clip_eps_high: ``ε_high`` of the clip range.
      dual_clip_c: ``c > 1`` for ``A < 0``; None disables the dual clip.
      segment_ids: optional ``[B, T]`` packed-row segments: a response is ``(row, segment)``.

    Returns:
      As :func:`clipped_surrogate`; the ratio metrics are of ``s_i``.
    """
    valid = valid_tokens(mask)
    log_ratio = sequence_log_ratio(logprobs, old_logprobs, valid, segment_ids)
    clip = dict(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, dual_clip_c=dual_clip_c)
    return _clipped_at(log_ratio, advantages, valid, **clip)


def _clipped_at(log_ratio, advantages, valid, **clip):
    """:func:`clip_objective` at ``exp(log_ratio)`` with stopped advantages, and the ratio's
    metrics: the tail both clipped surrogates share."""
    adv = jnp.where(valid, _sg(advantages), 0)
    ratio = jnp.exp(log_ratio)
    loss, metrics = clip_objective(ratio, adv, valid, **clip)
    return loss, metrics | ratio_metrics(ratio, valid)


def sapo_surrogate(
    logprobs: Float[Array, "B T"],
    old_logprobs: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: ArrayLike,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    segment_ids: ArrayLike | None = None,
) -> tuple[Float[Array, "B T"], dict[str, Float[Array, ""]]]:
    """SAPO (Gao et al., 2025): the hard clip replaced by a soft gate.

    ``ℓ = −A · f(r)``, ``f(r) = σ(τ (r − 1)) · 4/τ``, with ``τ = τ+`` where ``A > 0`` and ``τ−``
    otherwise. ``∂f/∂r = 4 σ (1 − σ)`` equals 1 on-policy (``r = 1``), so near ``r = 1`` the
    gradient is the plain policy gradient and it decays smoothly off-policy. The paper
    aggregates with :func:`~delta_jax.losses.aggregation.seq_mean_token_mean`.

    Args:
      logprobs: ``[B, T]`` current-policy log-probs of the sampled tokens (differentiated).
      old_logprobs: ``[B, T]`` log-probs under the policy the ratio is taken against.
      advantages: ``[B, T]`` effective per-token advantages ``A``.
      mask: ``[B, T]`` valid-token mask (non-zero = valid).
      tau_pos: gate temperature ``τ+`` where ``A > 0`` (> 0).
      tau_neg: gate temperature ``τ−`` elsewhere (> 0).
      segment_ids: unused (one signature for every surrogate).

    Returns:
      ``(ℓ, metrics)``: ``[B, T]`` per-token loss and the ratio metrics.

    Examples:
      >>> import jax.numpy as jnp
      >>> lp = jnp.zeros((1, 2))  # on-policy: f(1) = 2/τ
      >>> loss, _ = sapo_surrogate(lp, lp, jnp.array([[1.0, -1.0]]), jnp.ones((1, 2)))
      >>> [round(x, 4) for x in loss[0].tolist()]
      [-2.0, 1.9048]
    """
    del segment_ids
    valid = valid_tokens(mask)
    adv = jnp.where(valid, _sg(advantages), 0)
    ratio = jnp.exp(token_log_ratio(logprobs, old_logprobs, valid))
    tau = jnp.where(adv > 0, tau_pos, tau_neg).astype(ratio.dtype)
    loss = -adv * jax.nn.sigmoid(tau * (ratio - 1)) * (4 / tau)
    return loss, ratio_metrics(ratio, valid)


def truncated_importance_weight(
    old_logprobs: Float[Array, "B T"],
    rollout_logprobs: Float[Array, "B T"],
    mask: ArrayLike,
    cap: float | None = None,
) -> Float[Array, "B T"]:
    """Truncated importance-sampling weight ``w = min(exp(logπ_old − logπ_rollout), cap)``.

    Multiplies a surrogate to correct the mismatch between the sampler's log-probs and the
    trainer's. No gradient; the log-ratio is clamped to ``±20``; 1 off ``mask``.

    Args:
      old_logprobs: ``[B, T]`` trainer log-probs of the policy that sampled.
      rollout_logprobs: ``[B, T]`` the sampler's log-probs of the same tokens.
      mask: ``[B, T]`` valid-token mask (non-zero = valid).
      cap: upper bound of ``w`` (e.g. 2.0); None leaves it uncapped.

    Returns:
      ``[B, T]`` weights.
    """
    valid = valid_tokens(mask)
    log_w = jnp.where(valid, _sg(old_logprobs) - _sg(rollout_logprobs), 0)
    weight = jnp.exp(jnp.clip(log_w, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    return weight if cap is None else jnp.minimum(weight, cap)
