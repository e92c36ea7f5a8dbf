"""Decoder-only transformer for the Qwen3, Qwen2.5 and Llama-3 families (Flax NNX).

Pre-norm blocks ``x += Attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x))`` with grouped-query attention,
rotate-half RoPE (optionally llama3/linear frequency scaling), Qwen3's per-head q/k RMSNorm and
Qwen2's q/k/v bias, all selected by :class:`ModelConfig` flags. The numerics follow the
``transformers`` implementations (RMSNorm in float32 then cast, softmax in float32) so that
imported checkpoints give the same logits. Attention without a cache (training, scoring) is
``config.attention``'s implementation from :mod:`delta_jax.models.attention` (dense, chunked,
Pallas splash on TPU, cuDNN on GPU); with a KV cache (sampling) it is the decode path, laid out
for XLA:CPU.

The block exists once (:func:`decoder_block`), with the attention step passed in: the full
forward, the cached decode and the paged rollout engine (:mod:`delta_jax.sampling.attention.paged`)
all run it through :meth:`Transformer.forward_with`.

The L decoder blocks are stored stacked (every block parameter has a leading ``layers`` axis);
``config.scan_layers`` chooses ``lax.scan`` over that axis or an unrolled loop, so both variants
share one parameter layout (and one checkpoint format). Calls with a KV cache (inference) always
unroll: every layer's cache is then its own buffer, updated in place and read by the attention
dots directly, with no per-step slice or relayout copy of the cache. The forward pass is a pure
function of the parameters: ``nnx.split(model, nnx.Param)`` / ``nnx.merge`` inside ``jax.jit``
works.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Bool, Float, Int

from delta_jax.models import axes as ax
from delta_jax.models import lora
from delta_jax.models.attention import accumulation_dtype, attention, slot_attention
from delta_jax.models.config import ModelConfig

# Logical axes of each layer's cached keys and values (the layout :class:`KVCache` describes).
KEY_CACHE_AXES = (ax.BATCH, ax.KV_HEADS, ax.HEAD_DIM, ax.CACHE_LENGTH)
VALUE_CACHE_AXES = (ax.BATCH, ax.KV_HEADS, ax.CACHE_LENGTH, ax.HEAD_DIM)

# An attention step: ``attend(q [B, T, N, D], k [B, T, K, D], v [B, T, K, D], state) ->
# (out [B, T, N, D], state)``; the one thing the callers of :func:`decoder_block` change.
Attend = Callable[[jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


@flax.struct.dataclass
class KVCache:
    """Key/value cache: K/V of every layer in S slots per row.

    The layout is chosen for decoding speed: one buffer per layer (a stacked ``[L, ...]`` array
    would be sliced, i.e. copied whole, by every layer at every step), heads before slots, and
    keys stored transposed (``[D, S]`` per head) so that both attention dots are plain batched
    matmuls over operands read as stored: ``q [G, D] @ k [D, S]`` and ``p [G, S] @ v [S, D]``.
    (With keys as ``[S, D]`` the score dot contracts the minor dimension of both operands, which
    XLA:CPU runs 2.5x slower, repacking the whole cache at every step.)

    Attributes:
      k: tuple of L arrays [B, K, D, S]: keys (after RoPE) of each layer, transposed.
      v: tuple of L arrays [B, K, S, D]: values of each layer.
      mask: bool[B, S], True where a slot holds a real token.
      index: int32 scalar, the next slot to write (same for all rows).
    """

    k: tuple[Float[Array, "B K D S"], ...]
    v: tuple[Float[Array, "B K S D"], ...]
    mask: Bool[Array, "B S"]
    index: Int[Array, ""]


@flax.struct.dataclass
class ModelOutput:
    """Result of a forward pass.

    Attributes:
      logits: [B, T, V] in the compute dtype, or None when ``return_logits=False``.
      hidden: [B, T, H] final RMS-normed hidden state (the LM head's input).
      cache: the updated :class:`KVCache`, or None when called without one.
    """

    logits: Float[Array, "B T V"] | None
    hidden: Float[Array, "B T H"]
    cache: KVCache | None = None


def _param(rngs: nnx.Rngs, init, shape, names, dtype) -> nnx.Param:
    # No eager sharding: placement is explicit (from_pretrained / delta_jax.sharding), so a model
    # can be built with or without an active mesh; the logical names ride along as metadata.
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names, eager_sharding=False)


class _Blocks(nnx.Module):
    """Parameters of the L decoder blocks, stacked along a leading ``layers`` axis."""

    def __init__(self, cfg: ModelConfig, param_dtype, rngs: nnx.Rngs):
        L, H, N, K, D, F = (
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
        )
        normal, ones, zeros = (
            nnx.initializers.normal(0.02),
            nnx.initializers.ones,
            nnx.initializers.zeros,
        )
        lay, emb, hd = ax.LAYERS, ax.EMBED, ax.HEAD_DIM

        def p(init, shape, names):
            return _param(rngs, init, (L, *shape), (lay, *names), param_dtype)

        self.attn_norm = p(ones, (H,), (emb,))
        self.wq = p(normal, (H, N, D), (emb, ax.HEADS, hd))
        self.wk = p(normal, (H, K, D), (emb, ax.KV_HEADS, hd))
        self.wv = p(normal, (H, K, D), (emb, ax.KV_HEADS, hd))
        self.wo = p(normal, (N, D, H), (ax.HEADS, hd, emb))
        if cfg.qkv_bias:
            self.bq = p(zeros, (N, D), (ax.HEADS, hd))
            self.bk = p(zeros, (K, D), (ax.KV_HEADS, hd))
            self.bv = p(zeros, (K, D), (ax.KV_HEADS, hd))
        if cfg.qk_norm:
            self.q_norm = p(ones, (D,), (hd,))
            self.k_norm = p(ones, (D,), (hd,))
        self.mlp_norm = p(ones, (H,), (emb,))
        self.w_gate = p(normal, (H, F), (emb, ax.MLP))
        self.w_up = p(normal, (H, F), (emb, ax.MLP))
        self.w_down = p(normal, (F, H), (ax.MLP, emb))

    def arrays(self) -> dict[str, jax.Array]:
        return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}


class Transformer(nnx.Module):
    """Decoder-only LM (Qwen3 / Qwen2.5 / Llama-3).

    Args:
      config: the :class:`ModelConfig`.
      dtype: compute dtype (activations, matmul inputs); softmax and RMSNorm statistics are
        float32, or the compute dtype if it is wider (float64 under x64, for numerics checks).
      param_dtype: storage dtype of the parameters.
      rngs: RNG streams for the random initialisation.

    Examples:
      >>> model = Transformer(ModelConfig.tiny("qwen3"))
      >>> out = model(jnp.ones((2, 5), jnp.int32))
      >>> out.logits.shape, out.hidden.shape
      ((2, 5, 256), (2, 5, 64))
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
    ):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.config = config
        self.dtype = dtype
        self.param_dtype = param_dtype
        V, H = config.vocab_size, config.hidden_size
        self.embed = _param(
            rngs, nnx.initializers.normal(0.02), (V, H), (ax.VOCAB, ax.EMBED), param_dtype
        )
        self.blocks = _Blocks(config, param_dtype, rngs)
        self.final_norm = _param(rngs, nnx.initializers.ones, (H,), (ax.EMBED,), param_dtype)
        if not config.tie_word_embeddings:
            self.lm_head = _param(
                rngs, nnx.initializers.normal(0.02), (H, V), (ax.EMBED, ax.VOCAB), param_dtype
            )

    def init_cache(self, batch_size: int, max_length: int, dtype=None) -> KVCache:
        """An empty cache of ``max_length`` slots per row (``dtype`` defaults to compute dtype)."""
        c = self.config
        k_shape = (batch_size, c.num_kv_heads, c.head_dim, max_length)
        v_shape = (batch_size, c.num_kv_heads, max_length, c.head_dim)
        dtype = self.dtype if dtype is None else dtype
        return KVCache(
            k=tuple(jnp.zeros(k_shape, dtype) for _ in range(c.num_layers)),
            v=tuple(jnp.zeros(v_shape, dtype) for _ in range(c.num_layers)),
            mask=jnp.zeros((batch_size, max_length), bool),
            index=jnp.zeros((), jnp.int32),
        )

    def layer_params(self) -> list[dict[str, jax.Array]]:
        """Each decoder layer's parameters as separate arrays (slices of the stacked ones).

        For a decode loop on CPU: sliced once before the loop and passed as ``layers``, they are
        not re-sliced (copied) at every step, which XLA:CPU does not reliably hoist by itself.

        The layer index is one the compiler cannot fold (an optimisation barrier over
        ``arange(L)``): every unrolled layer then reads its weights through the same
        dynamic-slice, so its fusions are the same computation in every layer and the TPU
        compiler's code generation compiles them once (it deduplicates identical fusions).
        With constant indices each layer's matmul fusions differ by their slice offset and are
        each generated anew: the rollout engine's TPU compile then grows with ``L`` (Qwen3-8B's
        prefill chunk on v5p-64, compile-only: 227 s with constant indices, 60 s without).
        """
        params = self.blocks.arrays()
        index = jax.lax.optimization_barrier(jnp.arange(self.config.num_layers, dtype=jnp.int32))
        return [
            jax.tree.map(lambda a, i=i: jax.lax.dynamic_index_in_dim(a, index[i], 0, False), params)
            for i in range(self.config.num_layers)
        ]

    def __call__(
        self,
        input_ids: Int[Array, "B T"],
        *,
        attention_mask: Bool[Array, "B T"] | Int[Array, "B T"] | None = None,
        positions: Int[Array, "B T"] | None = None,
        segment_ids: Int[Array, "B T"] | None = None,
        parent_ids: Int[Array, "B T"] | None = None,
        cache: KVCache | None = None,
        return_logits: bool = True,
        layers: Sequence[dict[str, jax.Array]] | None = None,
    ) -> ModelOutput:
        """Runs the decoder.

        Without a cache, token t attends to tokens s <= t with ``attention_mask[s]`` true. With a
        cache, the T tokens are written to slots ``[index, index + T)`` and token t attends to
        slots s <= index + t whose ``cache.mask`` is true. Positions default to the number of
        real tokens before each token (``max(cumsum(mask) - 1, 0)``, counting cached ones), which
        is right for left-padded prompts and right-padded responses.

        Packed rows: ``segment_ids`` numbers the sequences sharing a row (1, 2, ...; 0 marks
        padding). Token t then attends to tokens s <= t of its own segment only, positions
        default to the index within the segment, and ``attention_mask`` defaults to
        ``segment_ids > 0``. Shared prompts: ``parent_ids`` names, for each token, the segment
        of the prompt it continues (itself where none), which it sees too
        (:mod:`delta_jax.models.attention`); its ``positions`` are then given.

        Args:
          input_ids: int[B, T] token ids.
          attention_mask: [B, T] bool or int, 1 for real tokens (default: all real).
          positions: int[B, T] RoPE positions (default: see above).
          segment_ids: int[B, T] sequence number of each token in a packed row, 0 = padding
            (without a cache only).
          parent_ids: int[B, T] segment of the shared prompt each token continues, with
            ``segment_ids`` and ``positions``.
          cache: optional :class:`KVCache` with at least ``index + T`` slots.
          return_logits: False skips the LM head (``logits`` is None).
          layers: optional per-layer parameters from :meth:`layer_params` (computed once outside
            a decode loop); None slices the stacked parameters here.

        Returns:
          :class:`ModelOutput` (logits [B, T, V], hidden [B, T, H], cache).
        """
        cfg = self.config
        mask, positions = _check_inputs(
            input_ids, attention_mask, positions, segment_ids, parent_ids, cache
        )
        B, T = input_ids.shape
        if cache is None:
            # Padding (mask 0) becomes segment 0, a segment of its own (see models.attention).
            segments = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids
            segments = jnp.where(mask, segments, 0).astype(jnp.int32)
            parents = None if parent_ids is None else jnp.where(mask, parent_ids, 0)

            def attend(q, k, v, state):
                impl, block = cfg.attention, cfg.attention_block
                out = attention(
                    q, k, v, segments, parent_ids=parents, impl=impl, block=block, name=_ATTENTION
                )
                return checkpoint_name(out, _ATTENTION), state

            states = None
        else:
            # Start indices must share a dtype: a literal 0 is int64 under x64, the index int32.
            zero = jnp.zeros_like(cache.index)
            slot_mask = jax.lax.dynamic_update_slice(cache.mask, mask, (zero, cache.index))
            S = slot_mask.shape[1]
            causal = jnp.arange(S)[None, :] <= (cache.index + jnp.arange(T))[:, None]
            visible = causal[None] & slot_mask[:, None, :]  # bool[B, T, S] over cache slots

            def attend(q, k, v, kv):
                return _cached_attention(q, k, v, kv, visible, cache.index)

            states = list(zip(cache.k, cache.v, strict=True))
        hidden, states = self.forward_with(input_ids, positions, attend, states, layers)
        logits = None
        if return_logits:
            logits = jnp.einsum("BTH,HV->BTV", hidden, lm_head_weight(self).astype(self.dtype))
            logits = ax.constrain(logits, (ax.BATCH, ax.LENGTH, ax.VOCAB))
        new_cache = None
        if cache is not None:
            k, v = zip(*states, strict=True)
            new_cache = KVCache(k=k, v=v, mask=slot_mask, index=cache.index + T)
        return ModelOutput(logits=logits, hidden=hidden, cache=new_cache)

    def forward_with(
        self,
        input_ids: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        attend: Attend,
        states: Sequence[Any] | None = None,
        layers: Sequence[dict[str, jax.Array]] | None = None,
    ) -> tuple[Float[Array, "B T H"], list[Any] | None]:
        """The decoder with the caller's attention step: embedding, the L blocks, final norm.

        Every caller runs the same blocks (:func:`decoder_block`): the full forward (attention
        within segments), the cached decode (a KV cache per layer) and the paged engine (K/V in
        pages, :mod:`delta_jax.sampling.attention.paged`); only ``attend`` differs.

        Args:
          input_ids: int[B, T] token ids.
          positions: int[B, T] RoPE positions.
          attend: the attention step, ``attend(q, k, v, state) -> (heads, state)``.
          states: one attention state per layer (layer ``i``'s step gets ``states[i]``), or
            None (no state: then the blocks may run as a scan, see ``config.scan_layers``).
          layers: optional per-layer parameters from :meth:`layer_params`.

        Returns:
          The final RMS-normed hidden state [B, T, H] and the layers' new states (None when
          ``states`` is None).
        """
        cfg, dtype = self.config, self.dtype
        x = jnp.take(self.embed[...], input_ids, axis=0).astype(dtype)
        x = ax.constrain(x, (ax.BATCH, ax.LENGTH, ax.EMBED))
        cos, sin = _rope_tables(cfg, positions, dtype)

        def block(x, p, state):
            # A step with a state (a KV cache, pages) is a decode path.
            flat = states is not None
            return decoder_block(cfg, dtype, p, x, cos, sin, attend, state, flat_heads=flat)

        block = _remat(block, cfg.remat)
        params = self.blocks.arrays()
        if states is None and cfg.scan_layers and layers is None:
            x, _ = jax.lax.scan(lambda x, p: (block(x, p, None)[0], None), x, params)
            new = None
        else:
            new = []
            for layer in range(cfg.num_layers):
                p = layers[layer] if layers else jax.tree.map(lambda a, i=layer: a[i], params)
                x, state = block(x, p, None if states is None else states[layer])
                new.append(state)
            new = None if states is None else new
        hidden = _rms_norm(x, self.final_norm[...], cfg.rms_norm_eps, dtype)
        return ax.constrain(hidden, (ax.BATCH, ax.LENGTH, ax.EMBED)), new


def _check_inputs(input_ids, attention_mask, positions, segment_ids, parent_ids, cache):
    """The forward pass's inputs checked, and its mask and positions (see ``__call__``)."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {input_ids.shape}")
    B, T = input_ids.shape
    if parent_ids is not None and (segment_ids is None or positions is None):
        raise ValueError("parent_ids (shared prompts) need segment_ids and positions")
    if parent_ids is not None and parent_ids.shape != (B, T):
        raise ValueError(f"parent_ids shape {parent_ids.shape} != input_ids shape {(B, T)}")
    if segment_ids is not None:
        if cache is not None:
            raise ValueError("segment_ids (packed rows) cannot be combined with a KV cache")
        if segment_ids.shape != (B, T):
            raise ValueError(f"segment_ids shape {segment_ids.shape} != input_ids shape {(B, T)}")
        if attention_mask is None:
            attention_mask = segment_ids > 0
        if positions is None:
            positions = segment_positions(segment_ids)
    if attention_mask is None:
        attention_mask = jnp.ones((B, T), bool)
    if attention_mask.shape != (B, T):
        raise ValueError(f"attention_mask shape {attention_mask.shape} != input_ids shape {(B, T)}")
    mask = attention_mask.astype(bool)
    if positions is None:
        before = (
            0
            if cache is None
            else jnp.sum(
                cache.mask & (jnp.arange(cache.mask.shape[1]) < cache.index), -1, keepdims=True
            )
        )
        positions = jnp.maximum(before + jnp.cumsum(mask, -1) - 1, 0)
    elif positions.shape != (B, T):
        raise ValueError(f"positions shape {positions.shape} != input_ids shape {(B, T)}")
    if cache is not None and cache.mask.shape[0] != B:
        raise ValueError(f"cache batch {cache.mask.shape[0]} != input_ids batch {B}")
    return mask, positions


def segment_positions(segment_ids: Int[Array, "B T"]) -> Int[Array, "B T"]:
    """Index of each token within its segment of a packed row (padding, id 0, gets 0).

    Segments are contiguous runs of one id: the position restarts wherever the id changes.
    """
    T = segment_ids.shape[1]
    idx = jnp.arange(T, dtype=jnp.int32)[None, :]
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1
    )
    start_of = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    return jnp.where(segment_ids > 0, idx - start_of, 0)


def lm_head_weight(model: Transformer) -> Float[Array, "H V"]:
    """The LM head as [H, V] (the embedding transposed when embeddings are tied)."""
    if model.config.tie_word_embeddings:
        return model.embed[...].T
    return model.lm_head[...]


def _rms_norm(x, weight, eps, dtype):
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


def _rope_tables(cfg, positions, dtype):
    acc_dtype = accumulation_dtype(dtype)
    inv = jnp.asarray(rope_inv_freq(cfg), acc_dtype)
    angles = positions.astype(acc_dtype)[..., None] * inv  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def _rope(x, cos, sin):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def _remat(block, policy: str):
    """Wraps a decoder block in ``jax.checkpoint`` as ``model.remat`` says (see ModelConfig)."""
    if policy == "block":
        policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        return jax.checkpoint(block, policy=policy)
    if policy == "matmuls":
        names = jax.checkpoint_policies.save_only_these_names(_MATMUL, _ATTENTION)
        return jax.checkpoint(block, policy=names)
    if policy == "full":
        return jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable)
    return block


# Names of the values remat="matmuls" keeps: weight-matmul outputs and attention outputs.
_MATMUL, _ATTENTION = "matmul", "attention"


def _matmul(spec: str, x, w: dict[str, jax.Array], weight: str, lora_scale: float):
    """``einsum(spec, x, w[weight])`` (plus its LoRA adapters, if any), named for remat."""
    return checkpoint_name(lora.project(spec, x, w, weight, lora_scale), _MATMUL)


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
    h = _rms_norm(x, w["attn_norm"], eps, dtype)
    q = _matmul("BTH,HND->BTND", h, w, "wq", s)
    k = _matmul("BTH,HKD->BTKD", h, w, "wk", s)
    v = _matmul("BTH,HKD->BTKD", h, w, "wv", s)
    if cfg.qkv_bias:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    if cfg.qk_norm:
        q = _rms_norm(q, w["q_norm"], eps, dtype)
        k = _rms_norm(k, w["k_norm"], eps, dtype)
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
    h = _rms_norm(x, w["mlp_norm"], eps, dtype)
    gate = _matmul("BTH,HF->BTF", h, w, "w_gate", s)
    up = _matmul("BTH,HF->BTF", h, w, "w_up", s)
    act = ax.constrain(jax.nn.silu(gate) * up, (ax.BATCH, ax.LENGTH, ax.MLP))
    x = x + _matmul("BTF,FH->BTH", act, w, "w_down", s)
    return ax.constrain(x, (ax.BATCH, ax.LENGTH, ax.EMBED)), state


def _cached_attention(q, k, v, kv, visible, index):
    """The cached decode's attention step: writes K/V at slot ``index`` into this layer's
    cache, attends over it.

    Its layout serves XLA:CPU, which runs the sampler's decode loop on CPU: keys are cached
    transposed (see :class:`KVCache`) and the two dots are canonical batched matmuls with the
    query rows merged (:func:`~delta_jax.models.attention.slot_attention`).

    Args:
      q: [B, T, N, D]; k, v: [B, T, K, D], the new tokens' keys and values.
      kv: this layer's cache ([B, K, D, S], [B, K, S, D]).
      visible: bool[B, T, S], slot s visible to query t.
      index: the first slot to write.

    Returns:
      (attention output [B, T, N, D]; the updated cache).
    """
    # Write first, then attend over the updated cache: the attention dots then read the
    # DUS result in place (attending to the old cache and the new K/V apart leaves the read
    # and the in-place write unordered, and XLA copies the whole cache every step).
    ck, cv = kv
    k = jnp.transpose(k, (0, 2, 3, 1))  # [B, K, D, T], the cache's key layout
    v = jnp.swapaxes(v, 1, 2)  # [B, K, T, D]
    zero = jnp.zeros_like(index)  # one index dtype (a literal 0 is int64 under x64)
    ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (zero, zero, zero, index))
    cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (zero, zero, index, zero))
    return slot_attention(q, ck.astype(q.dtype), cv.astype(q.dtype), visible), (ck, cv)
