"""Policy-gradient losses over token log-probabilities, with optional per-token weights.

The pieces are small pure functions (:mod:`~delta_jax.losses.surrogates`,
:mod:`~delta_jax.losses.aggregation`, :mod:`~delta_jax.losses.kl`);
:func:`policy_gradient_loss` composes them into one loss with its metrics, taking the surrogate,
the aggregation and the KL estimator as functions; :func:`policy_loss` is the same loss with
them named by strings. Every function takes log-probs, not a model, so it composes with any JAX
model and any parallelism (``jit``, sharded batches, micro-batches). Conventions:

* ``B`` responses (rows) of ``T`` positions; ``mask[b, t] != 0`` marks a real response token.
  Padding may hold anything, NaN and inf included: it never reaches a value or a gradient.
* Gradients flow into ``logprobs`` (and ``entropy``) only; old, rollout and reference log-probs,
  advantages and coefficients are constants (``stop_gradient``).
* Arithmetic is done in ``float32``, or ``float64`` when ``logprobs`` is ``float64`` (x64 mode).
* Log-ratios are clamped to ``[-20, 20]`` before ``exp`` (no gradient beyond): a token that
  far off-policy is outside every clip range, and the clamp keeps ``float32`` finite.

The surrogates by name (``A`` is the effective advantage ``Â · λ̄``, advantage times
coefficient):

* ``"ppo"``: :func:`~delta_jax.losses.surrogates.clipped_surrogate`, token-level clipped
  objective as in DAPO / GRPO (DELTA_SPEC §4), ``ℓ = −min(r A, clip(r, 1−ε_low, 1+ε_high) A)``
  with ``r = exp(logπ − logπ_old)``, and for ``A < 0`` the dual clip ``ℓ ← min(ℓ, −c A)``
  (Ye et al., 2020). Defaults ε = 0.2 / 0.28.
* ``"gspo"``: :func:`~delta_jax.losses.surrogates.gspo_surrogate`, GSPO (Zheng et al., 2025),
  sequence-level ratio ``s_i = exp(mean_t (logπ − logπ_old))`` over the valid tokens (``mask``,
  not ``token_mask``) of response ``i``, used in the token-level form
  ``s_{i,t} = sg[s_i] · π_t / sg[π_t]`` (value ``s_i``, gradient ``s_i ∇logπ_t``) inside the same
  clipped objective, so per-token weights still apply. Defaults ε = 3e-4 / 4e-4 (the GSPO
  paper); the paper aggregates with ``"seq-mean-token-mean"``.
* ``"sapo"``: :func:`~delta_jax.losses.surrogates.sapo_surrogate`, SAPO (Gao et al., 2025), the
  hard clip replaced by a soft gate ``ℓ = −A · f(r)``, ``f(r) = σ(τ (r − 1)) · 4/τ``, with
  ``τ = τ+`` where ``A > 0`` and ``τ−`` otherwise. ``∂f/∂r = 4 σ (1 − σ)`` equals 1 on-policy
  (``r = 1``), so near ``r = 1`` the gradient is the plain policy gradient and it decays
  smoothly off-policy. The paper aggregates with ``"seq-mean-token-mean"``; ``clip_eps_*`` and
  ``dual_clip_c`` do not apply.

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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from delta_jax.losses.aggregation import NAMED_AGGREGATIONS, masked_max, masked_mean, masked_min
from delta_jax.losses.options import (
    AGGREGATIONS,
    DEFAULT_CLIP_EPS,
    KL_ESTIMATORS,
    LOSS_TYPES,
    LossParts,
    PolicyLossOptions,
    TermInputs,
    apply_legacy_keywords,
    check_choice,
    check_number,
)
from delta_jax.losses.surrogates import token_log_ratio, truncated_importance_weight

__all__ = [
    "AGGREGATIONS",
    "DEFAULT_CLIP_EPS",
    "KL_ESTIMATORS",
    "LOSS_TYPES",
    "forking_tokens_mask",
    "loss_normalizer",
    "policy_gradient_loss",
    "policy_loss",
]
# forking_tokens_mask quantises top_q to this many parts so that k = ceil(q n) is exact in int32.
_Q_PARTS = 10_000


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


def loss_normalizer(
    mask: ArrayLike, aggregation: str = "token-mean", segment_ids: ArrayLike | None = None
) -> Float[Array, ""]:
    """Default denominator of :func:`policy_loss` for one batch.

    ``Σ_{b,t} mask`` for ``"token-mean"``; for the ``seq-mean-*`` modes, the number of responses
    with at least one valid token. Both are counts, so the normaliser of a full batch is the sum
    of its micro-batches' normalisers: compute it once on the full batch (or sum it over
    micro-batches) and pass it as ``normalizer=`` to every micro-batch call, and the micro-batch
    losses (and gradients) add up to the full-batch ones. The same counts by function:
    :func:`~delta_jax.losses.aggregation.token_count`,
    :func:`~delta_jax.losses.aggregation.response_count`.

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
    check_choice("aggregation", aggregation, AGGREGATIONS)
    mask = jnp.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"mask must have shape [B, T], got {mask.shape}")
    _, count = NAMED_AGGREGATIONS[aggregation]
    return count(_valid_mask("mask", mask, mask.shape), segment_ids)


class _Inputs(NamedTuple):
    """The checked arrays of one loss call, in the compute dtype; constants stop-gradient."""

    logprobs: Array
    old: Array
    advantages: Array  # [B, T]
    valid: Array  # bool: mask
    keep: Array  # bool: mask and token_mask
    coefficients: Array | None
    rollout: Array | None
    ref: Array | None
    entropy: Array | None


def _checked_inputs(
    logprobs, old_logprobs, advantages, mask, coefficients, token_mask, terms: TermInputs
) -> _Inputs:
    """Shapes and dtypes checked (names in the errors), cast to float32 / float64."""
    lp = _float_array("logprobs", logprobs, None)
    if lp.ndim != 2:
        raise ValueError(f"logprobs must have shape [B, T], got {lp.shape}")
    shape = lp.shape
    dtype = jnp.promote_types(lp.dtype, jnp.float32)
    sg = jax.lax.stop_gradient

    def constant(name, x):
        return None if x is None else sg(_float_array(name, x, shape).astype(dtype))

    valid = _valid_mask("mask", mask, shape)
    adv = _float_array("advantages", advantages, None)
    if adv.shape not in (shape[:1], shape):
        raise ValueError(
            f"advantages must have shape {shape[:1]} or {shape} (from logprobs {shape}), "
            f"got {adv.shape}"
        )
    entropy = terms.entropy
    if entropy is not None:
        entropy = _float_array("entropy", entropy, shape).astype(dtype)
    keep = valid if token_mask is None else valid & _valid_mask("token_mask", token_mask, shape)
    return _Inputs(
        logprobs=lp.astype(dtype),
        old=constant("old_logprobs", old_logprobs),
        advantages=sg(jnp.broadcast_to(adv.reshape(shape[0], -1), shape).astype(dtype)),
        valid=valid,
        keep=keep,
        coefficients=constant("coefficients", coefficients),
        rollout=constant("rollout_logprobs", terms.rollout_logprobs),
        ref=constant("ref_logprobs", terms.ref_logprobs),
        entropy=entropy,
    )


def _coefficient_metrics(coef: Float[Array, "B T"], valid) -> dict[str, Float[Array, ""]]:
    mean = masked_mean(coef, valid)
    return {
        "coef_mean": mean,
        "coef_min": masked_min(coef, valid),
        "coef_max": masked_max(coef, valid),
        "coef_std": jnp.sqrt(masked_mean(jnp.square(coef - mean), valid)),
    }


def policy_gradient_loss(
    logprobs: Float[Array, "B T"],
    old_logprobs: Float[Array, "B T"],
    advantages: Float[Array, " B"] | Float[Array, "B T"],
    mask: ArrayLike,
    parts: LossParts = LossParts(),
    *,
    coefficients: Float[Array, "B T"] | None = None,
    normalizer: float | Float[Array, ""] | None = None,
    segment_ids: ArrayLike | None = None,
    token_mask: ArrayLike | None = None,
    terms: TermInputs | None = None,
    **legacy: Any,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """A policy-gradient loss composed of a surrogate, an aggregation and optional terms.

    ``L = agg(m' · w · ℓ^surr) + β · agg(m' · KL) − η · agg(m' · H)``

    with ``ℓ^surr = surrogate(logπ, logπ_old, Â · λ̄, mask)`` (advantages times
    ``coefficients``), ``w`` the :func:`~delta_jax.losses.surrogates.truncated_importance_weight`
    (1 when ``terms.rollout_logprobs`` is None), ``KL = kl(logπ, logπ_ref, mask)``, ``H`` the
    given ``terms.entropy``, ``m'`` the optional ``token_mask`` (1 when None) and ``agg`` =
    ``aggregate`` with ``normalizer`` and ``segment_ids``; ``surrogate``, ``aggregate``, ``kl``,
    ``β``, ``η`` and the cap of ``w`` are the fields of ``parts``. :func:`policy_loss` is this
    function with the parts named by strings; its docstring details every term.

    Args:
      logprobs: ``[B, T]`` log-probs of the sampled tokens under the current policy.
      old_logprobs: ``[B, T]`` log-probs under the policy that the ratio is taken against.
      advantages: ``[B]`` (per response) or ``[B, T]`` (per token) advantages ``Â``.
      mask: ``[B, T]`` valid-token mask (non-zero = valid).
      parts: the :class:`~delta_jax.losses.LossParts`: surrogate, aggregation, KL estimator and
        the weights of the optional terms (``PolicyLossOptions(...).parts()`` names them).
      coefficients: optional ``[B, T]`` per-token weights ``λ̄`` (e.g. ``delta_coefficients``).
      normalizer: ``N`` of the aggregation; None: the aggregation's count of this batch.
      segment_ids: optional ``[B, T]`` packed-row segments (see :func:`policy_loss`).
      token_mask: optional ``[B, T]`` mask of the tokens that get a loss (and a gradient).
      terms: optional :class:`~delta_jax.losses.TermInputs`: ``[B, T]`` sampler log-probs for
        the weight ``w``, reference log-probs for the KL term, the policy's entropy
        (differentiable) for the entropy bonus.
      **legacy: the fields of ``parts`` and ``terms`` as loose keywords (``surrogate=...``,
        ``entropy=...``), the earlier form: deprecated, they warn and are applied on top.

    Returns:
      ``(loss, metrics)`` as :func:`policy_loss`.

    Examples:
      >>> import functools, jax.numpy as jnp
      >>> from delta_jax.losses import LossParts, aggregation, surrogates
      >>> lp = jnp.array([[-1.0, -0.5, 0.0], [-2.0, -1.0, -0.3]])
      >>> mask = jnp.array([[1, 1, 0], [1, 1, 1]])
      >>> grpo = functools.partial(surrogates.clipped_surrogate, clip_eps_high=0.2)
      >>> parts = LossParts(surrogate=grpo, aggregate=aggregation.seq_mean_token_mean)
      >>> loss, metrics = policy_gradient_loss(lp, lp, jnp.array([1.0, -1.0]), mask, parts)
      >>> float(loss)  # on-policy: −mean over responses of the response's mean A
      0.0
    """
    parts, terms = apply_legacy_keywords(
        "policy_gradient_loss", legacy, parts, terms, TermInputs, "terms"
    )
    x = _checked_inputs(
        logprobs, old_logprobs, advantages, mask, coefficients, token_mask, terms or TermInputs()
    )
    tis_cap, kl_coef, entropy_coef = parts.tis_cap, parts.kl_coef, parts.entropy_coef
    if tis_cap is not None:
        if x.rollout is None:
            raise ValueError("tis_cap was given without rollout_logprobs")
        check_number("tis_cap", tis_cap, low=0.0)
    if x.ref is None and isinstance(kl_coef, numbers.Real) and kl_coef != 0:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs, got None")
    if x.entropy is None and isinstance(entropy_coef, numbers.Real) and entropy_coef != 0:
        raise ValueError(f"entropy_coef={entropy_coef} needs entropy, got None")

    valid = x.valid
    adv = x.advantages if x.coefficients is None else x.advantages * x.coefficients
    adv = jnp.where(valid, adv, 0)
    per_token, metrics = parts.surrogate(x.logprobs, x.old, adv, valid, segment_ids=segment_ids)
    if x.rollout is not None:
        weight = truncated_importance_weight(x.old, x.rollout, valid, tis_cap)
        per_token = per_token * weight
        metrics["tis_weight_mean"] = masked_mean(weight, valid)
        metrics["tis_weight_max"] = masked_max(weight, valid)
        if tis_cap is not None:  # tokens whose weight the cap cut (off-policy ones, mostly)
            raw = truncated_importance_weight(x.old, x.rollout, valid, None)
            metrics["tis_truncated_fraction"] = masked_mean(
                (raw > tis_cap).astype(weight.dtype), valid
            )

    def agg(per_token_terms):
        per_token_terms = jnp.where(x.keep, per_token_terms, 0)
        return parts.aggregate(
            per_token_terms, valid, normalizer=normalizer, segment_ids=segment_ids
        )

    pg_loss = loss = agg(per_token)
    if x.ref is not None:
        kl_tokens = parts.kl(x.logprobs, x.ref, valid)
        loss = loss + kl_coef * agg(kl_tokens)
        metrics["kl"] = masked_mean(kl_tokens, valid)
    if x.entropy is not None:
        loss = loss - entropy_coef * agg(x.entropy)
        metrics["entropy"] = masked_mean(x.entropy, valid)
    metrics["pg_loss"] = pg_loss
    # k3 estimate of KL(π_old‖π) from the token ratio, whatever ratio the surrogate used.
    log_ratio = token_log_ratio(x.logprobs, x.old, valid)
    metrics["approx_kl"] = masked_mean(jnp.expm1(log_ratio) - log_ratio, valid)
    if x.coefficients is not None:
        metrics.update(_coefficient_metrics(x.coefficients, valid))
    return loss, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}


def policy_loss(
    logprobs: Float[Array, "B T"],
    old_logprobs: Float[Array, "B T"],
    advantages: Float[Array, " B"] | Float[Array, "B T"],
    mask: ArrayLike,
    options: PolicyLossOptions = PolicyLossOptions(),
    *,
    coefficients: Float[Array, "B T"] | None = None,
    normalizer: float | Float[Array, ""] | None = None,
    segment_ids: ArrayLike | None = None,
    token_mask: ArrayLike | None = None,
    terms: TermInputs | None = None,
    **legacy: Any,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """Clipped (PPO/DAPO), GSPO or SAPO policy-gradient loss with optional per-token weights.

    A convenience over :func:`policy_gradient_loss` with the surrogate, aggregation and KL
    estimator named by strings in ``options`` (:class:`~delta_jax.losses.PolicyLossOptions`,
    whose fields are named below; :data:`~delta_jax.losses.PRESETS` holds GRPO, DAPO, ...).
    Per valid token, with ``A = Â · λ̄`` (advantage times
    ``coefficients``, the DelTA weights):

    ``ℓ_{b,t} = m'_{b,t} · (w_{b,t} · ℓ^surr_{b,t} + β · KL_{b,t} − η · H_{b,t})``

    where ``ℓ^surr`` is the surrogate of ``loss_type`` (module docstring), ``w`` the truncated
    importance-sampling weight ``min(exp(logπ_old − logπ_rollout), tis_cap)`` (1 when
    ``terms.rollout_logprobs`` is None), ``KL`` the ``kl_estimator`` of KL(π‖π_ref) with
    ``d = logπ_ref − logπ``: k1 ``= −d``, k2 ``= d²/2``, k3 ``= e^d − d − 1``;
    ``H`` the given ``terms.entropy``; ``m'`` the optional ``token_mask`` (1 when None). The
    loss is

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
      options: the :class:`~delta_jax.losses.PolicyLossOptions`: ``loss_type``
        (``"ppo"``, ``"gspo"``, ``"sapo"``), the clip range ``clip_eps_low`` /
        ``clip_eps_high`` (None: :data:`DEFAULT_CLIP_EPS` of the loss type), ``dual_clip_c``,
        ``sapo_tau_pos`` / ``sapo_tau_neg``, ``aggregation`` (above),
        ``max_response_length`` (``C``), ``tis_cap``, ``kl_coef`` (``β``), ``kl_estimator``
        and ``entropy_coef`` (``η``).
      coefficients: optional ``[B, T]`` per-token weights ``λ̄`` (e.g. ``delta_coefficients``).
      normalizer: the denominator ``N`` above; None uses this batch's :func:`loss_normalizer`.
        A value ``<= 0`` is replaced by 1 (the loss of an empty batch is 0).
      segment_ids: optional ``[B, T]`` integers in ``[0, T]`` for packed rows, which hold several
        responses: response = ``(row, segment id)`` instead of row, for the ``seq-mean-*``
        aggregations, their default ``N`` and GSPO's sequence ratio (``advantages`` are then
        per token, ``[B, T]``). Token-mean results do not depend on it. ``seq-mean-token-sum-norm``
        then needs ``max_response_length``.
      token_mask: optional ``[B, T]`` mask of the tokens that get a loss (and a gradient).
      terms: optional :class:`~delta_jax.losses.TermInputs` of ``[B, T]`` arrays:
        ``rollout_logprobs`` (sampler log-probs, for the truncated importance sampling weight
        ``w`` correcting sampler/trainer mismatch), ``ref_logprobs`` (reference-policy
        log-probs for the KL penalty), ``entropy`` (per-token entropy of the current policy,
        differentiable, for the entropy bonus).
      **legacy: the fields of ``options`` and ``terms`` as loose keywords (``kl_coef=0.1``,
        ``ref_logprobs=...``), the earlier form: deprecated, they warn and are applied on top.

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
      >>> from delta_jax.losses import PRESETS
      >>> round(float(policy_loss(lp, lp, adv, mask, PRESETS["grpo"])[0]), 4)  # per response
      0.0
    """
    options, terms = apply_legacy_keywords(
        "policy_loss", legacy, options, terms, TermInputs, "terms"
    )
    sum_norm = options.aggregation == "seq-mean-token-sum-norm"
    if sum_norm and segment_ids is not None and options.max_response_length is None:
        raise ValueError(
            "aggregation='seq-mean-token-sum-norm' with segment_ids needs max_response_length"
        )
    return policy_gradient_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        options.parts(),
        coefficients=coefficients,
        normalizer=normalizer,
        segment_ids=segment_ids,
        token_mask=token_mask,
        terms=terms,
    )


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
