"""LoRA adapters on the decoder's projections: ``W x + (alpha / r) · B (A x)``.

Which library, and why not qwix. ``qwix`` (the LoRA library Tunix uses) adds adapters by
intercepting ``jnp.einsum`` / ``dot_general`` calls made inside an NNX module's ``__call__`` and
matching the right-hand operand to one of *that module's* parameters by identity. Our
:class:`~delta_jax.models.transformer.Transformer` keeps the L blocks' weights stacked on a
leading layer axis and applies them in a plain function (``decoder_block``) to per-layer slices
(taken by ``lax.scan`` or by indexing), so the operands qwix sees are slices, not parameters of the
calling module: it finds nothing to adapt. Rewriting the model as per-layer modules for qwix's
sake would give up the scan-over-layers layout the checkpoints, the sharding rules and the
sampler are built on. So the adapters are explicit here — ``A [*in, r]`` and ``B [r, *out]``
stacked per layer next to the weight they adapt, applied by :func:`project` in the same einsum
notation as the model — and typed as Flax's own ``nnx.LoRAParam`` (a maintained subclass of
``nnx.Param``), which is what selects the trainable part (:func:`split_trainable`).

What holds with adapters on:

* only the adapters get gradients and optimiser state: the train step differentiates with
  respect to :func:`split_trainable`'s first part and passes the base weights through unchanged;
* the sampler and the trainer read the base weights plus the adapters (:func:`project`); no
  merged copy of the weights exists between steps (the adapted matmul costs
  ``r·(in + out)`` extra flops per token per projection);
* checkpoints hold the adapters (with the base weights they were trained on);
* export writes the merged model (:func:`merge_adapters`, then ``save_pretrained``) or PEFT's
  ``adapter_model.safetensors`` + ``adapter_config.json`` (:func:`save_peft_adapters`).

Adapters are float32 whatever ``param_dtype`` is, so a LoRA run can keep the frozen base in
bfloat16 (``model.param_dtype=bfloat16``: half the base's bytes) while the adapters and their
AdamW moments stay float32. Initialisation follows PEFT: ``A`` uniform in ``±1/sqrt(fan_in)``
(Kaiming-uniform with ``a = sqrt(5)``), ``B = 0``, so the adapted model starts equal to the base
model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

# PEFT / transformers module name -> (our weight, number of leading input dims of our layout,
# HF module path under ``model.layers.{i}``).
TARGETS: dict[str, tuple[str, int, str]] = {
    "q_proj": ("wq", 1, "self_attn.q_proj"),
    "k_proj": ("wk", 1, "self_attn.k_proj"),
    "v_proj": ("wv", 1, "self_attn.v_proj"),
    "o_proj": ("wo", 2, "self_attn.o_proj"),
    "gate_proj": ("w_gate", 1, "mlp.gate_proj"),
    "up_proj": ("w_up", 1, "mlp.up_proj"),
    "down_proj": ("w_down", 1, "mlp.down_proj"),
}
ALL_TARGETS = tuple(TARGETS)


def _names(weight: str) -> tuple[str, str]:
    return f"{weight}_lora_a", f"{weight}_lora_b"


def add_adapters(
    model: Any,
    *,
    rank: int,
    alpha: float,
    targets: Sequence[str] = ALL_TARGETS,
    seed: int = 0,
) -> Any:
    """Adds zero-initialised-``B`` LoRA adapters of ``rank`` to ``targets`` of ``model``.

    Args:
      model: a :class:`~delta_jax.models.transformer.Transformer` (modified in place).
      rank: r > 0.
      alpha: the scale is ``alpha / rank``.
      targets: PEFT module names among :data:`TARGETS` (``q_proj``, ..., ``down_proj``).
      seed: RNG seed of the ``A`` initialisation.

    Returns:
      ``model``, whose ``config`` now carries ``lora_rank`` / ``lora_alpha``.
    """
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or not targets:
        raise ValueError(f"lora targets {unknown or list(targets)}; choose from {ALL_TARGETS}")
    if rank <= 0:
        raise ValueError(f"lora rank must be positive, got {rank}")
    blocks = model.blocks
    key = jax.random.key(seed)
    for i, target in enumerate(targets):
        weight, n_in, _ = TARGETS[target]
        var = getattr(blocks, weight)
        w = var.get_value()
        names = var.get_metadata().get("out_sharding") or (None,) * w.ndim
        L, ins, outs = w.shape[0], w.shape[1 : 1 + n_in], w.shape[1 + n_in :]
        bound = 1.0 / np.sqrt(np.prod(ins))
        # float32 whatever the base's dtype: a bfloat16 base stays frozen, the adapters (and
        # their AdamW moments) that do move are small.
        key_i = jax.random.fold_in(key, i)
        a = jax.random.uniform(key_i, (L, *ins, rank), jnp.float32, -bound, bound)
        b = jnp.zeros((L, rank, *outs), jnp.float32)
        a_axes = (names[0], *names[1 : 1 + n_in], None)
        b_axes = (names[0], None, *names[1 + n_in :])
        name_a, name_b = _names(weight)
        setattr(blocks, name_a, nnx.LoRAParam(a, out_sharding=a_axes, eager_sharding=False))
        setattr(blocks, name_b, nnx.LoRAParam(b, out_sharding=b_axes, eager_sharding=False))
    model.config = model.config.replace(lora_rank=rank, lora_alpha=float(alpha))
    return model


def project(eq: str, x: jax.Array, w: dict[str, jax.Array], weight: str, scale: float):
    """``einsum(eq, x, W)`` plus ``scale · (x A) B`` when ``w`` holds adapters for ``weight``.

    ``eq`` is the base projection, e.g. ``"BTH,HND->BTND"``; the adapter path contracts the same
    input letters with ``A`` (``"BTH,Hr->BTr"``) and expands to the same output letters with
    ``B`` (``"BTr,rND->BTND"``). ``W`` / ``A`` may have been reshaped by the caller (``wo`` is
    applied as ``[N·D, H]``): ``A`` is reshaped to ``W``'s input dims here.
    """
    y = jnp.einsum(eq, x, w[weight])
    name_a, name_b = _names(weight)
    if name_a not in w:
        return y
    lhs, rest = eq.split(",")
    rhs, out = rest.split("->")
    ins = "".join(c for c in rhs if c in lhs)
    outs = "".join(c for c in rhs if c not in lhs)
    kept = "".join(c for c in lhs if c not in rhs)
    a = w[name_a].reshape(*w[weight].shape[: len(ins)], -1)
    b = w[name_b].reshape(a.shape[-1], *w[weight].shape[len(ins) :])
    h = jnp.einsum(f"{lhs},{ins}r->{kept}r", x, a)  # [..., r]: the low-rank code
    return y + scale * jnp.einsum(f"{kept}r,r{outs}->{out}", h, b)


def has_adapters(params: Any) -> bool:
    """Whether a parameter state holds any ``nnx.LoRAParam``."""
    leaves = jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return any(isinstance(v, nnx.LoRAParam) for v in leaves)


def split_trainable(params: nnx.State) -> tuple[nnx.State, nnx.State]:
    """``(trainable, frozen)``: the adapters and the rest when there are adapters, else all
    parameters and an empty state. ``nnx.merge_state(trainable, frozen)`` gives ``params``."""
    if has_adapters(params):
        return nnx.split_state(params, nnx.LoRAParam, ...)
    return params, nnx.State({})


def delta(w: dict[str, jax.Array], weight: str, scale: float) -> jax.Array:
    """``scale · A B`` in ``weight``'s layout (all layers): the update the adapters stand for."""
    name_a, name_b = _names(weight)
    a, b, L = w[name_a], w[name_b], w[weight].shape[0]
    r = a.shape[-1]
    d = jnp.einsum("LIr,LrO->LIO", a.reshape(L, -1, r), b.reshape(L, r, -1))
    return scale * d.reshape(w[weight].shape)


def merge_adapters(model: Any) -> Any:
    """Folds the adapters into the weights (``W + (alpha/r) A B``) and removes them, in place.

    Used for export; afterwards ``model`` is a plain model of the base architecture.
    """
    blocks, cfg = model.blocks, model.config
    if not cfg.lora_rank:
        return model
    scale = cfg.lora_alpha / cfg.lora_rank
    arrays = blocks.arrays()
    for weight, _, _ in TARGETS.values():
        name_a, name_b = _names(weight)
        if name_a not in arrays:
            continue
        w = arrays[weight]
        d = delta(arrays, weight, scale)
        merged = (w.astype(jnp.float32) + d.astype(jnp.float32)).astype(w.dtype)
        getattr(blocks, weight).set_value(merged)
        delattr(blocks, name_a)
        delattr(blocks, name_b)
    model.config = cfg.replace(lora_rank=0, lora_alpha=0.0)
    return model


def targets_of(model: Any) -> list[str]:
    """The PEFT module names that carry adapters in ``model``."""
    arrays = model.blocks.arrays()
    return [t for t, (weight, _, _) in TARGETS.items() if _names(weight)[0] in arrays]


def save_peft_adapters(model: Any, path: str | os.PathLike, base_model: str) -> None:
    """Writes the adapters as PEFT does: ``adapter_model.safetensors`` + ``adapter_config.json``.

    Keys are PEFT's (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``
    ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``), so ``peft.PeftModel.from_pretrained``
    loads them onto the ``transformers`` base model ``base_model``.
    """
    cfg = model.config
    if not cfg.lora_rank:
        raise ValueError("the model has no LoRA adapters to export")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    arrays = model.blocks.arrays()
    tensors = {}
    targets = targets_of(model)
    for target in targets:
        weight, _, hf_module = TARGETS[target]
        name_a, name_b = _names(weight)
        a = np.asarray(jax.device_get(arrays[name_a]))  # [L, *in, r]
        b = np.asarray(jax.device_get(arrays[name_b]))  # [L, r, *out]
        for i in range(cfg.num_layers):
            prefix = f"base_model.model.model.layers.{i}.{hf_module}"
            r = a.shape[-1]
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, r).T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(r, -1).T)
    # Adapters are small (r·(in+out) per projection): one dict in host memory is fine here.
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "target_modules": targets,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "modules_to_save": None,
        "init_lora_weights": True,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
