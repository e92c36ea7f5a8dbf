"""What runs between the rollout and the first update: old-policy pass, coefficients, reference.

One jitted program over the rows of every mini-batch (``[mini, M, b, ...]``), one micro-batch
at a time (:func:`forward_chunks`), as the :class:`~delta_jax.rl.update_plan.UpdatePlan` says:

* old-policy pass (``plan.old_pass``): old log-probs, and — for DelTA — the hidden states from
  which the coefficients of the whole rollout batch are computed once and held fixed
  (DELTA_SPEC §4); the forking-token mask from its entropy;
* reference pass (``plan.reference``): the reference policy's log-probs for the KL penalty.

DelTA's statistics are sums over valid tokens (``loss_mask``: the response tokens the policy
drew, observations left out), so the coefficients do not depend on how the sequences are laid
out in rows (per-token advantages carry each response's sign and weight).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from delta_jax.losses import (
    delta_coefficients,
    delta_coefficients_microbatched,
    forking_tokens_mask,
)
from delta_jax.rl.train_step import TrainBatch, delta_kwargs, unless_padding, window_logprobs
from delta_jax.rl.update_plan import UpdatePlan


def forward_chunks(graphdef, plan: UpdatePlan, params, batch: TrainBatch, *, entropy, hidden):
    """Log-probs (entropy, hidden) of every micro-batch of ``batch [mini, M, b, ...]``, in turn
    (packed micro-batches of padding only: zeros, skipped as the train step skips them)."""
    lead = batch.tokens.shape[:2]
    flat = lambda x: x.reshape(-1, *x.shape[2:])

    def one(mb):
        model = nnx.merge(graphdef, params)
        return window_logprobs(model, mb, plan, entropy=entropy, hidden=hidden)

    skips = plan.packing and batch.tokens.shape[1] > 1
    live_only = lambda mb: unless_padding(lambda carry: (carry, one(mb)), mb)[1]
    out = jax.lax.map(live_only if skips else one, jax.tree.map(flat, batch))
    return jax.tree.map(lambda x: x.reshape(*lead, *x.shape[1:]), out)


def make_prepare(graphdef, plan: UpdatePlan, *, mesh=None):
    """Jitted ``prepare(params, ref_params, batch) -> (batch, delta diagnostics)``."""

    def prepare(params, ref_params, batch: TrainBatch):
        diagnostics = {}
        if plan.old_pass:
            uses_hidden = plan.coefficients == "old_pass"
            logp, entropy, hidden = forward_chunks(
                graphdef, plan, params, batch, entropy=plan.fixed_token_mask, hidden=uses_hidden
            )
            batch = batch.replace(old_logprobs=logp)
            if plan.fixed_token_mask:
                batch = batch.replace(token_mask=_forking(plan, entropy, batch.loss_mask))
            if uses_hidden:
                coefficients, diagnostics = _rollout_coefficients(plan, mesh, batch, hidden)
                batch = batch.replace(coefficients=coefficients)
        if plan.reference:
            ref, _, _ = forward_chunks(
                graphdef, plan, ref_params, batch, entropy=False, hidden=False
            )
            batch = batch.replace(ref_logprobs=ref)
        return batch, {k: jnp.mean(v) for k, v in diagnostics.items()}

    return jax.jit(prepare)


def _forking(plan: UpdatePlan, entropy, mask):
    W = mask.shape[-1]
    top = forking_tokens_mask(
        entropy.reshape(-1, W), mask.reshape(-1, W), top_q=plan.objective.forking_top_q
    )
    return top.reshape(mask.shape)


def _rollout_coefficients(plan: UpdatePlan, mesh, batch: TrainBatch, hidden):
    """DelTA coefficients of the whole rollout batch, from every micro-batch's hidden states
    (taken a mini-batch at a time: the statistics are sums over tokens, and the program stays
    small however many micro-batches a mini-batch has)."""
    chunks = lambda x: [x[i].reshape(-1, *x.shape[3:]) for i in range(x.shape[0])]
    coefficients, diagnostics = delta_coefficients_microbatched(
        chunks(hidden),
        chunks(batch.old_logprobs),
        chunks(batch.advantages),
        chunks(batch.loss_mask),
        return_diagnostics=True,
        **delta_kwargs(plan, mesh),
    )
    shape = batch.loss_mask.shape
    return jnp.stack(coefficients).reshape(shape), diagnostics


def make_sampler_coefficients(plan: UpdatePlan, *, mesh=None):
    """Jitted DelTA coefficients ``[B, G]`` of a rollout from the sampler's hidden states.

    ``coefficients(hidden, logprobs, advantages, lengths, action_mask=None)``: the statistics
    run over the response tokens (``lengths``) that the policy drew (``action_mask``, None: all).
    """

    def coefficients(hidden, logprobs, advantages, lengths, action_mask=None):
        mask = jnp.arange(plan.gen_len)[None] < lengths[:, None]
        if action_mask is not None:
            mask = mask & action_mask
        coef, diagnostics = delta_coefficients(
            hidden, logprobs, advantages, mask, return_diagnostics=True, **delta_kwargs(plan, mesh)
        )
        return coef, {k: jnp.mean(v) for k, v in diagnostics.items()}

    return jax.jit(coefficients)
