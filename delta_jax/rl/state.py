"""The train state: parameters, optimiser state and counters, created in their final placement."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from delta_jax import sharding as sh
from delta_jax.config import OptimConfigSection
from delta_jax.models import lora


@flax.struct.dataclass
class TrainState:
    """Everything an update changes: a pytree, donated to the step."""

    step: jax.Array  # int32[]: optimiser updates applied
    params: Any  # nnx.State of the policy's nnx.Param leaves
    opt_state: optax.OptState
    skipped: jax.Array  # int32[]: updates skipped for non-finite gradients


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
    # grad_clip 0 is "no clipping" (clip_by_global_norm(0) would zero every update).
    clip = optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity()
    return optax.chain(
        clip,
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


def init_sharded_state(params: Any, optimizer: Any, mesh, rules: sh.Rules = sh.TRAIN_RULES):
    """``init_train_state`` run on device with every leaf created in its final sharding.

    Args:
      params: the parameter state (any placement; it is resharded by its metadata).
      optimizer: the optax transformation.
      mesh, rules: placement.

    Returns:
      ``(state, shardings)``: the ``TrainState`` and its sharding pytree.
    """
    params = sh.shard_params(params, mesh, rules)
    abstract = jax.eval_shape(lambda p: init_train_state(p, optimizer), params)
    shardings = sh.state_shardings(abstract, mesh, rules)
    with sh.use_mesh(mesh, rules):
        state = jax.jit(lambda p: init_train_state(p, optimizer), out_shardings=shardings)(params)
    return state, shardings
