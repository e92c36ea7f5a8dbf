"""Decoder-only transformer for the Qwen3, Qwen2.5 and Llama-3 families (Flax NNX).

Pre-norm blocks ``x += Attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x))`` with grouped-query attention,
rotate-half RoPE (optionally llama3/linear frequency scaling), Qwen3's per-head q/k RMSNorm and
Qwen2's q/k/v bias, all selected by :class:`ModelConfig` flags. The numerics follow the
``transformers`` implementations (RMSNorm in float32 then cast, softmax in float32) so that
imported checkpoints give the same logits. Attention without a cache (training, scoring) is
``config.attention``'s implementation from :mod:`delta_jax.models.attention` (dense, chunked,
Pallas splash on TPU, cuDNN on GPU); with a KV cache (sampling) it is the decode path, laid out
for XLA:CPU.

The block exists once (:func:`~delta_jax.models.layers.decoder_block`, with RMSNorm and RoPE in
:mod:`delta_jax.models.layers`), with the attention step passed in: the full forward, the cached
decode and the paged rollout engine (:mod:`delta_jax.sampling.attention.paged`) all run it through
:meth:`Transformer.forward_with`.

The L decoder blocks are stored stacked (every block parameter has a leading ``layers`` axis);
``config.scan_layers`` chooses ``lax.scan`` over that axis or an unrolled loop, so both variants
share one parameter layout (and one checkpoint format). Calls with a KV cache (inference) always
unroll: every layer's cache is then its own buffer, updated in place and read by the attention
dots directly, with no per-step slice or relayout copy of the cache. The forward pass is a pure
function of the parameters: ``nnx.split(model, nnx.Param)`` / ``nnx.merge`` inside ``jax.jit``
works.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Bool, Float, Int

from delta_jax.models import axes as ax
from delta_jax.models.attention import attention, slot_attention
from delta_jax.models.config import ModelConfig
from delta_jax.models.layers import (
    ATTENTION_NAME,
    Attend,
    decoder_block,
    remat,
    rms_norm,
    rope_inv_freq,
    rope_tables,
)

# The layer maths once defined here (Attend, decoder_block, rope_inv_freq) stay importable here.
__all__ = [
    "KEY_CACHE_AXES",
    "VALUE_CACHE_AXES",
    "Attend",
    "KVCache",
    "ModelOutput",
    "Transformer",
    "decoder_block",
    "lm_head_weight",
    "rope_inv_freq",
    "segment_positions",
]

# Logical axes of each layer's cached keys and values (the layout :class:`KVCache` describes).
KEY_CACHE_AXES = (ax.BATCH, ax.KV_HEADS, ax.HEAD_DIM, ax.CACHE_LENGTH)
VALUE_CACHE_AXES = (ax.BATCH, ax.KV_HEADS, ax.CACHE_LENGTH, ax.HEAD_DIM)


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
                impl, block, name = cfg.attention, cfg.attention_block, ATTENTION_NAME
                out = attention(
                    q, k, v, segments, parent_ids=parents, impl=impl, block=block, name=name
                )
                return checkpoint_name(out, name), state

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
        cos, sin = rope_tables(cfg, positions, dtype)

        def block(x, p, state):
            # A step with a state (a KV cache, pages) is a decode path.
            flat = states is not None
            return decoder_block(cfg, dtype, p, x, cos, sin, attend, state, flat_heads=flat)

        block = remat(block, cfg.remat)
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
        hidden = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps, dtype)
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
