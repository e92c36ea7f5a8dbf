"""Options of the losses, passed whole: DelTA's, the policy loss's, and each named loss's preset.

Each loss function takes one frozen options object instead of a dozen loose flags, and the
settings of every named loss (GRPO, DAPO, DelTA, ...) are written once, in :data:`PRESETS`,
which the trainer reads too::

  from delta_jax.losses import PRESETS, DeltaOptions, delta_coefficients, policy_loss

  coef = delta_coefficients(hidden, old_logprobs, advantages, mask, DeltaOptions(refine_steps=2))
  loss, metrics = policy_loss(logprobs, old_logprobs, advantages, mask, PRESETS["grpo"])

The options are static pytrees (no leaves): they can be passed through ``jax.jit`` like any
argument, and a different value compiles a different program. Arrays never go in them; the
optional per-token arrays of a loss come in small named tuples (:class:`TermInputs`,
:class:`TopkInputs`).

The loose keyword flags of the earlier API (``delta_coefficients(..., refine_steps=2)``,
``policy_loss(..., kl_coef=0.1, ref_logprobs=ref)``) still work for one release: they are
applied on top of the options (:func:`apply_legacy_keywords`) with a ``DeprecationWarning``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import warnings
from collections.abc import Hashable, Mapping
from typing import Any, NamedTuple, TypeVar

import jax
from jaxtyping import Array, ArrayLike, Float

from delta_jax.losses.aggregation import NAMED_AGGREGATIONS, Aggregate, token_mean
from delta_jax.losses.kl import KL_ESTIMATOR_FNS, KLEstimator, kl_k3
from delta_jax.losses.surrogates import (
    Surrogate,
    clipped_surrogate,
    gspo_surrogate,
    sapo_surrogate,
)

LOSS_TYPES = ("ppo", "gspo", "sapo")
AGGREGATIONS = tuple(NAMED_AGGREGATIONS)
KL_ESTIMATORS = tuple(KL_ESTIMATOR_FNS)
# (ε_low, ε_high) of a loss type whose clip_eps_low / clip_eps_high are None. The ppo pair is the
# DAPO / DelTA setting of DELTA_SPEC §4; the gspo pair is the GSPO paper's.
DEFAULT_CLIP_EPS = {"ppo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}
DELTA_CHOICES = {
    "assignment": ("soft", "hard"),
    "normalize": ("sum", "count"),
    "scope": ("global", "per_shard"),
    "proxy": ("lm_head_row", "hidden_topk"),
}


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raises ``ValueError`` naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_number(name: str, value, *, low: float, low_inclusive: bool = False) -> None:
    """Range-checks a Python number; traced values (under ``jit``) are the caller's business."""
    if isinstance(value, numbers.Real) and not (value >= low if low_inclusive else value > low):
        raise ValueError(f"{name} must be {'>=' if low_inclusive else '>'} {low}, got {value}")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DeltaOptions:
    """The options of :func:`~delta_jax.losses.delta_coefficients` (DELTA_SPEC §3, §5, §6).

    The defaults are the reference recipe's. Values are checked when the object is built.

    Attributes:
      refine_steps: K, the number of centroid refinements (paper: 0-3).
      lam_min: λ for a score of 0 (and for zero-advantage tokens).
      lam_max: λ for a score of 1.
      assignment: ``"soft"`` (``α = σ(Δ/γ)``) or ``"hard"`` (``α = [Δ > 0]``; γ only reported).
      adaptive_gamma: if False, the initial temperatures are used by every step (identical to
        True for ``refine_steps <= 1`` because of the one-step lag).
      range_map: if False, ``λ = α*`` on P ∪ N and 0 on Z (the image of α = 0), no λ range.
      normalize: ``"sum"`` (``λ̄ = λ · |valid| / Σλ``, mean 1) or ``"count"`` (``λ̄ = λ``: a
        token-mean surrogate then divides by the token count rather than by Σλ).
      scope: ``"global"`` (statistics over the whole batch) or ``"per_shard"`` (each shard of
        ``axis_name`` alone, as the reference recipe). Under plain ``jit`` with a sharded batch
        and ``axis_name=None`` the statistics are global.
      axis_name: mesh axis name (or tuple) the batch is split over. Without a ``mesh`` the call
        must be inside ``shard_map``/``pmap`` over it: ``"global"`` all-reduces the sums with
        ``psum``, ``"per_shard"`` does not.
      proxy: ``"lm_head_row"`` (``v = (1 − p) h``) or ``"hidden_topk"`` (paper App. F:
        ``v = W_y − Σ_{j∈topk} p̃(j) W_j``, the gradient w.r.t. ``h`` restricted to the top-k
        vocabulary with ``p̃`` the softmax of the top-k logits; needs :class:`TopkInputs`).
      eps: the ε of the spec (mass floors, variance floor, normaliser floor).

    Examples:
      >>> DeltaOptions(refine_steps=2).lam_max
      1.2
      >>> DeltaOptions(lam_min=1.3)
      Traceback (most recent call last):
      ...
      ValueError: lam_min=1.3 must be <= lam_max=1.2
    """

    refine_steps: int = 1
    lam_min: float = 0.8
    lam_max: float = 1.2
    assignment: str = "soft"
    adaptive_gamma: bool = True
    range_map: bool = True
    normalize: str = "sum"
    scope: str = "global"
    axis_name: Hashable | tuple[Hashable, ...] | None = None
    proxy: str = "lm_head_row"
    eps: float = 1e-8

    def __post_init__(self):
        for name, choices in DELTA_CHOICES.items():
            check_choice(name, getattr(self, name), choices)
        for name in ("adaptive_gamma", "range_map"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        k = self.refine_steps
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"refine_steps must be a non-negative int, got {k!r}")
        for name in ("lam_min", "lam_max", "eps"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite Python number, got {value!r}")
        if self.lam_min > self.lam_max:
            raise ValueError(f"lam_min={self.lam_min} must be <= lam_max={self.lam_max}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps!r}")
        if self.scope == "per_shard" and self.axis_name is None:
            raise ValueError(
                "scope='per_shard' needs axis_name, the mesh axis the batch is split over"
            )
        # Python numbers of one type: equal options hash alike (one compiled program).
        object.__setattr__(self, "refine_steps", int(k))
        for name in ("lam_min", "lam_max", "eps"):
            object.__setattr__(self, name, float(getattr(self, name)))


class TopkInputs(NamedTuple):
    """The arrays of DelTA's ``proxy="hidden_topk"`` (paper App. F).

    For :func:`~delta_jax.losses.delta_coefficients_microbatched` the last three are sequences,
    one array per micro-batch.

    Attributes:
      lm_head: ``[H, V]`` LM-head weight, logits = ``h @ lm_head``.
      token_ids: ``[B, T]`` sampled token ids.
      topk_logits: ``[B, T, k]`` top-k logits at the sampling temperature.
      topk_ids: ``[B, T, k]`` their vocabulary ids.
    """

    lm_head: Float[ArrayLike, "H V"] | None = None
    token_ids: Any = None
    topk_logits: Any = None
    topk_ids: Any = None


class TermInputs(NamedTuple):
    """The per-token arrays of a policy loss's optional terms, each ``[B, T]`` or None.

    Attributes:
      rollout_logprobs: the sampler's log-probs, for the truncated importance-sampling weight.
      ref_logprobs: reference-policy log-probs, for the KL penalty.
      entropy: the current policy's entropy (differentiable), for the entropy bonus.
    """

    rollout_logprobs: Float[Array, "B T"] | None = None
    ref_logprobs: Float[Array, "B T"] | None = None
    entropy: Float[Array, "B T"] | None = None


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class LossParts:
    """The functions and weights :func:`~delta_jax.losses.policy_gradient_loss` composes.

    Attributes:
      surrogate: a :data:`~delta_jax.losses.surrogates.Surrogate`, e.g.
        ``functools.partial(clipped_surrogate, clip_eps_high=0.2)``.
      aggregate: an :data:`~delta_jax.losses.aggregation.Aggregate`, e.g. ``token_mean``.
      kl: a :data:`~delta_jax.losses.kl.KLEstimator` for the KL term, e.g. ``kl_k3``.
      kl_coef: ``β``, weight of the KL term (needs ``ref_logprobs`` when non-zero).
      entropy_coef: ``η``, weight of the entropy bonus (needs ``entropy`` when non-zero).
      tis_cap: upper bound of the truncated importance weight; None leaves it uncapped.
    """

    surrogate: Surrogate = clipped_surrogate
    aggregate: Aggregate = token_mean
    kl: KLEstimator = kl_k3
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    tis_cap: float | None = None


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class PolicyLossOptions:
    """The options of :func:`~delta_jax.losses.policy_loss`, the surrogate named by a string.

    The defaults are DELTA_SPEC §4 (DAPO's clip 0.2 / 0.28 with the dual clip, token-mean);
    :data:`PRESETS` holds the other named losses. Values are checked when the object is built.

    Attributes:
      loss_type: ``"ppo"`` (token-level clip), ``"gspo"`` or ``"sapo"``.
      clip_eps_low: ``ε_low`` of the clip range ``[1−ε_low, 1+ε_high]``; None takes
        :data:`DEFAULT_CLIP_EPS` of ``loss_type`` (0.2 for ppo, 3e-4 for gspo).
      clip_eps_high: ``ε_high``, likewise (0.28 for ppo, 4e-4 for gspo).
      dual_clip_c: dual-clip constant ``c > 1`` for ``A < 0`` (ppo and gspo); None disables it.
      sapo_tau_pos: SAPO gate temperature ``τ+`` (> 0).
      sapo_tau_neg: SAPO gate temperature ``τ−`` (> 0).
      aggregation: one of :data:`AGGREGATIONS` (see :func:`~delta_jax.losses.policy_loss`).
      max_response_length: Dr.GRPO constant ``C`` for ``"seq-mean-token-sum-norm"``.
      tis_cap: upper bound of the truncated importance weight (e.g. 2.0); None: uncapped.
      kl_coef: ``β``, weight of the KL penalty (needs ``ref_logprobs`` when non-zero).
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
      entropy_coef: ``η``, weight of the entropy bonus (needs ``entropy`` when non-zero).

    Examples:
      >>> PolicyLossOptions().clip_range()
      (0.2, 0.28)
      >>> PRESETS["grpo"].clip_range(), PRESETS["grpo"].aggregation
      ((0.2, 0.2), 'seq-mean-token-mean')
    """

    loss_type: str = "ppo"
    clip_eps_low: float | None = None
    clip_eps_high: float | None = None
    dual_clip_c: float | None = 10.0
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    aggregation: str = "token-mean"
    max_response_length: int | None = None
    tis_cap: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self):
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        low, high = self.clip_range()
        check_number("clip_eps_low", low, low=0.0, low_inclusive=True)
        check_number("clip_eps_high", high, low=0.0, low_inclusive=True)
        if self.dual_clip_c is not None:
            check_number("dual_clip_c", self.dual_clip_c, low=1.0)
        check_number("sapo_tau_pos", self.sapo_tau_pos, low=0.0)
        check_number("sapo_tau_neg", self.sapo_tau_neg, low=0.0)
        if self.max_response_length is not None:
            check_number("max_response_length", self.max_response_length, low=0.0)

    def clip_range(self) -> tuple[float | None, float | None]:
        """``(ε_low, ε_high)``, the defaults of ``loss_type`` filled in (None, None for sapo)."""
        low, high = DEFAULT_CLIP_EPS.get(self.loss_type, (None, None))
        return (
            low if self.clip_eps_low is None else self.clip_eps_low,
            high if self.clip_eps_high is None else self.clip_eps_high,
        )

    def surrogate(self) -> Surrogate:
        """The surrogate of ``loss_type`` with its hyperparameters bound."""
        if self.loss_type == "sapo":
            return functools.partial(
                sapo_surrogate, tau_pos=self.sapo_tau_pos, tau_neg=self.sapo_tau_neg
            )
        low, high = self.clip_range()
        clipped = clipped_surrogate if self.loss_type == "ppo" else gspo_surrogate
        return functools.partial(
            clipped, clip_eps_low=low, clip_eps_high=high, dual_clip_c=self.dual_clip_c
        )

    def aggregate(self) -> Aggregate:
        """The aggregation, Dr.GRPO's constant bound for ``"seq-mean-token-sum-norm"``."""
        aggregate, _ = NAMED_AGGREGATIONS[self.aggregation]
        if self.aggregation == "seq-mean-token-sum-norm":
            return functools.partial(aggregate, max_response_length=self.max_response_length)
        return aggregate

    def parts(self) -> LossParts:
        """These options as the functions and weights of :class:`LossParts`."""
        return LossParts(
            surrogate=self.surrogate(),
            aggregate=self.aggregate(),
            kl=KL_ESTIMATOR_FNS[self.kl_estimator],
            kl_coef=self.kl_coef,
            entropy_coef=self.entropy_coef,
            tis_cap=self.tis_cap,
        )


_DAPO = PolicyLossOptions()
_GRPO = PolicyLossOptions(clip_eps_high=0.2, aggregation="seq-mean-token-mean")
PRESETS: Mapping[str, PolicyLossOptions] = types.MappingProxyType(
    {
        "delta": _DAPO,  # with DelTA's coefficients λ̄ (DeltaOptions())
        "dapo": _DAPO,
        "dapo_forking_tokens": _DAPO,  # on the top-20% entropy tokens (forking_tokens_mask)
        "grpo": _GRPO,
        "dr_grpo": dataclasses.replace(_GRPO, aggregation="seq-mean-token-sum-norm"),
        "gspo": PolicyLossOptions(loss_type="gspo", aggregation="seq-mean-token-mean"),
        "sapo": PolicyLossOptions(loss_type="sapo"),
    }
)
"""The policy-loss options of each named loss (the trainer's ``algo.loss``).

| loss | surrogate | aggregation | with |
|---|---|---|---|
| ``delta`` | token-level clip 0.2/0.28, dual clip | token-mean | DelTA coefficients λ̄ |
| ``dapo`` | token-level clip 0.2/0.28, dual clip | token-mean | |
| ``dapo_forking_tokens`` | as dapo | token-mean | loss on the top-20% entropy tokens |
| ``grpo`` | token-level clip 0.2/0.2, dual clip | seq-mean-token-mean | |
| ``dr_grpo`` | token-level clip 0.2/0.2, dual clip | seq-mean-token-sum-norm | |
| ``gspo`` | sequence-level ratio, clip 3e-4/4e-4 | seq-mean-token-mean | |
| ``sapo`` | soft gate τ+ 1.0 / τ− 1.05 | token-mean | |

``dr_grpo`` needs ``max_response_length`` (``dataclasses.replace`` it in).
"""

_Options = TypeVar("_Options")


def apply_legacy_keywords(
    func: str,
    legacy: Mapping[str, Any],
    options: _Options,
    inputs: NamedTuple | None,
    inputs_type: type,
    inputs_name: str,
) -> tuple[_Options, Any]:
    """``options`` and ``inputs`` with the loose keywords of the earlier API of ``func`` applied.

    A keyword naming a field of ``options`` replaces it (``dataclasses.replace``, so it is
    checked), one naming a field of ``inputs_type`` is set in ``inputs`` (passed as the keyword
    ``inputs_name``); any keyword warns once with the new form of the call. Another keyword
    raises ``TypeError``, as Python does for an unknown keyword.
    """
    option_fields = {f.name for f in dataclasses.fields(options)}
    unknown = [k for k in legacy if k not in option_fields and k not in inputs_type._fields]
    if unknown:
        raise TypeError(f"{func}() got an unexpected keyword argument {unknown[0]!r}")
    if not legacy:
        return options, inputs
    in_options = {k: v for k, v in legacy.items() if k in option_fields}
    in_inputs = {k: v for k, v in legacy.items() if k not in option_fields}
    new = []
    if in_options:
        new.append(f"{type(options).__name__}({', '.join(f'{k}=...' for k in in_options)})")
    if in_inputs:
        new.append(
            f"{inputs_name}={inputs_type.__name__}({', '.join(f'{k}=...' for k in in_inputs)})"
        )
    warnings.warn(
        f"{func}(..., {', '.join(f'{k}=...' for k in legacy)}) is deprecated: call "
        f"{func}(..., {', '.join(new)}) instead",
        DeprecationWarning,
        stacklevel=3,
    )
    if in_options:
        options = dataclasses.replace(options, **in_options)
    if in_inputs:
        inputs = (inputs_type() if inputs is None else inputs)._replace(**in_inputs)
    return options, inputs
