"""The pure, jitted policy-gradient update over a batch of (packed or padded) rows.

One call applies one optimiser update from one mini-batch, accumulating gradients over ``M``
micro-batches with ``lax.scan`` (batch arrays carry a leading micro-batch axis ``[M, b, ...]``).
The loss of every micro-batch is divided by the *mini-batch's* normaliser, so the accumulated
gradient equals the gradient of the whole mini-batch's loss.

A row is ``T`` input positions holding one sequence (padded layout) or several (packed layout,
``segment_ids`` 1, 2, ... per sequence, 0 on padding; attention stays within a sequence and
positions restart at each one). The per-token loss inputs cover ``W`` positions per row: in
the padded layout the row's last ``plan.window`` (the positions that can predict a response
token), in packed rows the response positions the batch lists (``score_positions``), so the LM
head never runs on a prompt. Of these, the loss is on the positions whose target the policy drew
(``loss_mask``): not padding, nor an observation that an environment wrote into a multi-turn
response. Which optional inputs a batch carries, and whether DelTA's coefficients are computed
inside the loss, is the :class:`~delta_jax.rl.update_plan.UpdatePlan`'s decision.

A non-finite gradient skips the update (parameters and optimiser state unchanged) and is counted
in ``TrainState.skipped``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from delta_jax import sharding as sh
from delta_jax.losses import TermInputs, delta_coefficients, forking_tokens_mask
from delta_jax.models import lora, token_logprobs
from delta_jax.rl.state import TrainState
from delta_jax.rl.update_plan import UpdatePlan


@flax.struct.dataclass
class TrainBatch:
    """One mini-batch of rows, with a leading micro-batch axis M; T positions, W = window.

    The optional fields are present exactly when the plan asks for them (:func:`check_batch`).
    """

    tokens: jax.Array  # int32[M, b, T] input token of each position
    targets: jax.Array  # int32[M, b, T] the token it predicts; packed: [M, b, W] each slot's
    segment_ids: jax.Array  # int32[M, b, T] sequence number in the row, 0 = padding
    loss_mask: jax.Array  # bool[M, b, W] the target is a response token the policy drew
    advantages: jax.Array  # f32[M, b, W] its response's advantage
    rollout_logprobs: jax.Array  # f32[M, b, W] the sampler's log-prob of the target
    old_logprobs: jax.Array | None = None  # f32[M, b, W]  plan.old_pass
    coefficients: jax.Array | None = None  # f32[M, b, W]  plan.coefficients sampler/old_pass
    token_mask: jax.Array | None = None  # bool[M, b, W]  plan.fixed_token_mask
    ref_logprobs: jax.Array | None = None  # f32[M, b, W]  plan.reference
    score_positions: jax.Array | None = None  # int32[M, b, W]  plan.packing: each slot's
    # position in the row (one predicting a response token), -1 = empty slot
    score_segments: jax.Array | None = None  # int32[M, b, W]  plan.packing: the segment of
    # the response whose token a slot predicts, 0 = empty slot
    positions: jax.Array | None = None  # int32[M, b, T]  plan.share_prompts: rotary positions
    parent_ids: jax.Array | None = None  # int32[M, b, T]  ... the prompt segment continued


def batch_fields(plan: UpdatePlan) -> dict[str, bool]:
    """Optional :class:`TrainBatch` field -> whether ``plan`` needs it."""
    return {
        "old_logprobs": plan.old_pass,
        "coefficients": plan.coefficients in ("sampler", "old_pass"),
        "token_mask": plan.fixed_token_mask,
        "ref_logprobs": plan.reference,
        "score_positions": plan.packing,
        "score_segments": plan.packing,
        "positions": plan.share_prompts,
        "parent_ids": plan.share_prompts,
    }


def check_batch(plan: UpdatePlan, batch: TrainBatch) -> None:
    """Raises if ``batch`` lacks a field the plan needs, or carries one it does not."""
    for name, wanted in batch_fields(plan).items():
        if (getattr(batch, name) is not None) != wanted:
            need = "needs" if wanted else "does not take"
            raise ValueError(f"the update plan {need} TrainBatch.{name}")


def abstract_batch(plan: UpdatePlan, rows: int, sharding=None) -> TrainBatch:
    """Shapes of one mini-batch of ``rows`` rows per micro-batch, as the plan feeds it (packed
    rows at their widest window, ``plan.window``; with one shape per run, as many
    micro-batches as the mini-batch's rows need at most, unless DelTA's coefficients are
    computed in the loss, which needs the one)."""
    M, T, W = plan.micro_batches, plan.row_len, plan.window
    if plan.packing and plan.micro_batch_rows and plan.coefficients != "in_loss":
        M = -(-plan.rows_per_update // rows)
    sds = lambda width, dtype: jax.ShapeDtypeStruct((M, rows, width), dtype, sharding=sharding)
    ints = ("score_positions", "score_segments", "positions", "parent_ids")
    dtypes = {"token_mask": jnp.bool_} | dict.fromkeys(ints, jnp.int32)
    widths = {"positions": T, "parent_ids": T}
    optional = {
        name: sds(widths.get(name, W), dtypes.get(name, jnp.float32)) if wanted else None
        for name, wanted in batch_fields(plan).items()
    }
    return TrainBatch(
        tokens=sds(T, jnp.int32),
        targets=sds(W if plan.packing else T, jnp.int32),
        segment_ids=sds(T, jnp.int32),
        loss_mask=sds(W, jnp.bool_),
        advantages=sds(W, jnp.float32),
        rollout_logprobs=sds(W, jnp.float32),
        **optional,
    )


def window_logprobs(model, mb: TrainBatch, plan: UpdatePlan, *, entropy, hidden):
    """Log-probs (entropy, hidden states) of the targets of each row's ``W`` window slots.

    The hidden state at a position is the LM-head input that produced its prediction, the one
    DelTA's token-gradient proxy needs.
    """
    out = token_logprobs(
        model,
        mb.tokens,
        mb.targets,
        segment_ids=mb.segment_ids,
        parent_ids=mb.parent_ids,
        positions=mb.positions,
        temperature=plan.temperature,
        return_entropy=entropy,
        return_hidden=hidden,
        score_from=plan.score_from,
        score_positions=mb.score_positions,
        skip_empty_slots=plan.skip_empty_slots,
    )
    return out.logprobs, out.entropy, out.hidden


def loss_segments(plan: UpdatePlan, mb: TrainBatch) -> jax.Array | None:
    """Segment ids of the window when rows hold several responses (packed), else None."""
    return mb.score_segments if plan.packing else None


def delta_kwargs(plan: UpdatePlan, mesh) -> dict[str, Any]:
    """``options`` and ``mesh`` of DelTA's coefficients for the plan: the objective's options,
    with per-shard statistics over the mesh's batch axes when the plan says so."""
    options = plan.objective.delta
    if plan.delta_scope != "per_shard":
        return {"options": options}
    if mesh is None:
        raise ValueError("algo.delta_scope=per_shard needs the run's mesh")
    options = dataclasses.replace(options, scope="per_shard", axis_name=sh.batch_axes(mesh))
    return {"options": options, "mesh": mesh}


def _micro_loss(graphdef, plan: UpdatePlan, mesh, params, frozen, mb: TrainBatch, normalizer):
    logp, entropy, hidden = window_logprobs(
        nnx.merge(graphdef, params, frozen),
        mb,
        plan,
        entropy=plan.objective.needs_entropy,
        hidden=plan.coefficients == "in_loss",
    )
    return window_loss(plan, mesh, mb, logp, entropy, hidden, normalizer)


def window_loss(plan: UpdatePlan, mesh, mb: TrainBatch, logp, entropy, hidden, normalizer):
    """The loss and metrics of one micro-batch from the log-probs (entropy, hidden states) of
    its window, as :func:`window_logprobs` gives them.

    Every term — surrogate, KL, entropy bonus, DelTA's statistics, the forking-token mask —
    reads ``mb.loss_mask`` alone (``normalizer``: the mini-batch's count of it,
    ``plan.objective.count``), so positions off it (prompts, padding, observations) receive no
    gradient.
    """
    objective = plan.objective
    in_loss = plan.coefficients == "in_loss"
    live_mask = objective.uses_forking_mask and not plan.fixed_token_mask
    mask, sg = mb.loss_mask, jax.lax.stop_gradient
    old = mb.old_logprobs if plan.old_pass else sg(logp)
    coefficients, diagnostics = mb.coefficients, {}
    if in_loss:
        coefficients, diagnostics = delta_coefficients(
            sg(hidden),
            old,
            mb.advantages,
            mask,
            return_diagnostics=True,
            **delta_kwargs(plan, mesh),
        )
    token_mask = mb.token_mask
    if live_mask:
        token_mask = forking_tokens_mask(sg(entropy), mask, top_q=objective.forking_top_q)
    loss, metrics = objective(
        logp,
        old,
        mb.advantages,
        mask,
        normalizer=normalizer,
        segment_ids=loss_segments(plan, mb),
        coefficients=coefficients,
        token_mask=token_mask,
        terms=TermInputs(mb.rollout_logprobs, mb.ref_logprobs, entropy),
    )
    # Per-shard statistics carry one value per shard: their mean is logged.
    metrics.update({f"delta/{k}": jnp.mean(v) for k, v in diagnostics.items()})
    # Trainer-vs-sampler log-prob gap on valid tokens: ~0 on-policy in float32; a large value
    # means the sampler used other weights or numerics than the trainer.
    gap = jnp.abs(sg(logp) - mb.rollout_logprobs)
    metrics["rollout/logprob_gap"] = jnp.sum(jnp.where(mask, gap, 0)) / jnp.maximum(mask.sum(), 1)
    metrics["tokens"] = mask.sum().astype(jnp.float32)
    return loss, metrics


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    plan: UpdatePlan,
    *,
    mesh=None,
    donate: bool = True,
    jit_kwargs: dict[str, Any] | None = None,
) -> Callable[[TrainState, TrainBatch], tuple[TrainState, dict[str, jax.Array]]]:
    """Build the jitted ``step(state, batch) -> (state, metrics)`` of ``plan``.

    Args:
      graphdef: the policy's static graph (``nnx.split(model, nnx.Param)[0]``).
      optimizer: from :func:`delta_jax.rl.state.make_optimizer`.
      plan: the update plan (objective, layout, where the inputs come from).
      mesh: the run's mesh; needed only for ``delta_scope="per_shard"``.
      donate: donate the state buffers (the caller must not reuse the old state).
      jit_kwargs: extra ``jax.jit`` arguments, e.g. ``in_shardings`` / ``out_shardings``.
    """
    grad_fn = jax.value_and_grad(
        lambda p, f, mb, n: _micro_loss(graphdef, plan, mesh, p, f, mb, n), has_aux=True
    )

    def step(state: TrainState, batch: TrainBatch):
        check_batch(plan, batch)
        if plan.coefficients == "in_loss" and batch.tokens.shape[0] != 1:
            raise ValueError("in-loss DelTA coefficients need the mini-batch in one micro-batch")
        # The whole mini-batch's denominator: micro-batch losses then sum to its loss.
        flat = lambda x: None if x is None else x.reshape(-1, x.shape[-1])
        segments = flat(loss_segments(plan, batch))
        normalizer = plan.objective.count(flat(batch.loss_mask), segments)
        # With LoRA adapters only they are differentiated and updated; the base passes through.
        params, frozen = lora.split_trainable(state.params)

        def accumulate(grads_sum, mb):
            def add(grads_sum):
                (loss, metrics), grads = grad_fn(params, frozen, mb, normalizer)
                return jax.tree.map(jnp.add, grads_sum, grads), (loss, metrics)

            if plan.packing and batch.tokens.shape[0] > 1:  # micro-batches of padding: skipped
                return unless_padding(add, mb, grads_sum)
            return add(grads_sum)

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, (losses, metrics) = jax.lax.scan(accumulate, zeros, batch)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        updates, new_opt_state = optimizer.update(grads, state.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_state = TrainState(
            step=state.step + finite.astype(jnp.int32),
            params=nnx.merge_state(keep(new_params, params), frozen),
            opt_state=keep(new_opt_state, state.opt_state),
            skipped=state.skipped + (~finite).astype(jnp.int32),
        )
        metrics = combine_metrics(metrics, sums=("pg_loss",))
        metrics.update(
            loss=losses.sum(), grad_norm=grad_norm, update_skipped=(~finite).astype(jnp.float32)
        )
        return new_state, metrics

    return jax.jit(step, donate_argnums=(0,) if donate else (), **(jit_kwargs or {}))


def unless_padding(fn, mb: TrainBatch, carry=()):
    """``fn(carry) -> (carry, out)`` where the micro-batch ``mb`` holds a sequence; where it is
    padding only, ``fn`` is skipped (``lax.cond``): ``carry`` passes through untouched (an
    accumulator is neither rewritten nor added to) and ``out`` is zeros of its shapes."""
    out = jax.eval_shape(fn, carry)[1]
    skip = lambda carry: (carry, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out))
    return jax.lax.cond(jnp.any(mb.segment_ids > 0), fn, skip, carry)


def combine_metrics(
    stacked: dict[str, Any], *, sums: tuple[str, ...] = (), means: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Reduce metrics of several parts ``[K]`` (micro- or mini-batches) by their meaning.

    Minima and maxima keep their sense; ``sums`` add up; ``means`` are plain means (one value per
    part, e.g. per update); ``coef_std`` is pooled; every other metric is a mean over valid
    tokens, weighted by the part's ``tokens`` (which is summed). Works on jax or numpy arrays.
    """
    xp = jnp if isinstance(stacked["tokens"], jax.Array) else np
    tokens = stacked["tokens"]
    weight = tokens / xp.maximum(tokens.sum(), 1)
    mean = lambda x: (x * weight).sum()
    # Parts without a valid token (e.g. rows of padding) report 0 for their extremes: skip them.
    extreme = lambda x, fill, fn: xp.where(tokens.sum() > 0, fn(xp.where(tokens > 0, x, fill)), 0)
    out = {}
    for key, value in stacked.items():
        if key.endswith("min"):
            out[key] = extreme(value, xp.inf, xp.min)
        elif key.endswith("max"):
            out[key] = extreme(value, -xp.inf, xp.max)
        elif key in sums or key == "tokens":
            out[key] = value.sum()
        elif key in means:
            out[key] = value.mean()
        elif key == "coef_std":  # E[x²] − E[x]² over all tokens, from each part's mean and std
            second = mean(value**2 + stacked["coef_mean"] ** 2)
            out[key] = xp.sqrt(xp.maximum(second - mean(stacked["coef_mean"]) ** 2, 0))
        else:
            out[key] = mean(value)
    return out
