"""Per-token estimators of KL(π‖π_ref) from the log-probs of the sampled tokens.

Each estimator has one signature, ``kl(logprobs, ref_logprobs, mask) -> [B, T]``, and is a
function of ``d = logπ_ref − logπ`` on the valid tokens (0 off ``mask``; padding may hold
anything). Gradients flow into ``logprobs`` only. With tokens sampled from π, each has
expectation KL(π‖π_ref) (k2 only approximately); they differ in variance and bias (Schulman,
"Approximating KL Divergence", 2020).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from delta_jax.losses.aggregation import valid_tokens

KLEstimator = Callable[..., Float[Array, "B T"]]
"""``(logprobs [B, T], ref_logprobs [B, T], mask [B, T]) -> [B, T]``."""


def _log_ratio_to_ref(logprobs, ref_logprobs, mask) -> Float[Array, "B T"]:
    """``d = logπ_ref − logπ`` on the valid tokens, 0 elsewhere."""
    return jnp.where(valid_tokens(mask), jax.lax.stop_gradient(ref_logprobs) - logprobs, 0)


def kl_k1(
    logprobs: Float[Array, "B T"], ref_logprobs: Float[Array, "B T"], mask: ArrayLike
) -> Float[Array, "B T"]:
    """k1 ``= −d = logπ − logπ_ref``: unbiased, high variance, can be negative."""
    return -_log_ratio_to_ref(logprobs, ref_logprobs, mask)


def kl_k2(
    logprobs: Float[Array, "B T"], ref_logprobs: Float[Array, "B T"], mask: ArrayLike
) -> Float[Array, "B T"]:
    """k2 ``= d²/2``: non-negative, low variance, biased."""
    d = _log_ratio_to_ref(logprobs, ref_logprobs, mask)
    return 0.5 * d * d


def kl_k3(
    logprobs: Float[Array, "B T"], ref_logprobs: Float[Array, "B T"], mask: ArrayLike
) -> Float[Array, "B T"]:
    """k3 ``= e^d − d − 1``: unbiased and non-negative (GRPO's KL penalty).

    Examples:
      >>> import jax.numpy as jnp
      >>> lp, ref = jnp.array([[-1.0, -2.0]]), jnp.array([[-1.0, -1.0]])
      >>> [round(x, 4) for x in kl_k3(lp, ref, jnp.ones((1, 2)))[0].tolist()]
      [0.0, 0.7183]
    """
    d = _log_ratio_to_ref(logprobs, ref_logprobs, mask)
    return jnp.expm1(d) - d


KL_ESTIMATOR_FNS: dict[str, KLEstimator] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
"""Estimator name (``policy_loss``, config files) -> function."""
