"""The pure, jitted policy-gradient update.

One call of the compiled step applies one optimiser update from one mini-batch, accumulating
gradients over ``M`` micro-batches with ``lax.scan`` (batch arrays carry a leading micro-batch
axis ``[M, b, ...]``). The loss of every micro-batch is divided by the *mini-batch's* normaliser,
so the accumulated gradient equals the gradient of the whole mini-batch's loss.

DelTA coefficients (DELTA_SPEC §3) come in one of two ways:

* ``batch.coefficients`` given: held fixed (computed once per rollout batch by the caller from
  the old-log-prob pass or the sampler's hidden states), as DELTA_SPEC §4 requires when a rollout
  batch feeds several updates;
* absent, with a ``delta`` objective and ``M == 1``: computed **inside the jitted loss** from the
  stop-gradient hidden states of the very forward pass that the gradient needs anyway — the
  statistics are global over the (possibly sharded) batch, and no extra model pass is paid.

A non-finite gradient skips the update (parameters and optimiser state unchanged) and is counted
in ``TrainState.skipped``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from delta_jax.config import OptimConfigSection
from delta_jax.losses import (
    delta_coefficients,
    forking_tokens_mask,
    loss_normalizer,
    policy_loss,
)
from delta_jax.models import lora, token_logprobs
from delta_jax.rl.objectives import Objective


@flax.struct.dataclass
class TrainState:
    """Everything an update changes: a pytree, donated to the step."""

    step: jax.Array  # int32[]: optimiser updates applied
    params: Any  # nnx.State of the policy's nnx.Param leaves
    opt_state: optax.OptState
    skipped: jax.Array  # int32[]: updates skipped for non-finite gradients


@flax.struct.dataclass
class TrainBatch:
    """One mini-batch, with a leading micro-batch axis M.

    Sequences are ``prompt (left-padded to P) ++ response (right-padded to G)``; S = P + G.
    """

    input_ids: jax.Array  # int32[M, b, S]
    attention_mask: jax.Array  # bool[M, b, S]
    response_mask: jax.Array  # bool[M, b, G]
    advantages: jax.Array  # f32[M, b]
    old_logprobs: jax.Array | None = None  # f32[M, b, G]; None = on-policy (stop-gradient)
    coefficients: jax.Array | None = None  # f32[M, b, G]; None = inline DelTA when needed
    token_mask: jax.Array | None = None  # bool[M, b, G]; e.g. forking tokens of the old pass
    rollout_logprobs: jax.Array | None = None  # f32[M, b, G]; sampler's, for TIS
    ref_logprobs: jax.Array | None = None  # f32[M, b, G]; for the KL penalty


def make_optimizer(cfg: OptimConfigSection, total_updates: int) -> optax.GradientTransformation:
    """AdamW with global-norm clipping; weight decay on matrices only (not norms or biases)."""
    if cfg.schedule == "cosine":
        lr: optax.Schedule | float = optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=cfg.lr,
            warmup_steps=cfg.warmup_steps,
            decay_steps=max(total_updates, cfg.warmup_steps + 1),
            end_value=cfg.lr * cfg.min_lr_ratio,
        )
    elif cfg.warmup_steps > 0:
        lr = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
    else:
        lr = cfg.lr
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(
            lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask
        ),
    )


def init_train_state(params: Any, optimizer: optax.GradientTransformation) -> TrainState:
    """Optimiser state for the trainable parameters only (the adapters when there are some)."""
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(lora.split_trainable(params)[0]),
        skipped=jnp.zeros((), jnp.int32),
    )


def response_logprobs(
    model: nnx.Module,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    gen_len: int,
    *,
    temperature: float,
    return_entropy: bool = False,
    return_hidden: bool = False,
):
    """Log-probs (and optionally entropy / hidden) of the last ``gen_len`` tokens of each row.

    Position ``P - 1 + t`` predicts response token ``t``; its hidden state is the one DelTA's
    token-gradient proxy needs (the LM-head input that produced ``p_t``).
    """
    out = token_logprobs(
        model,
        input_ids[:, :-1],
        input_ids[:, 1:],
        attention_mask=attention_mask[:, :-1],
        temperature=temperature,
        return_entropy=return_entropy,
        return_hidden=return_hidden,
        score_from=input_ids.shape[1] - 1 - gen_len,  # the LM head skips the prompt
    )
    return out.logprobs, out.entropy, out.hidden


def _combine_metrics(stacked: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Reduce per-micro-batch metrics [M]: min/max keep their sense, the rest are averaged."""
    out = {}
    for key, value in stacked.items():
        if key.endswith("min"):
            out[key] = value.min()
        elif key.endswith("max"):
            out[key] = value.max()
        else:
            out[key] = value.mean()
    return out


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    objective: Objective,
    *,
    temperature: float,
    gen_len: int,
    donate: bool = True,
    jit_kwargs: dict[str, Any] | None = None,
) -> Callable[[TrainState, TrainBatch], tuple[TrainState, dict[str, jax.Array]]]:
    """Build the jitted ``step(state, batch) -> (state, metrics)``.

    Args:
      graphdef: the policy's static graph (``nnx.split(model, nnx.Param)[0]``).
      optimizer: from :func:`make_optimizer`.
      objective: from :func:`delta_jax.rl.objectives.resolve_objective`.
      temperature: sampling temperature; log-probs are recomputed at it.
      gen_len: G, the padded response length.
      donate: donate the state buffers (the caller must not reuse the old state).
      jit_kwargs: extra ``jax.jit`` arguments, e.g. ``in_shardings`` / ``out_shardings``.
    """
    loss_kwargs = objective.loss_kwargs
    aggregation = loss_kwargs["aggregation"]

    def micro_loss(params, frozen, mb: TrainBatch, normalizer):
        model = nnx.merge(graphdef, params, frozen)
        inline_delta = objective.uses_delta and mb.coefficients is None
        need_entropy = objective.needs_entropy or (
            objective.uses_forking_mask and mb.token_mask is None
        )
        logp, entropy, hidden = response_logprobs(
            model,
            mb.input_ids,
            mb.attention_mask,
            gen_len,
            temperature=temperature,
            return_entropy=need_entropy,
            return_hidden=inline_delta,
        )
        mask = mb.response_mask
        old = jax.lax.stop_gradient(logp) if mb.old_logprobs is None else mb.old_logprobs
        coefficients = mb.coefficients
        diagnostics = {}
        if inline_delta:
            coefficients, diagnostics = delta_coefficients(
                jax.lax.stop_gradient(hidden),
                old,
                mb.advantages,
                mask,
                return_diagnostics=True,
                **objective.delta_kwargs,
            )
        token_mask = mb.token_mask
        if objective.uses_forking_mask and token_mask is None:
            token_mask = forking_tokens_mask(
                jax.lax.stop_gradient(entropy), mask, top_q=objective.forking_top_q
            )
        extra = {}
        if "entropy_coef" in loss_kwargs:
            extra["entropy"] = entropy
        if mb.rollout_logprobs is not None and "tis_cap" in loss_kwargs:
            extra["rollout_logprobs"] = mb.rollout_logprobs
        if mb.ref_logprobs is not None:
            extra["ref_logprobs"] = mb.ref_logprobs
        loss, metrics = policy_loss(
            logp,
            old,
            mb.advantages,
            mask,
            coefficients=coefficients,
            token_mask=token_mask,
            normalizer=normalizer,
            **extra,
            **loss_kwargs,
        )
        metrics.update({f"delta/{k}": v for k, v in diagnostics.items()})
        if mb.rollout_logprobs is not None:
            # Trainer-vs-sampler log-prob gap on valid tokens: ~0 on-policy in float32; a large
            # value means the sampler used other weights or numerics than the trainer.
            gap = jnp.abs(jax.lax.stop_gradient(logp) - mb.rollout_logprobs)
            metrics["rollout/logprob_gap"] = jnp.sum(jnp.where(mask, gap, 0)) / jnp.maximum(
                mask.sum(), 1
            )
        return loss, metrics

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step(state: TrainState, batch: TrainBatch):
        if objective.uses_delta and batch.coefficients is None and batch.input_ids.shape[0] != 1:
            raise ValueError(
                "inline DelTA coefficients need the whole mini-batch in one micro-batch; "
                "pass precomputed batch.coefficients when micro_batches > 1"
            )
        # The whole mini-batch's denominator: micro-batch losses then sum to its loss.
        mask = batch.response_mask
        normalizer = loss_normalizer(mask.reshape(-1, mask.shape[-1]), aggregation)
        # With LoRA adapters only they are differentiated and updated; the base passes through.
        params, frozen = lora.split_trainable(state.params)

        def accumulate(grads_sum, mb):
            (loss, metrics), grads = grad_fn(params, frozen, mb, normalizer)
            grads_sum = jax.tree.map(jnp.add, grads_sum, grads)
            return grads_sum, (loss, metrics)

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
        metrics = _combine_metrics(metrics)
        metrics.update(
            loss=losses.sum(), grad_norm=grad_norm, update_skipped=(~finite).astype(jnp.float32)
        )
        return new_state, metrics

    return jax.jit(step, donate_argnums=(0,) if donate else (), **(jit_kwargs or {}))


def make_old_pass(
    graphdef: nnx.GraphDef,
    *,
    temperature: float,
    gen_len: int,
    return_entropy: bool,
    hidden_dtype: jnp.dtype | None = None,
) -> Callable:
    """Jitted forward over one micro-batch under the old parameters (no gradient).

    Returns ``(logprobs [b, G], entropy [b, G] | None, hidden [b, G, H])``; the hidden states are
    kept (in ``hidden_dtype``, default the model's compute dtype — bf16 in the paper configs, so
    ``2·B·G·H`` bytes for the rollout batch) so that DelTA's statistics over the whole rollout
    batch are computed exactly without another model pass.
    """

    def old_pass(params, input_ids, attention_mask):
        model = nnx.merge(graphdef, params)
        logp, entropy, hidden = response_logprobs(
            model,
            input_ids,
            attention_mask,
            gen_len,
            temperature=temperature,
            return_entropy=return_entropy,
            return_hidden=True,
        )
        if hidden_dtype is not None:
            hidden = hidden.astype(hidden_dtype)
        return logp, entropy, hidden

    return jax.jit(old_pass)
