"""The static sampler's program: one jitted prefill plus a ``lax.while_loop`` decode over a
batch of rows in a contiguous KV cache (:class:`~delta_jax.models.KVCache`), until the longest
row ends (see :mod:`delta_jax.sampling.sampler`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jaxtyping import Array, Bool, Float, Int

from delta_jax.models import KVCache, Transformer, lm_head_weight
from delta_jax.models.attention import accumulation_dtype
from delta_jax.models.axes import constrain
from delta_jax.models.transformer import KEY_CACHE_AXES, VALUE_CACHE_AXES
from delta_jax.sampling.strategies import Categorical, Greedy

__all__ = ["StaticOptions", "static_program"]


@struct.dataclass
class _LoopState:
    """Decode-loop carry; ``step`` is the number of generated columns written so far."""

    step: Int[Array, ""]
    cache: KVCache
    last: Int[Array, " R"]
    tokens: Int[Array, "R G"]
    logprobs: Float[Array, "R G"]
    untruncated: Float[Array, "R G"]
    hidden: Float[Array, "R G H"] | None
    lengths: Int[Array, " R"]
    done: Bool[Array, " R"]


def _write(buf: jax.Array, column: jax.Array, step: Int[Array, ""]) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(buf, column[:, None].astype(buf.dtype), step, 1)


@dataclasses.dataclass(frozen=True)
class StaticOptions:
    """What the static program is built with besides its arguments (one program per value).

    Attributes:
      graphdef: the model's graph (``nnx.split(model, nnx.Param, ...)``).
      n: samples per prompt.
      gen_len: the generation bucket (decode steps at most).
      cache_dtype: the KV cache's dtype.
      return_hidden: also return each token's final hidden state.
      pad_id: the id of the positions after a row's end.
      hoist_layers: slice each layer's weights once per call (on CPU:
        ``dense_cpu.slices_layers_once``), not at every step.
    """

    graphdef: nnx.GraphDef
    n: int
    gen_len: int
    cache_dtype: Any
    return_hidden: bool
    pad_id: int
    hoist_layers: bool


def static_program(
    params: nnx.State,
    rest: nnx.State,
    prompt_ids: Int[Array, "Bp P"],
    prompt_mask: Bool[Array, "Bp P"],
    max_new: Int[Array, " R"],
    stop_ids: Int[Array, "R S"],
    seed: Int[Array, ""],
    strategy: Greedy | Categorical,
    *,
    options: StaticOptions,
) -> dict[str, jax.Array]:
    """Prefill + decode for one bucket; every shape argument is static through the key."""
    n, gen_len, pad_id = options.n, options.gen_len, options.pad_id
    return_hidden, cache_dtype = options.return_hidden, options.cache_dtype
    model: Transformer = nnx.merge(options.graphdef, params, rest)
    rows = prompt_ids.shape[0] * n
    key = jax.random.key(seed)
    # On CPU, per-layer weights sliced once here (``dense_cpu.slices_layers_once``).
    layers = model.layer_params() if options.hoist_layers else None

    cache, pre_hidden, prompt_lengths = _prefill(
        model, prompt_ids, prompt_mask, n, gen_len, cache_dtype, layers
    )
    h0 = _repeat(pre_hidden[:, -1], n)  # left padding: the last column is the last real token
    # Logits and log-probs in float32, or float64 for a float64 model (x64 numerics checks).
    acc = accumulation_dtype(pre_hidden.dtype)
    advance = _advance_fn(model, pre_hidden.dtype, strategy, key, stop_ids, max_new, pad_id)

    def body(s: _LoopState) -> _LoopState:
        positions = (prompt_lengths + s.step - 1)[:, None]
        out = model(
            s.last[:, None],
            attention_mask=jnp.ones((rows, 1), bool),
            positions=positions,
            cache=s.cache,
            return_logits=False,
            layers=layers,
        )
        return advance(s.replace(cache=out.cache), out.hidden[:, 0])

    def cond(s: _LoopState) -> jax.Array:
        return (s.step < gen_len) & ~jnp.all(s.done)

    hidden_dtype = pre_hidden.dtype
    state = _LoopState(
        step=jnp.zeros((), jnp.int32),
        cache=cache,
        last=jnp.zeros((rows,), jnp.int32),
        tokens=jnp.full((rows, gen_len), pad_id, jnp.int32),
        logprobs=jnp.zeros((rows, gen_len), acc),
        untruncated=jnp.zeros((rows, gen_len), acc),
        hidden=(jnp.zeros((rows, gen_len, h0.shape[-1]), hidden_dtype) if return_hidden else None),
        lengths=jnp.zeros((rows,), jnp.int32),
        done=max_new <= 0,  # padding rows
    )
    state = jax.lax.while_loop(cond, body, advance(state, h0))
    return dict(
        tokens=state.tokens,
        logprobs=state.logprobs,
        untruncated=state.untruncated,
        lengths=state.lengths,
        hidden=state.hidden,
        steps=state.step,
        prompt_ids=_repeat(prompt_ids, n),
        prompt_mask=_repeat(prompt_mask, n),
    )


def _repeat(x: jax.Array, n: int) -> jax.Array:
    """Each prompt's row ``n`` times (prompt-major)."""
    return x if n == 1 else jnp.repeat(x, n, axis=0)


def _prefill(
    model: Transformer, prompt_ids, prompt_mask, n: int, gen_len: int, cache_dtype, layers
):
    """The prompts through the model once into a ``P``-slot cache, then the cache repeated
    ``n`` times into ``P + G`` slots (``>= P`` empty) in the cache dtype.

    Returns:
      The decode cache, the prompts' hidden states [Bp, P, H] and every row's prompt length.
    """
    num_prompts, prompt_len = prompt_ids.shape
    pre = model(
        prompt_ids,
        attention_mask=prompt_mask,
        cache=model.init_cache(num_prompts, prompt_len, cache_dtype),
        return_logits=False,
        layers=layers,
    )

    def grow(prefilled: jax.Array, names: tuple[str, ...]) -> jax.Array:
        """Prompt K or V of ``Bp`` rows and P slots -> ``R`` rows and P + G slots (>= P empty)."""
        slots = [(0, 0)] * prefilled.ndim
        slots[names.index("cache_length")] = (0, gen_len)
        return constrain(jnp.pad(_repeat(prefilled, n), slots), names)

    cache = pre.cache.replace(
        k=tuple(grow(k, KEY_CACHE_AXES) for k in pre.cache.k),
        v=tuple(grow(v, VALUE_CACHE_AXES) for v in pre.cache.v),
        mask=jnp.pad(_repeat(prompt_mask, n), ((0, 0), (0, gen_len))),
    )
    prompt_lengths = jnp.sum(_repeat(prompt_mask, n), axis=-1, dtype=jnp.int32)
    return cache, pre.hidden, prompt_lengths


def _advance_fn(model: Transformer, dtype, strategy, key, stop_ids, max_new, pad_id: int):
    """``advance(state, h [R, H])``: every live row's next token drawn from its hidden state,
    written into the buffers with its log-probs (and ``h``); a row is done after a stop id or
    its own ``max_new``."""
    # Cast once, outside the loop (per step it would re-read and re-write the whole head). A tied
    # head is used as the [V, H] embedding: transposing it would copy it at every call.
    tied = model.config.tie_word_embeddings
    head = (model.embed[...] if tied else lm_head_weight(model)).astype(dtype)
    head_spec = "RH,VH->RV" if tied else "RH,HV->RV"
    # Logits and log-probs in float32, or float64 for a float64 model (x64 numerics checks).
    acc = accumulation_dtype(dtype)

    def advance(s: _LoopState, h: Float[Array, "R H"]) -> _LoopState:
        logits = jnp.einsum(head_spec, h, head, preferred_element_type=acc)
        out = strategy(logits, jax.random.fold_in(key, s.step))
        live = ~s.done
        token = jnp.where(live, out.token, pad_id)
        lengths = s.lengths + live
        stopped = jnp.any(token[:, None] == stop_ids, axis=-1) | (lengths >= max_new)
        hidden = s.hidden
        if hidden is not None:
            hidden = _write(hidden, jnp.where(live[:, None], h, 0), s.step)
        return s.replace(
            step=s.step + 1,
            last=token,
            tokens=_write(s.tokens, token, s.step),
            logprobs=_write(s.logprobs, jnp.where(live, out.logprob, 0.0), s.step),
            untruncated=_write(
                s.untruncated, jnp.where(live, out.untruncated_logprob, 0.0), s.step
            ),
            hidden=hidden,
            lengths=lengths,
            done=s.done | (live & stopped),
        )

    return advance
