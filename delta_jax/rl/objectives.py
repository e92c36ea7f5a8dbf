"""Loss presets: how each named objective maps onto the losses library.

Each preset is a :class:`Objective`: the keyword arguments of
:func:`delta_jax.losses.policy_loss`, plus whether it uses DelTA coefficients or the
forking-tokens mask. Values given explicitly in the config (``algo.clip_eps_low`` ...) override
the preset's.

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
from typing import Any

from delta_jax.config import AlgoConfigSection


@dataclasses.dataclass(frozen=True)
class Objective:
    """A resolved objective: policy-loss keyword arguments and the extras it needs."""

    name: str
    loss_kwargs: dict[str, Any]
    uses_delta: bool = False
    uses_forking_mask: bool = False
    delta_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    forking_top_q: float = 0.2

    @property
    def needs_entropy(self) -> bool:
        return self.uses_forking_mask or "entropy_coef" in self.loss_kwargs


_PRESETS: dict[str, dict[str, Any]] = {
    "delta": dict(loss_type="ppo", clip_eps_low=0.2, clip_eps_high=0.28, aggregation="token-mean"),
    "dapo": dict(loss_type="ppo", clip_eps_low=0.2, clip_eps_high=0.28, aggregation="token-mean"),
    "dapo_forking_tokens": dict(
        loss_type="ppo", clip_eps_low=0.2, clip_eps_high=0.28, aggregation="token-mean"
    ),
    "grpo": dict(
        loss_type="ppo", clip_eps_low=0.2, clip_eps_high=0.2, aggregation="seq-mean-token-mean"
    ),
    "dr_grpo": dict(
        loss_type="ppo", clip_eps_low=0.2, clip_eps_high=0.2, aggregation="seq-mean-token-sum-norm"
    ),
    "gspo": dict(
        loss_type="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4, aggregation="seq-mean-token-mean"
    ),
    "sapo": dict(loss_type="sapo", aggregation="token-mean", sapo_tau_pos=1.0, sapo_tau_neg=1.05),
}


def resolve_objective(algo: AlgoConfigSection, *, max_response_length: int) -> Objective:
    """Build the :class:`Objective` named by ``algo.loss`` with the config's overrides applied."""
    kwargs = dict(_PRESETS[algo.loss])
    for key in ("clip_eps_low", "clip_eps_high", "aggregation"):
        value = getattr(algo, key)
        if value is not None:
            kwargs[key] = value
    if kwargs["loss_type"] == "ppo":
        kwargs["dual_clip_c"] = algo.dual_clip_c
    if kwargs["aggregation"] == "seq-mean-token-sum-norm":
        kwargs["max_response_length"] = max_response_length
    if algo.kl_coef > 0:
        kwargs.update(kl_coef=algo.kl_coef, kl_estimator=algo.kl_estimator)
    if algo.entropy_coef:
        kwargs["entropy_coef"] = algo.entropy_coef
    if algo.tis_cap is not None:
        kwargs["tis_cap"] = algo.tis_cap
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
        loss_kwargs=kwargs,
        uses_delta=algo.loss == "delta",
        uses_forking_mask=algo.loss == "dapo_forking_tokens",
        delta_kwargs=delta_kwargs,
        forking_top_q=algo.forking_top_q,
    )
