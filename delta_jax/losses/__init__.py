"""DelTA and policy-gradient losses in pure ``jax.numpy``.

This sub-package imports only jax and numpy (and jaxtyping), so other JAX projects can use the
loss without the rest of delta_jax::

  from delta_jax.losses import PRESETS, DeltaOptions, delta_coefficients, policy_loss

  coef = delta_coefficients(hidden, old_logprobs, advantages, mask)  # [B, T], mean 1
  loss, metrics = policy_loss(logprobs, old_logprobs, advantages, mask, coefficients=coef)
  # options are passed whole: DelTA's, and a named loss's from the presets
  coef = delta_coefficients(hidden, old_logprobs, advantages, mask, DeltaOptions(refine_steps=2))
  loss, metrics = policy_loss(logprobs, old_logprobs, advantages, mask, PRESETS["grpo"])

The pieces of ``policy_loss`` are small functions of their own, one signature per kind:
surrogates (:mod:`~delta_jax.losses.surrogates`: ``clipped_surrogate``, ``gspo_surrogate``,
``sapo_surrogate``), aggregations (:mod:`~delta_jax.losses.aggregation`: ``token_mean``,
``seq_mean_token_mean``, ...) and KL estimators (:mod:`~delta_jax.losses.kl`);
``policy_gradient_loss`` composes them when they are passed as functions (:class:`LossParts`)::

  import functools
  from delta_jax.losses import LossParts, clipped_surrogate, policy_gradient_loss
  from delta_jax.losses import seq_mean_token_mean

  grpo = functools.partial(clipped_surrogate, clip_eps_low=0.2, clip_eps_high=0.2)
  parts = LossParts(surrogate=grpo, aggregate=seq_mean_token_mean)
  loss, metrics = policy_gradient_loss(logprobs, old_logprobs, advantages, mask, parts)
"""

from delta_jax.losses import advantages, aggregation, kl, options, surrogates
from delta_jax.losses.advantages import (
    batch_normalize,
    dr_grpo_advantages,
    grpo_advantages,
    informative_groups,
    overlong_penalty,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from delta_jax.losses.aggregation import (
    response_count,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_count,
    token_mean,
)
from delta_jax.losses.delta import delta_coefficients, delta_coefficients_microbatched
from delta_jax.losses.kl import kl_k1, kl_k2, kl_k3
from delta_jax.losses.options import (
    PRESETS,
    DeltaOptions,
    LossParts,
    PolicyLossOptions,
    TermInputs,
    TopkInputs,
)
from delta_jax.losses.policy import (
    forking_tokens_mask,
    loss_normalizer,
    policy_gradient_loss,
    policy_loss,
)
from delta_jax.losses.surrogates import (
    clipped_surrogate,
    gspo_surrogate,
    sapo_surrogate,
    sequence_log_ratio,
    token_log_ratio,
    truncated_importance_weight,
)

__all__ = [
    "PRESETS",
    "DeltaOptions",
    "LossParts",
    "PolicyLossOptions",
    "TermInputs",
    "TopkInputs",
    "advantages",
    "aggregation",
    "batch_normalize",
    "clipped_surrogate",
    "delta_coefficients",
    "delta_coefficients_microbatched",
    "dr_grpo_advantages",
    "forking_tokens_mask",
    "grpo_advantages",
    "gspo_surrogate",
    "informative_groups",
    "kl",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "loss_normalizer",
    "options",
    "overlong_penalty",
    "policy_gradient_loss",
    "policy_loss",
    "reinforce_pp_baseline_advantages",
    "response_count",
    "rloo_advantages",
    "sapo_surrogate",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "sequence_log_ratio",
    "surrogates",
    "token_count",
    "token_log_ratio",
    "token_mean",
    "truncated_importance_weight",
]
