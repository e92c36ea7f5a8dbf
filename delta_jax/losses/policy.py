"""Policy-gradient surrogates over token log-probabilities, with optional per-token weights.

Every function here is pure ``jax.numpy`` over arrays with a ``mask``: it takes log-probs, not a
model, so it composes with any JAX model and any parallelism (``jit``, sharded batches,
micro-batches). Conventions for all of them:

* ``B`` responses (rows) of ``T`` positions; ``mask[b, t] != 0`` marks a real response token.
  Padding may hold anything, NaN and inf included: it never reaches a value or a gradient.
* Gradients flow into ``logprobs`` (and ``entropy``) only; old, rollout and reference log-probs,
  advantages and coefficients are constants (``stop_gradient``).
* Arithmetic is done in ``float32``, or ``float64`` when ``logprobs`` is ``float64`` (x64 mode).
* Log-ratios are clamped to ``[-20, 20]`` before ``exp`` (no gradient beyond): a token that
  far off-policy is outside every clip range, and the clamp keeps ``float32`` finite.

The surrogates (``A`` is the effective advantage ``Â · λ̄``, i.e. advantage times coefficient):

* ``"ppo"``: token-level clipped objective as in DAPO / GRPO (DELTA_SPEC §4),
  ``ℓ = −min(r A, clip(r, 1−ε_low, 1+ε_high) A)`` with ``r = exp(logπ − logπ_old)``, and for
  ``A < 0`` the dual clip ``ℓ ← min(ℓ, −c A)`` (Ye et al., 2020). Defaults ε = 0.2 / 0.28.
* ``"gspo"``: GSPO (Zheng et al., 2025), sequence-level ratio
  ``s_i = exp(mean_t (logπ − logπ_old))`` over the valid tokens (``mask``, not ``token_mask``)
  of response ``i``, used in the token-level form ``s_{i,t} = sg[s_i] · π_t / sg[π_t]``
  (value ``s_i``, gradient ``s_i ∇logπ_t``) inside the same clipped objective, so per-token
  weights still apply. Defaults ε = 3e-4 / 4e-4 (the GSPO paper); the paper aggregates with
  ``"seq-mean-token-mean"``.
* ``"sapo"``: SAPO (Gao et al., 2025), the hard clip replaced by a soft gate
  ``ℓ = −A · f(r)``, ``f(r) = σ(τ (r − 1)) · 4/τ``, with ``τ = τ+`` where ``A > 0`` and ``τ−``
  otherwise. ``∂f/∂r = 4 σ (1 − σ)`` equals 1 on-policy (``r = 1``), so near ``r = 1`` the
  gradient is the plain policy gradient and it decays smoothly off-policy. The paper aggregates
  with ``"seq-mean-token-mean"``; ``clip_eps_*`` and ``dual_clip_c`` do not apply.

References:
  Ye et al., "Mastering Complex Control in MOBA Games with Deep RL" (dual clip), 2020.
  Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", 2025.
  Zheng et al., "Group Sequence Policy Optimization", 2025.
  Gao et al., "Soft Adaptive Policy Optimization", 2025 (arXiv 2511.20347).
  Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr.GRPO), 2025.
  Wang et al., "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective RL", 2025.
  Schulman, "Approximating KL Divergence", 2020 (k1, k2, k3).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

LOSS_TYPES = ("ppo", "gspo", "sapo")
AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
KL_ESTIMATORS = ("k1", "k2", "k3")
# (ε_low, ε_high) used when clip_eps_low / clip_eps_high are None.
DEFAULT_CLIP_EPS = {"ppo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}
_MAX_LOG_RATIO = 20.0
# forking_tokens_mask quantises top_q to this many parts so that k = ceil(q n) is exact in int32.
_Q_PARTS = 10_000


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_number(name: str, value, *, low: float, low_inclusive: bool = False) -> None:
    """Range-checks a Python number; traced values (under ``jit``) are the caller's business."""
    if isinstance(value, numbers.Real) and not (value >= low if low_inclusive else value > low):
        raise ValueError(f"{name} must be {'>=' if low_inclusive else '>'} {low}, got {value}")


def _float_array(name: str, x: ArrayLike, shape: tuple[int, ...] | None) -> Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must have a floating dtype, got {x.dtype} (shape {x.shape})")
    if shape is not None and x.shape != shape:
        raise ValueError(f"{name} must have shape {shape} (that of logprobs), got {x.shape}")
    return x


def _valid_mask(name: str, mask: ArrayLike, shape: tuple[int, ...]) -> Bool[Array, "B T"]:
    mask = jnp.asarray(mask)
    if not (
        jnp.issubdtype(mask.dtype, jnp.bool_)
        or jnp.issubdtype(mask.dtype, jnp.integer)
        or jnp.issubdtype(mask.dtype, jnp.floating)
    ):
        raise ValueError(f"{name} must be boolean, integer or floating, got {mask.dtype}")
    if mask.shape != shape:
        raise ValueError(f"{name} must have shape {shape} (that of logprobs), got {mask.shape}")
    return mask != 0


def _masked_mean(x: Array, valid: Array) -> Array:
    n = jnp.sum(valid)
    return jnp.sum(jnp.where(valid, x, 0)) / jnp.maximum(n, 1).astype(x.dtype)


def _masked_extreme(x: Array, valid: Array, fn) -> Array:
    """min / max over valid entries; 0 when there are none (metrics must stay finite)."""
    fill = jnp.inf if fn is jnp.min else -jnp.inf
    return jnp.where(jnp.any(valid), fn(jnp.where(valid, x, fill)), 0).astype(x.dtype)


def _segment_keys(segment_ids: ArrayLike, shape: tuple[int, ...]) -> tuple[Array, int]:
    """One integer per (row, segment) of a packed ``[B, T]`` layout, and how many there can be."""
    seg = jnp.asarray(segment_ids)
    if seg.shape != shape or not jnp.issubdtype(seg.dtype, jnp.integer):
        raise ValueError(
            f"segment_ids must be integer with shape {shape}, got {seg.dtype}{seg.shape}"
        )
    B, T = shape
    return (jnp.arange(B)[:, None] * (T + 1) + seg).reshape(-1), B * (T + 1)


def _per_response_sum(x: Array, segment_ids: ArrayLike | None) -> Array:
    """``Σ_t x`` of each token's response, broadcast to its tokens: the row, or its segment."""
    if segment_ids is None:
        return jnp.broadcast_to(jnp.sum(x, axis=-1, keepdims=True), x.shape)
    keys, n = _segment_keys(segment_ids, x.shape)
    return jax.ops.segment_sum(x.reshape(-1), keys, num_segments=n)[keys].reshape(x.shape)


def loss_normalizer(
    mask: ArrayLike, aggregation: str = "token-mean", segment_ids: ArrayLike | None = None
) -> Float[Array, ""]:
    """Default denominator of :func:`policy_loss` for one batch.

    ``Σ_{b,t} mask`` for ``"token-mean"``; for the ``seq-mean-*`` modes, the number of responses
    with at least one valid token. Both are counts, so the normaliser of a full batch is the sum
    of its micro-batches' normalisers: compute it once on the full batch (or sum it over
    micro-batches) and pass it as ``normalizer=`` to every micro-batch call, and the micro-batch
    losses (and gradients) add up to the full-batch ones.

    Args:
      mask: ``[B, T]`` valid-token mask (non-zero = valid).
      aggregation: one of :data:`AGGREGATIONS`.
      segment_ids: optional ``[B, T]`` integers in ``[0, T]``: packed rows, where each
        ``(row, segment id)`` is one response (see :func:`policy_loss`).

    Returns:
      A ``float32`` scalar.

    Examples:
      >>> import jax.numpy as jnp
      >>> float(loss_normalizer(jnp.array([[1, 1, 0], [0, 0, 0]]), "seq-mean-token-mean"))
      1.0
    """
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    mask = jnp.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"mask must have shape [B, T], got {mask.shape}")
    valid = _valid_mask("mask", mask, mask.shape)
    if aggregation == "token-mean":
        return jnp.sum(valid).astype(jnp.float32)
    if segment_ids is None:
        return jnp.sum(jnp.any(valid, axis=-1)).astype(jnp.float32)
    keys, n = _segment_keys(segment_ids, mask.shape)
    has_tokens = jax.ops.segment_max(valid.reshape(-1).astype(jnp.int32), keys, num_segments=n)
    return jnp.sum(jnp.maximum(has_tokens, 0)).astype(jnp.float32)


def _aggregate(
    per_token: Float[Array, "B T"],
    valid: Bool[Array, "B T"],
    aggregation: str,
    normalizer,
    max_response_length,
    segment_ids=None,
) -> Float[Array, ""]:
    """Sums ``per_token`` (zero off ``valid``) as ``aggregation`` says, over the normaliser."""
    if aggregation == "token-mean":
        total = jnp.sum(per_token)
    elif segment_ids is not None:  # packed rows: each token carries its response's share
        if aggregation == "seq-mean-token-mean":
            lengths = _per_response_sum(valid.astype(per_token.dtype), segment_ids)
            per_token = per_token / jnp.maximum(lengths, 1)
        elif aggregation == "seq-mean-token-sum-norm":
            per_token = per_token / jnp.asarray(max_response_length, per_token.dtype)
        total = jnp.sum(per_token)
    else:
        per_seq = jnp.sum(per_token, axis=-1)
        if aggregation == "seq-mean-token-mean":
            per_seq = per_seq / jnp.maximum(jnp.sum(valid, axis=-1), 1).astype(per_seq.dtype)
        elif aggregation == "seq-mean-token-sum-norm":
            constant = valid.shape[-1] if max_response_length is None else max_response_length
            per_seq = per_seq / jnp.asarray(constant, per_seq.dtype)
        total = jnp.sum(per_seq)
    if normalizer is None:
        normalizer = loss_normalizer(valid, aggregation, segment_ids)
    normalizer = jnp.asarray(normalizer, total.dtype)
    # Empty batch: the numerator is 0 too, and 0 is the documented loss.
    return total / jnp.where(normalizer > 0, normalizer, 1)


def policy_loss(
    logprobs: Float[Array, "B T"],
    old_logprobs: Float[Array, "B T"],
    advantages: Float[Array, " B"] | Float[Array, "B T"],
    mask: ArrayLike,
    *,
    coefficients: Float[Array, "B T"] | None = None,
    loss_type: str = "ppo",
    clip_eps_low: float | None = None,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = 10.0,
    aggregation: str = "token-mean",
    normalizer: float | Float[Array, ""] | None = None,
    max_response_length: int | None = None,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    token_mask: ArrayLike | None = None,
    rollout_logprobs: Float[Array, "B T"] | None = None,
    tis_cap: float | None = None,
    ref_logprobs: Float[Array, "B T"] | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: Float[Array, "B T"] | None = None,
    entropy_coef: float = 0.0,
    segment_ids: ArrayLike | None = None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """Clipped (PPO/DAPO), GSPO or SAPO policy-gradient loss with optional per-token weights.

    Per valid token, with ``A = Â · λ̄`` (advantage times ``coefficients``, the DelTA weights):

    ``ℓ_{b,t} = m'_{b,t} · (w_{b,t} · ℓ^surr_{b,t} + β · KL_{b,t} − η · H_{b,t})``

    where ``ℓ^surr`` is the surrogate of ``loss_type`` (module docstring), ``w`` the truncated
    importance-sampling weight ``min(exp(logπ_old − logπ_rollout), tis_cap)`` (1 when
    ``rollout_logprobs`` is None), ``KL`` the ``kl_estimator`` of KL(π‖π_ref) with
    ``d = logπ_ref − logπ``: k1 ``= −d``, k2 ``= d²/2``, k3 ``= e^d − d − 1``;
    ``H`` the given ``entropy``; ``m'`` the optional ``token_mask`` (1 when None). The loss is

    * ``"token-mean"``:               ``Σ_{b,t} ℓ / N``, default ``N = Σ mask``;
    * ``"seq-mean-token-mean"``:      ``Σ_b (Σ_t ℓ / |y_b|) / N``;
    * ``"seq-mean-token-sum"``:       ``Σ_b Σ_t ℓ / N``;
    * ``"seq-mean-token-sum-norm"``:  ``Σ_b Σ_t ℓ / (C · N)`` (Dr.GRPO), ``C`` =
      ``max_response_length`` (default ``T``: pass it explicitly when micro-batches are padded
      to different lengths);

    with ``|y_b|`` the valid tokens of response ``b`` and, for the ``seq-mean-*`` modes, default
    ``N`` = number of responses with at least one valid token. ``N = normalizer`` when given:
    pass the full batch's :func:`loss_normalizer` to each micro-batch and the micro-batch losses
    sum exactly to the full-batch loss. ``token_mask`` zeroes the loss of the other tokens (e.g.
    keep only :func:`forking_tokens_mask` tokens) but does not change ``N``, as in Wang et al.
    With the defaults this is DELTA_SPEC §4:
    ``L = −(1/|valid|) Σ min(r Â λ̄, clip(r, 0.8, 1.28) Â λ̄)`` with the ``c = 10`` dual clip.

    Args:
      logprobs: ``[B, T]`` log-probs of the sampled tokens under the current policy.
      old_logprobs: ``[B, T]`` log-probs under the policy that the ratio is taken against.
      advantages: ``[B]`` (per response) or ``[B, T]`` (per token) advantages ``Â``.
      mask: ``[B, T]`` valid-token mask (non-zero = valid).
      coefficients: optional ``[B, T]`` per-token weights ``λ̄`` (e.g. ``delta_coefficients``).
      loss_type: ``"ppo"``, ``"gspo"`` or ``"sapo"``.
      clip_eps_low: ``ε_low`` of the clip range ``[1−ε_low, 1+ε_high]``; None takes
        :data:`DEFAULT_CLIP_EPS` of ``loss_type`` (0.2 for ppo, 3e-4 for gspo).
      clip_eps_high: ``ε_high``, likewise (0.28 for ppo, 4e-4 for gspo).
      dual_clip_c: dual-clip constant ``c > 1`` for ``A < 0`` (ppo and gspo); None disables it.
      aggregation: one of :data:`AGGREGATIONS` (above).
      normalizer: the denominator ``N`` above; None uses this batch's :func:`loss_normalizer`.
        A value ``<= 0`` is replaced by 1 (the loss of an empty batch is 0).
      max_response_length: Dr.GRPO constant ``C`` for ``"seq-mean-token-sum-norm"``.
      sapo_tau_pos: SAPO gate temperature ``τ+`` (> 0).
      sapo_tau_neg: SAPO gate temperature ``τ−`` (> 0).
      token_mask: optional ``[B, T]`` mask of the tokens that get a loss (and a gradient).
      rollout_logprobs: optional ``[B, T]`` sampler log-probs, for the truncated importance
        sampling weight ``w`` correcting sampler/trainer mismatch.
      tis_cap: upper bound of ``w`` (e.g. 2.0); None leaves ``w`` uncapped.
      ref_logprobs: optional ``[B, T]`` reference-policy log-probs for the KL penalty.
      kl_coef: ``β``, weight of the KL penalty (needs ``ref_logprobs`` when non-zero).
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
      entropy: optional ``[B, T]`` per-token entropy of the current policy (differentiable).
      entropy_coef: ``η``, weight of the entropy bonus (needs ``entropy`` when non-zero).
      segment_ids: optional ``[B, T]`` integers in ``[0, T]`` for packed rows, which hold several
        responses: response = ``(row, segment id)`` instead of row, for the ``seq-mean-*``
        aggregations, their default ``N`` and GSPO's sequence ratio (``advantages`` are then
        per token, ``[B, T]``). Token-mean results do not depend on it. ``seq-mean-token-sum-norm``
        then needs ``max_response_length``.

    Returns:
      ``(loss, metrics)``: the scalar loss and a dict of scalars, each over the valid tokens
      of this call (0 when there are none): ``pg_loss`` (the aggregated ``w · ℓ^surr`` term),
      ``approx_kl`` (mean of ``r − 1 − log r``, the k3 estimate of KL(π_old‖π) from the
      token ratio), ``ratio_mean`` / ``ratio_min`` / ``ratio_max`` (the surrogate's ratio:
      ``s_i`` for gspo); for ppo and gspo ``clip_frac_upper`` (``A > 0`` and
      ``r > 1+ε_high``) and ``clip_frac_lower`` (``A < 0`` and ``r < 1−ε_low``), the fractions
      of tokens whose gradient the clip removes, and ``dual_clip_frac`` (``A < 0``, ``r > c``)
      when the dual clip is on; ``coef_mean`` / ``coef_min`` / ``coef_max`` / ``coef_std``
      with ``coefficients``; ``tis_weight_mean`` with ``rollout_logprobs``; ``kl`` (mean
      estimator value) with ``ref_logprobs``; ``entropy`` (mean) with ``entropy``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> lp = jnp.array([[-1.0, -0.5, 0.0], [-2.0, -1.0, -0.3]])
      >>> mask = jnp.array([[1, 1, 0], [1, 1, 1]])
      >>> adv = jnp.array([1.0, -1.0])
      >>> loss, metrics = policy_loss(lp, lp, adv, mask)
      >>> round(float(loss), 4)  # on-policy: r = 1 everywhere, loss = −mean(A)
      0.2
      >>> grads = jax.grad(lambda x: policy_loss(x, lp, adv, mask)[0])(lp)
    """
    _check_choice("loss_type", loss_type, LOSS_TYPES)
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    _check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    lp = _float_array("logprobs", logprobs, None)
    if lp.ndim != 2:
        raise ValueError(f"logprobs must have shape [B, T], got {lp.shape}")
    shape = lp.shape
    dtype = jnp.promote_types(lp.dtype, jnp.float32)
    sg = jax.lax.stop_gradient

    def constant(name, x):
        return None if x is None else sg(_float_array(name, x, shape).astype(dtype))

    lp = lp.astype(dtype)
    old = constant("old_logprobs", old_logprobs)
    valid = _valid_mask("mask", mask, shape)
    adv = _float_array("advantages", advantages, None)
    if adv.shape not in (shape[:1], shape):
        raise ValueError(
            f"advantages must have shape {shape[:1]} or {shape} (from logprobs {shape}), "
            f"got {adv.shape}"
        )
    adv = sg(jnp.broadcast_to(adv.reshape(shape[0], -1), shape).astype(dtype))
    coef = constant("coefficients", coefficients)
    rollout = constant("rollout_logprobs", rollout_logprobs)
    ref = constant("ref_logprobs", ref_logprobs)
    if entropy is not None:
        entropy = _float_array("entropy", entropy, shape).astype(dtype)
    keep = valid if token_mask is None else valid & _valid_mask("token_mask", token_mask, shape)

    default_low, default_high = DEFAULT_CLIP_EPS.get(loss_type, (None, None))  # None: sapo
    clip_eps_low = default_low if clip_eps_low is None else clip_eps_low
    clip_eps_high = default_high if clip_eps_high is None else clip_eps_high
    _check_number("clip_eps_low", clip_eps_low, low=0.0, low_inclusive=True)
    _check_number("clip_eps_high", clip_eps_high, low=0.0, low_inclusive=True)
    if dual_clip_c is not None:
        _check_number("dual_clip_c", dual_clip_c, low=1.0)
    _check_number("sapo_tau_pos", sapo_tau_pos, low=0.0)
    _check_number("sapo_tau_neg", sapo_tau_neg, low=0.0)
    if max_response_length is not None:
        _check_number("max_response_length", max_response_length, low=0.0)
    elif segment_ids is not None and aggregation == "seq-mean-token-sum-norm":
        raise ValueError("aggregation='seq-mean-token-sum-norm' with segment_ids needs "
                         "max_response_length")  # fmt: skip
    if tis_cap is not None:
        if rollout is None:
            raise ValueError("tis_cap was given without rollout_logprobs")
        _check_number("tis_cap", tis_cap, low=0.0)
    if ref is None and isinstance(kl_coef, numbers.Real) and kl_coef != 0:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs, got None")
    if entropy is None and isinstance(entropy_coef, numbers.Real) and entropy_coef != 0:
        raise ValueError(f"entropy_coef={entropy_coef} needs entropy, got None")

    adv = jnp.where(valid, adv if coef is None else adv * coef, 0)
    token_log_ratio = jnp.clip(jnp.where(valid, lp - old, 0), -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if loss_type == "gspo":
        lengths = jnp.maximum(_per_response_sum(valid.astype(dtype), segment_ids), 1)
        seq_log_ratio = _per_response_sum(jnp.where(valid, lp - old, 0), segment_ids) / lengths
        lp_valid = jnp.where(valid, lp, 0)
        # Value s_i, gradient s_i ∇logπ_t: the GSPO-token form.
        log_ratio = jnp.clip(
            sg(seq_log_ratio) + lp_valid - sg(lp_valid), -_MAX_LOG_RATIO, _MAX_LOG_RATIO
        )
    else:
        log_ratio = token_log_ratio
    ratio = jnp.exp(log_ratio)

    metrics = {}
    if loss_type == "sapo":
        tau = jnp.where(adv > 0, sapo_tau_pos, sapo_tau_neg).astype(dtype)
        surrogate = -adv * jax.nn.sigmoid(tau * (ratio - 1)) * (4 / tau)
    else:
        low, high = 1 - clip_eps_low, 1 + clip_eps_high
        surrogate = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, low, high))
        metrics["clip_frac_upper"] = _masked_mean(((adv > 0) & (ratio > high)).astype(dtype), valid)
        metrics["clip_frac_lower"] = _masked_mean(((adv < 0) & (ratio < low)).astype(dtype), valid)
        if dual_clip_c is not None:
            surrogate = jnp.where(adv < 0, jnp.minimum(surrogate, -adv * dual_clip_c), surrogate)
            metrics["dual_clip_frac"] = _masked_mean(
                ((adv < 0) & (ratio > dual_clip_c)).astype(dtype), valid
            )
    if rollout is not None:
        tis_log = jnp.clip(jnp.where(valid, old - rollout, 0), -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        weight = jnp.exp(tis_log)
        if tis_cap is not None:
            weight = jnp.minimum(weight, tis_cap)
        surrogate = surrogate * weight
        metrics["tis_weight_mean"] = _masked_mean(weight, valid)

    def agg(per_token):
        per_token = jnp.where(keep, per_token, 0)
        return _aggregate(
            per_token, valid, aggregation, normalizer, max_response_length, segment_ids
        )

    pg_loss = agg(surrogate)
    loss = pg_loss
    if ref is not None:
        d = jnp.where(valid, ref - lp, 0)
        kl = {"k1": lambda: -d, "k2": lambda: 0.5 * d * d, "k3": lambda: jnp.expm1(d) - d}
        kl = kl[kl_estimator]()
        loss = loss + kl_coef * agg(kl)
        metrics["kl"] = _masked_mean(kl, valid)
    if entropy is not None:
        loss = loss - entropy_coef * agg(entropy)
        metrics["entropy"] = _masked_mean(entropy, valid)

    metrics["pg_loss"] = pg_loss
    metrics["approx_kl"] = _masked_mean(jnp.expm1(token_log_ratio) - token_log_ratio, valid)
    metrics["ratio_mean"] = _masked_mean(ratio, valid)
    metrics["ratio_min"] = _masked_extreme(ratio, valid, jnp.min)
    metrics["ratio_max"] = _masked_extreme(ratio, valid, jnp.max)
    if coef is not None:
        mean = _masked_mean(coef, valid)
        metrics["coef_mean"] = mean
        metrics["coef_min"] = _masked_extreme(coef, valid, jnp.min)
        metrics["coef_max"] = _masked_extreme(coef, valid, jnp.max)
        metrics["coef_std"] = jnp.sqrt(_masked_mean(jnp.square(coef - mean), valid))
    return loss, {k: sg(v) for k, v in metrics.items()}


def forking_tokens_mask(
    entropy: Float[Array, "B T"], mask: ArrayLike, top_q: float = 0.2
) -> Bool[Array, "B T"]:
    """Marks the ``top_q`` fraction of valid tokens with the highest entropy ("forking tokens").

    Keeps exactly ``k = ceil(q · n)`` tokens, ``n = Σ mask``, over the whole batch, with ``q`` =
    ``top_q`` rounded to a multiple of 1e-4 (so ``k`` is computed exactly in integers).
    Ties in entropy are broken by position: among equal entropies, the token that comes first
    in row-major ``(b, t)`` order is kept first. Entropy must be finite on valid tokens.
    Use it as ``policy_loss(..., token_mask=forking_tokens_mask(entropy, mask))`` to train on
    high-entropy tokens only (Wang et al., 2025: top 20%).

    Args:
      entropy: ``[B, T]`` per-token entropy (no gradient flows through the result).
      mask: ``[B, T]`` valid-token mask (non-zero = valid).
      top_q: fraction of valid tokens to keep, a Python number in ``[0, 1]``.

    Returns:
      ``bool[B, T]``, True on the kept tokens (always False on padding).

    Examples:
      >>> import jax.numpy as jnp
      >>> ent = jnp.array([[0.1, 2.0, 0.5, 9.0], [3.0, 0.2, 0.0, 0.0]])
      >>> mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])
      >>> forking_tokens_mask(ent, mask, top_q=0.4).astype(int).tolist()
      [[0, 1, 0, 0], [1, 0, 0, 0]]
    """
    ent = _float_array("entropy", entropy, None)
    if ent.ndim != 2:
        raise ValueError(f"entropy must have shape [B, T], got {ent.shape}")
    valid = _valid_mask("mask", mask, ent.shape).reshape(-1)
    if not isinstance(top_q, numbers.Real) or not 0 <= top_q <= 1:
        raise ValueError(f"top_q must be a Python number in [0, 1], got {top_q!r}")
    parts = round(top_q * _Q_PARTS)
    n = jnp.sum(valid, dtype=jnp.int32)
    # ceil(n · parts / _Q_PARTS) without forming n · parts (int32 overflow for large n).
    k = (n // _Q_PARTS) * parts + ((n % _Q_PARTS) * parts + _Q_PARTS - 1) // _Q_PARTS
    # 0 − x maps −0.0 to +0.0, so the sort sees one zero; padding sorts last.
    key = jnp.where(valid, 0.0 - jax.lax.stop_gradient(ent).reshape(-1), jnp.inf)
    order = jnp.argsort(key, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return ((rank < k) & valid).reshape(ent.shape)
