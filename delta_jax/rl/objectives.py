"""Objectives: the loss each named ``algo.loss`` uses, built once from the config.

An :class:`Objective` holds the options of :mod:`delta_jax.losses` its loss is made of: the
policy loss's (:class:`~delta_jax.losses.PolicyLossOptions`), DelTA's
(:class:`~delta_jax.losses.DeltaOptions`) when the advantages are weighted by its coefficients,
and the forking-token fraction when the loss is on those tokens only. :func:`resolve_objective`
builds it from the config, the one place where a loss is looked up by name: each name's
settings are :data:`delta_jax.losses.PRESETS` (the table of the loss library, not restated
here), and values given explicitly in the config (``algo.clip_eps_low`` ...) override them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxtyping import Array, ArrayLike, Float

from delta_jax.config import AlgoConfigSection
from delta_jax.losses import (
    PRESETS,
    DeltaOptions,
    LossParts,
    PolicyLossOptions,
    TermInputs,
    policy_gradient_loss,
)
from delta_jax.losses.aggregation import NAMED_AGGREGATIONS, Aggregate, Count


@dataclasses.dataclass(frozen=True)
class Objective:
    """The options of one policy-gradient loss, and the extras it needs.

    Calling it on a (micro-)batch gives ``(loss, metrics)``, the
    :func:`~delta_jax.losses.policy_loss` of :attr:`options`; the inputs this objective does
    not use are ignored.

    Attributes:
      name: the ``algo.loss`` it was built from.
      options: the policy loss's options: surrogate, aggregation, the weights of the KL term
        (0: no term, no reference) and the entropy bonus (0: none), and the cap of the
        truncated importance weight against the sampler's log-probs (None: no weight).
      delta: DelTA's options when the advantages are weighted by its coefficients λ̄, else None
        (the statistics' scope over the mesh is the plan's, ``algo.delta_scope``).
      forking_top_q: the fraction of top-entropy tokens the loss is on, or None (every token).
    """

    name: str
    options: PolicyLossOptions
    delta: DeltaOptions | None = None
    forking_top_q: float | None = None

    @property
    def uses_delta(self) -> bool:
        """Whether the advantages are weighted by DelTA's coefficients λ̄."""
        return self.delta is not None

    @property
    def uses_forking_mask(self) -> bool:
        """Whether the loss is on the top-``forking_top_q`` entropy tokens only."""
        return self.forking_top_q is not None

    @property
    def entropy_coef(self) -> float:
        """Weight of the entropy bonus (0: none)."""
        return self.options.entropy_coef

    @property
    def needs_entropy(self) -> bool:
        """Whether the step computes the policy's entropy (bonus or forking-token mask)."""
        return self.uses_forking_mask or self.entropy_coef != 0

    @property
    def parts(self) -> LossParts:
        """The loss's functions and weights (:func:`~delta_jax.losses.policy_gradient_loss`)."""
        return self.options.parts()

    @property
    def aggregate(self) -> Aggregate:
        """The aggregation (:mod:`delta_jax.losses.aggregation`)."""
        return self.options.aggregate()

    @property
    def count(self) -> Count:
        """The aggregation's default normaliser ``N``, ``count(mask, segment_ids)``: the step
        computes it once over the mini-batch."""
        return NAMED_AGGREGATIONS[self.options.aggregation][1]

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
        terms: TermInputs | None = None,
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
          terms: the sampler's log-probs (read with ``options.tis_cap``), the reference
            log-probs (needed when ``options.kl_coef`` > 0) and the policy's entropy (read
            when ``options.entropy_coef`` != 0).

        Returns:
          ``(loss, metrics)`` as :func:`~delta_jax.losses.policy_loss`.
        """
        terms = terms or TermInputs()
        terms = terms._replace(
            rollout_logprobs=None if self.options.tis_cap is None else terms.rollout_logprobs,
            entropy=terms.entropy if self.entropy_coef else None,
        )
        return policy_gradient_loss(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            self.parts,
            coefficients=coefficients,
            normalizer=normalizer,
            segment_ids=segment_ids,
            token_mask=token_mask,
            terms=terms,
        )


def delta_options(algo: AlgoConfigSection) -> DeltaOptions:
    """DelTA's options of the config (its ``algo.delta_*`` keys and the λ settings)."""
    return DeltaOptions(
        refine_steps=algo.refine_steps,
        lam_min=algo.lam_min,
        lam_max=algo.lam_max,
        assignment=algo.delta_assignment,
        adaptive_gamma=algo.delta_adaptive_gamma,
        range_map=algo.delta_range_map,
        normalize=algo.delta_normalize,
    )


def resolve_objective(algo: AlgoConfigSection, *, max_response_length: int) -> Objective:
    """Build the :class:`Objective` named by ``algo.loss`` with the config's overrides applied.

    Args:
      algo: the config's ``algo`` section.
      max_response_length: the Dr.GRPO constant ``C`` of ``seq-mean-token-sum-norm``
        (the rollout's ``max_new_tokens``).
    """
    preset = PRESETS[algo.loss]
    overrides: dict[str, Any] = dict(
        kl_coef=algo.kl_coef,
        kl_estimator=algo.kl_estimator,
        entropy_coef=algo.entropy_coef,
        tis_cap=algo.tis_cap,
    )
    if algo.aggregation is not None:
        overrides["aggregation"] = algo.aggregation
    if preset.loss_type != "sapo":  # a soft gate: no clip range (the config refuses one)
        overrides["dual_clip_c"] = algo.dual_clip_c
        for key in ("clip_eps_low", "clip_eps_high"):
            if (value := getattr(algo, key)) is not None:
                overrides[key] = value
    options = dataclasses.replace(preset, **overrides)
    if options.aggregation == "seq-mean-token-sum-norm":
        options = dataclasses.replace(options, max_response_length=max_response_length)
    return Objective(
        name=algo.loss,
        options=options,
        delta=delta_options(algo) if algo.loss == "delta" else None,
        forking_top_q=algo.forking_top_q if algo.loss == "dapo_forking_tokens" else None,
    )
