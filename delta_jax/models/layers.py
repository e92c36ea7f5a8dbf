"""The decoder's layer maths: RMS norm, RoPE, and the decoder block with its matmuls.

Pure functions of arrays, written as the maths (einsums over shape letters: B batch, T tokens,
H hidden, N query heads, K key/value heads, D head dim, F MLP width). The numerics follow the
``transformers`` implementations: RMSNorm statistics and RoPE angles in float32 (or the compute
dtype if wider, see :func:`~delta_jax.models.attention.accumulation_dtype`), then cast back.

:func:`decoder_block` is the one block that :class:`~delta_jax.models.transformer.Transformer`
runs L times; its projections include the LoRA adapters (:func:`delta_jax.models.lora.project`)
when the layer's parameters hold them, and :func:`remat` wraps it in ``jax.checkpoint`` as
``model.remat`` says.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float

from delta_jax.models import axes as ax
from delta_jax.models import lora
from delta_jax.models.attention import accumulation_dtype
from delta_jax.models.config import ModelConfig

# An attention step: ``attend(q [B, T, N, D], k [B, T, K, D], v [B, T, K, D], state) ->
# (out [B, T, N, D], state)``; the one thing the callers of :func:`decoder_block` change.
Attend = Callable[[jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]

# Names of the values remat="matmuls" keeps: weight-matmul outputs and attention outputs.
MATMUL_NAME, ATTENTION_NAME = "matmul", "attention"


def rms_norm(x, weight, eps, dtype):
    """``x`` RMS-normalised over its last axis and scaled by ``weight``, in ``dtype``."""
    # Statistics in float32, then cast back before the scale, as transformers does.
    xf = x.astype(accumulation_dtype(x.dtype))
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(dtype) * xf.astype(dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies [D/2] (float64), with the config's frequency scaling applied.

    ``inv_freq_i = theta^(-2i/D)``; "linear" divides all by ``factor``; "llama3" divides the low
    frequencies (wavelength > original_context / low_freq_factor) by ``factor``, keeps the high
    ones, and interpolates smoothly in between.
    """
    D = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D)
    rs = cfg.rope_scaling
    kind = None if rs is None else rs.get("rope_type", rs.get("type", "default"))
    if kind == "linear":
        inv = inv / rs["factor"]
    elif kind == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = np.where(medium, smoothed, scaled)
    return inv


def rope_tables(cfg, positions, dtype):
    """RoPE's cos and sin tables [B, T, 1, D] of the positions [B, T], in ``dtype``."""
    acc_dtype = accumulation_dtype(dtype)
    inv = jnp.asarray(rope_inv_freq(cfg), acc_dtype)
    angles = positions.astype(acc_dtype)[..., None] * inv  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def _rope(x, cos, sin):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def remat(block, policy: str):
    """Wraps a decoder block in ``jax.checkpoint`` as ``model.remat`` says (see ModelConfig)."""
    if policy == "block":
        policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        return jax.checkpoint(block, policy=policy)
    if policy == "matmuls":
        names = jax.checkpoint_policies.save_only_these_names(MATMUL_NAME, ATTENTION_NAME)
        return jax.checkpoint(block, policy=names)
    if policy == "full":
        return jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable)
    return block


def _matmul(spec: str, x, w: dict[str, jax.Array], weight: str, lora_scale: float):
    """``einsum(spec, x, w[weight])`` (plus its LoRA adapters, if any), named for remat."""
    return checkpoint_name(lora.project(spec, x, w, weight, lora_scale), MATMUL_NAME)


def decoder_block(
    cfg: ModelConfig,
    dtype,
    p: dict[str, Any],
    x: Float[Array, "B T H"],
    cos: Float[Array, "B T 1 D"],
    sin: Float[Array, "B T 1 D"],
    attend: Attend,
    state: Any = None,
    *,
    flat_heads: bool = False,
) -> tuple[Float[Array, "B T H"], Any]:
    """One decoder block, ``x += Attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x))``, with the
    attention step passed in.

    The projections include the LoRA adapters when ``p`` holds them. ``attend(q, k, v, state)``
    gets the queries [B, T, N, D] and the new keys and values [B, T, K, D] (after q/k-norm and
    RoPE) and returns the attention output per head [B, T, N, D] and its new state: attention
    within segments for the full forward, a KV-cache write and read for the cached decode, a
    page write and read for the paged engine.

    Args:
      cfg: the model's configuration (its flags select the family's maths).
      dtype: compute dtype; the weights are cast to it.
      p: one layer's parameters.
      x: the residual stream [B, T, H].
      cos, sin: RoPE tables of the tokens' positions.
      attend: the attention step.
      state: the attention step's state of this layer (a cache, pages), passed through.
      flat_heads: project the attention output as ``[B, T, N·D] @ [N·D, H]`` (the decode
        paths, see the comment) instead of contracting ``(N, D)`` as a pair (the full
        forward); the same maths.

    Returns:
      (the new residual stream [B, T, H], the attention step's new state).
    """
    eps = cfg.rms_norm_eps
    w = {k: v.astype(dtype) for k, v in p.items()}
    s = cfg.lora_alpha / cfg.lora_rank if cfg.lora_rank else 0.0  # LoRA scale (if adapters)
    h = rms_norm(x, w["attn_norm"], eps, dtype)
    q = _matmul("BTH,HND->BTND", h, w, "wq", s)
    k = _matmul("BTH,HKD->BTKD", h, w, "wk", s)
    v = _matmul("BTH,HKD->BTKD", h, w, "wv", s)
    if cfg.qkv_bias:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    if cfg.qk_norm:
        q = rms_norm(q, w["q_norm"], eps, dtype)
        k = rms_norm(k, w["k_norm"], eps, dtype)
    q = ax.constrain(_rope(q, cos, sin), (ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM))
    heads, state = attend(q, _rope(k, cos, sin), v, state)
    if flat_heads:
        # The decode paths contract the flattened (head, head_dim) pair: given the pair,
        # XLA:CPU transposes the whole projection at every decode step.
        B, T, N, D = heads.shape
        wo = dict(w, wo=w["wo"].reshape(N * D, -1))
        x = x + _matmul("BTE,EH->BTH", heads.reshape(B, T, N * D), wo, "wo", s)
    else:
        x = x + _matmul("BTND,NDH->BTH", heads, w, "wo", s)
    x = ax.constrain(x, (ax.BATCH, ax.LENGTH, ax.EMBED))
    h = rms_norm(x, w["mlp_norm"], eps, dtype)
    gate = _matmul("BTH,HF->BTF", h, w, "w_gate", s)
    up = _matmul("BTH,HF->BTF", h, w, "w_up", s)
    act = ax.constrain(jax.nn.silu(gate) * up, (ax.BATCH, ax.LENGTH, ax.MLP))
    x = x + _matmul("BTF,FH->BTH", act, w, "w_down", s)
    return ax.constrain(x, (ax.BATCH, ax.LENGTH, ax.EMBED)), state
