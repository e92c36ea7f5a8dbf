"""DelTA and policy-gradient losses in pure ``jax.numpy``.

This sub-package imports only jax and numpy (and jaxtyping), so other JAX projects can use the
loss without the rest of delta_jax::

  from delta_jax.losses import delta_coefficients, policy_loss

  coef = delta_coefficients(hidden, old_logprobs, advantages, mask)  # [B, T], mean 1
  loss, metrics = policy_loss(logprobs, old_logprobs, advantages, mask, coefficients=coef)
"""

from delta_jax.losses import advantages
from delta_jax.losses.advantages import (
    batch_normalize,
    dr_grpo_advantages,
    grpo_advantages,
    informative_groups,
    overlong_penalty,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from delta_jax.losses.delta import delta_coefficients, delta_coefficients_microbatched
from delta_jax.losses.policy import forking_tokens_mask, loss_normalizer, policy_loss

__all__ = [
    "advantages",
    "batch_normalize",
    "delta_coefficients",
    "delta_coefficients_microbatched",
    "dr_grpo_advantages",
    "forking_tokens_mask",
    "grpo_advantages",
    "informative_groups",
    "loss_normalizer",
    "overlong_penalty",
    "policy_loss",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
]
