"""Objectives: the loss functions each named ``algo.loss`` uses, chosen once from the config.

An :class:`Objective` holds the functions of :mod:`delta_jax.losses` its loss is made of (the
surrogate with its hyperparameters bound, the aggregation and its count, the KL estimator), the
coefficients of the extra terms and whether DelTA's coefficients or the forking-token mask are
computed. :func:`resolve_objective` builds it from the config, the one place where a loss is
looked up by name; the train step calls it. Values given explicitly in the config
(``algo.clip_eps_low`` ...) override the preset's.

| loss | surrogate | aggregation | extras |
|---|---|---|---|
| ``delta`` | token-level clip 0.2/0.28, dual clip | token-mean | DelTA coefficients λ̄ |
| ``dapo`` | token-level clip 0.2/0.28, dual clip | token-mean | |
| ``grpo`` | token-level clip 0.2/0.2, dual clip | seq-mean-token-mean | |
| ``dr_grpo`` | token-level clip 0.2/0.2, dual clip | seq-mean-token-sum-norm | |
| ``gspo`` | sequence-level ratio, clip 3e-4/4e-4 | seq-mean-token-mean | |
| ``sapo`` | soft gate τ+ 1.0 / τ− 1.05 | token-mean | |
| ``dapo_forking_tokens`` | as dapo | token-mean | gradient on the top-20% entropy tokens |
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from jaxtyping import Array, ArrayLike, Float

from delta_jax.config import AlgoConfigSection
from delta_jax.losses import policy_gradient_loss
from delta_jax.losses.aggregation import NAMED_AGGREGATIONS, Aggregate, Count
from delta_jax.losses.kl import KL_ESTIMATOR_FNS, KLEstimator
from delta_jax.losses.surrogates import (
    Surrogate,
    clipped_surrogate,
    gspo_surrogate,
    sapo_surrogate,
)


@dataclasses.dataclass(frozen=True)
class Objective:
    """The functions and coefficients of one policy-gradient loss, and the extras it needs.

    Calling it on a (micro-)batch gives ``(loss, metrics)``, :func:`policy_gradient_loss` with
    these functions; the inputs this objective does not use are ignored.

    Attributes:
      name: the ``algo.loss`` it was built from.
      surrogate: per-token surrogate, hyperparameters bound (:mod:`delta_jax.losses.surrogates`).
      aggregate: the aggregation (:mod:`delta_jax.losses.aggregation`).
      count: the aggregation's default normaliser ``N``, ``count(mask, segment_ids)``: the
        step computes it once over the mini-batch.
      kl: KL(π‖π_ref) estimator of the KL term; kl_coef: its weight (0: no term, no reference).
      entropy_coef: weight of the entropy bonus (0: none).
      tis_cap: truncated importance weight against the sampler's log-probs, capped at this
        value (None: no weight).
      uses_delta: the advantages are weighted by DelTA's coefficients λ̄.
      delta_kwargs: options of :func:`~delta_jax.losses.delta_coefficients`.
      uses_forking_mask: the loss is on the top-``forking_top_q`` entropy tokens only.
      forking_top_q: that fraction.
    """

    name: str
    surrogate: Surrogate
    aggregate: Aggregate
    count: Count
    kl: KLEstimator
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    uses_delta: bool = False
    delta_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    uses_forking_mask: bool = False
    forking_top_q: float = 0.2

    @property
    def needs_entropy(self) -> bool:
        """Whether the step computes the policy's entropy (bonus or forking-token mask)."""
        return self.uses_forking_mask or self.entropy_coef != 0

    def __call__(
        self,
        logprobs: Float[Array, "B T"],
        old_logprobs: Float[Array, "B T"],
        advantages: Float[Array, "B T"],
        mask: ArrayLike,
        *,
        normalizer: Float[Array, ""],
        segment_ids: ArrayLike | None = None,
        coefficients: Float[Array, "B T"] | None = None,
        token_mask: ArrayLike | None = None,
        rollout_logprobs: Float[Array, "B T"] | None = None,
        ref_logprobs: Float[Array, "B T"] | None = None,
        entropy: Float[Array, "B T"] | None = None,
    ) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
        """The loss and metrics of one micro-batch.

        Args:
          logprobs: ``[B, T]`` current-policy log-probs of the sampled tokens.
          old_logprobs: ``[B, T]`` log-probs the ratio is taken against.
          advantages: ``[B, T]`` each token's response advantage.
          mask: ``[B, T]`` tokens of the loss (the actions).
          normalizer: the whole mini-batch's ``N``, :attr:`count` of its mask.
          segment_ids: ``[B, T]`` response of each token in packed rows (None: one per row).
          coefficients: ``[B, T]`` DelTA's ``λ̄`` (with :attr:`uses_delta`).
          token_mask: ``[B, T]`` forking tokens (with :attr:`uses_forking_mask`).
          rollout_logprobs: ``[B, T]`` the sampler's log-probs (read with :attr:`tis_cap`).
          ref_logprobs: ``[B, T]`` reference log-probs (needed when :attr:`kl_coef` > 0).
          entropy: ``[B, T]`` policy entropy (read when :attr:`entropy_coef` != 0).

        Returns:
          ``(loss, metrics)`` as :func:`~delta_jax.losses.policy_loss`.
        """
        return policy_gradient_loss(
            logprobs, old_logprobs, advantages, mask,
            surrogate=self.surrogate, aggregate=self.aggregate, coefficients=coefficients,
            normalizer=normalizer, segment_ids=segment_ids, token_mask=token_mask,
            rollout_logprobs=None if self.tis_cap is None else rollout_logprobs,
            tis_cap=self.tis_cap, ref_logprobs=ref_logprobs, kl=self.kl, kl_coef=self.kl_coef,
            entropy=entropy if self.entropy_coef else None, entropy_coef=self.entropy_coef,
        )  # fmt: skip


# loss -> (surrogate with the preset's hyperparameters, aggregation)
_PRESETS: dict[str, tuple[functools.partial, str]] = {
    "delta": (functools.partial(clipped_surrogate, clip_eps_low=0.2, clip_eps_high=0.28),
              "token-mean"),
    "dapo": (functools.partial(clipped_surrogate, clip_eps_low=0.2, clip_eps_high=0.28),
             "token-mean"),
    "dapo_forking_tokens": (
        functools.partial(clipped_surrogate, clip_eps_low=0.2, clip_eps_high=0.28), "token-mean"
    ),
    "grpo": (functools.partial(clipped_surrogate, clip_eps_low=0.2, clip_eps_high=0.2),
             "seq-mean-token-mean"),
    "dr_grpo": (functools.partial(clipped_surrogate, clip_eps_low=0.2, clip_eps_high=0.2),
                "seq-mean-token-sum-norm"),
    "gspo": (functools.partial(gspo_surrogate, clip_eps_low=3e-4, clip_eps_high=4e-4),
             "seq-mean-token-mean"),
    "sapo": (functools.partial(sapo_surrogate, tau_pos=1.0, tau_neg=1.05), "token-mean"),
}  # fmt: skip


def _surrogate(algo: AlgoConfigSection, preset: functools.partial) -> Surrogate:
    """The preset's surrogate with the config's clip settings, where it has a clip."""
    if preset.func is sapo_surrogate:  # a soft gate: no clip range
        return preset
    overrides: dict[str, Any] = {
        key: value
        for key in ("clip_eps_low", "clip_eps_high")
        if (value := getattr(algo, key)) is not None
    }
    overrides["dual_clip_c"] = algo.dual_clip_c
    return functools.partial(preset, **overrides)


def resolve_objective(algo: AlgoConfigSection, *, max_response_length: int) -> Objective:
    """Build the :class:`Objective` named by ``algo.loss`` with the config's overrides applied.

    Args:
      algo: the config's ``algo`` section.
      max_response_length: the Dr.GRPO constant ``C`` of ``seq-mean-token-sum-norm``
        (the rollout's ``max_new_tokens``).
    """
    preset, aggregation = _PRESETS[algo.loss]
    aggregation = algo.aggregation or aggregation
    aggregate, count = NAMED_AGGREGATIONS[aggregation]
    if aggregation == "seq-mean-token-sum-norm":
        aggregate = functools.partial(aggregate, max_response_length=max_response_length)
    delta_kwargs = dict(
        refine_steps=algo.refine_steps,
        lam_min=algo.lam_min,
        lam_max=algo.lam_max,
        assignment=algo.delta_assignment,
        adaptive_gamma=algo.delta_adaptive_gamma,
        range_map=algo.delta_range_map,
        normalize=algo.delta_normalize,
    )
    return Objective(
        name=algo.loss,
        surrogate=_surrogate(algo, preset),
        aggregate=aggregate,
        count=count,
        kl=KL_ESTIMATOR_FNS[algo.kl_estimator],
        kl_coef=algo.kl_coef,
        entropy_coef=algo.entropy_coef,
        tis_cap=algo.tis_cap,
        uses_delta=algo.loss == "delta",
        delta_kwargs=delta_kwargs,
        uses_forking_mask=algo.loss == "dapo_forking_tokens",
        forking_top_q=algo.forking_top_q,
    )
