"""The continuous engine's device programs' parts as pure functions of the parameters, the page
pool and the output buffers: the slots' state and how a step advances it, the token draw, the
prefill chunk and the observation write (the decode chunk, on them:
:mod:`~delta_jax.sampling.engine.chunk`).
:class:`~delta_jax.sampling.engine.programs.EnginePrograms` compiles them and owns their state.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from delta_jax.models import Transformer, lm_head_weight
from delta_jax.models import axes as ax
from delta_jax.models.attention import accumulation_dtype
from delta_jax.sampling.attention.backends import PagedBackend
from delta_jax.sampling.attention.paged import (
    Groups,
    PageList,
    PagePool,
    Tokens,
    paged_forward,
    write_rows,
)
from delta_jax.sampling.engine.requests import SLOT_FIELDS, EngineSpec
from delta_jax.sampling.strategies import Categorical, Greedy

__all__ = [
    "DecodeOptions",
    "RequestInputs",
    "SlotState",
    "Weights",
    "advance",
    "init_outputs",
    "prefill_chunk",
    "token_sampler",
    "unpack_slots",
    "write_tokens",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """Per-slot decode state, passed in and returned by every decode chunk.

    Attributes:
      last: token each slot feeds next.
      pos: position ``last`` is written at.
      count: tokens generated so far (the index of the next token's RNG stream).
      active: slot holds a sequence that has not ended.
      max_new: the sequence's token budget.
      seed: the int32 bits of the sequence's uint32 seed (RNG stream: the request's, or a
        carried row's from the call that started it).
      prompt: prompt index of the sequence (RNG stream).
      sample: sample index of the sequence (RNG stream).
      row: the sequence's row of the output buffers (group-local; out of range for an idle
        slot, whose writes are dropped).
      stops: stop ids of the sequence, padded with -1.
      recent: multi-turn stop sequences: the last ``L`` ids the sequence drew in its current
        turn, oldest first (-1: none yet); ``L`` is the longest stop sequence, 0 without any.
      page_table: the sequence's pages from position 0 on (0 = scratch), for the ``pallas``
        and ``dense`` paths (one column otherwise).
      pages: every live sequence's pages as one flat list, for the ``xla`` path (one padding
        entry otherwise).
      copy_src: page to copy into ``copy_dst`` before decoding (the prompt's partial last page
        when the sequence joined this chunk; else the scratch page onto itself).
      copy_dst: see ``copy_src``.
    """

    last: Int[Array, " S"]
    pos: Int[Array, " S"]
    count: Int[Array, " S"]
    active: Bool[Array, " S"]
    max_new: Int[Array, " S"]
    seed: Int[Array, " S"]
    prompt: Int[Array, " S"]
    sample: Int[Array, " S"]
    row: Int[Array, " S"]
    stops: Int[Array, "S W"]
    recent: Int[Array, "S L"]
    page_table: Int[Array, "S NB"]
    pages: PageList
    copy_src: Int[Array, " S"]
    copy_dst: Int[Array, " S"]


def _row_keys(seed, prompt, sample, count):
    def one(bits, p, s, t):
        key = jax.random.key(jax.lax.bitcast_convert_type(bits, jnp.uint32))
        return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, p), s), t)

    return jax.vmap(one)(seed, prompt, sample, count)


# Per-slot integer fields of SlotState, packed with the stop ids, the stop-sequence window and


def unpack_slots(
    packed: Int[Array, "S F"], pages: Int[Array, "U 3"], stop_width: int, window: int = 0
):
    """The :class:`SlotState` of a packed ``[S, fields + stops + window + table]`` matrix and a
    ``[U, 3]`` (page, seq, index) page list."""
    cols = {name: packed[:, i] for i, name in enumerate(SLOT_FIELDS)}
    cols["active"] = cols["active"] > 0
    F, W = len(SLOT_FIELDS), stop_width
    return SlotState(
        **cols,
        stops=packed[:, F : F + W],
        recent=packed[:, F + W : F + W + window],
        page_table=packed[:, F + W + window :],
        pages=PageList(page=pages[:, 0], seq=pages[:, 1], index=pages[:, 2]),
    )


class Weights(NamedTuple):
    """What a program samples with: the model's parameters and the rest of its state
    (``nnx.split(model, nnx.Param, ...)``), and on CPU each layer's weights sliced once per
    request (:class:`~delta_jax.sampling.engine.programs.EnginePrograms`) instead of at every
    step, which XLA:CPU does not reliably hoist out of the loop; ``layers`` None (accelerators)
    slices them inside the loop, where the slices fuse into the matmuls (a copy would hold every
    weight twice)."""

    params: nnx.State
    rest: nnx.State
    layers: list[dict[str, Array]] | None = None


class RequestInputs(NamedTuple):
    """What every decode chunk of one request reads: the sampling strategy (each slot's seed is
    its own, :class:`SlotState`), whether a sequence that stops may continue later from its
    pages (``resumable``: a multi-turn request, a turn's end), a multi-turn request's stop
    sequences (see
    :func:`~delta_jax.sampling.engine.chunk.decode_chunk`; None for single-turn requests), and
    ``refill``, set per chunk: the chunk ends early once that many of the rows live at its start
    have ended, so that sequences waiting for a slot join (0: never)."""

    strategy: Greedy | Categorical
    resumable: Bool[Array, ""]
    stop_sequences: Int[Array, "Q L"] | None = None
    refill: Int[Array, ""] = np.int32(0)


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """What a decode program is built with besides its arguments, fixed per engine call: the
    model's graph, the attention ``backend`` (with the engine's mesh), the stop ids per
    sequence, and the call's static configuration (:meth:`of` an
    :class:`~delta_jax.sampling.engine.requests.EngineSpec`: the engine and the planner build the
    same program from it)."""

    graphdef: nnx.GraphDef
    backend: PagedBackend
    stop_width: int
    return_hidden: bool = False
    pad_id: int = 0
    draft_tokens: int = 0
    draft_depth: int = 0
    emitted_width: int = 0

    @classmethod
    def of(
        cls, spec: EngineSpec, graphdef: nnx.GraphDef, backend: PagedBackend, stop_width: int
    ) -> DecodeOptions:
        """The options of the engine call ``spec``."""
        return cls(
            graphdef,
            backend,
            stop_width,
            return_hidden=spec.return_hidden,
            pad_id=spec.pad_id,
            draft_tokens=spec.draft_tokens,
            draft_depth=spec.draft_depth,
            emitted_width=spec.steps * (spec.draft_tokens + 1),
        )


def token_sampler(model: Transformer, strategy, return_hidden: bool, pad_id: int):
    """``draw(h [S, H], slots)``: every slot's next token drawn from its hidden state (``pad_id``
    for idle slots), with its log-probs (and the hidden state), each slot with its sequence's
    RNG stream at its token index: ``fold_in(fold_in(fold_in(key(seed), prompt), sample), t)``
    (its seed, prompt and sample fields)."""
    tied = model.config.tie_word_embeddings
    head = (model.embed[...] if tied else lm_head_weight(model)).astype(model.dtype)
    head_spec = "SH,VH->SV" if tied else "SH,HV->SV"
    acc = accumulation_dtype(model.dtype)  # float32; float64 for a float64 model (x64 checks)

    def draw(h, s: SlotState) -> dict[str, Array]:
        logits = jnp.einsum(head_spec, h, head, preferred_element_type=acc)
        keys = _row_keys(s.seed, s.prompt, s.sample, s.count)
        res = jax.vmap(lambda row, k: strategy(row[None], k))(logits, keys)
        cols = dict(
            tokens=jnp.where(s.active, res.token[:, 0], pad_id),
            logprobs=res.logprob[:, 0],
            untruncated=res.untruncated_logprob[:, 0],
        )
        if return_hidden:
            cols["hidden"] = h
        return cols

    return draw


def advance(s: SlotState, token, stop_sequences) -> SlotState:
    """The slots after a step that drew ``token``: live ones count it and feed it next; a slot
    stops at one of its stop ids, at its budget, or (multi-turn) where its turn's ids end with
    a stop sequence."""
    live = s.active
    count = s.count + live
    stopped = jnp.any(token[:, None] == s.stops, axis=-1) | (count >= s.max_new)
    recent = s.recent
    if stop_sequences is not None:
        shifted = jnp.concatenate([recent[:, 1:], token[:, None]], axis=1)
        recent = jnp.where(live[:, None], shifted, recent)
        ends = (stop_sequences < 0) | (recent[:, None, :] == stop_sequences)  # [S, Q, L]
        stopped |= jnp.any(jnp.all(ends, axis=-1), axis=-1)
    return dataclasses.replace(
        s,
        recent=recent,
        last=jnp.where(live, token, s.last),
        pos=s.pos + live,
        count=count,
        active=live & ~stopped,
    )


def init_outputs(
    rows: int, gen_len: int, hidden: int | None, dtype, pad_id: int, drafted: bool = False
):
    """The output buffers of one request (call inside ``jit``: created sharded by rows);
    ``drafted`` (speculative requests): each token's draft outcome
    (:data:`~delta_jax.sampling.speculation.speculate.DRAFT_OUTCOMES`)."""
    names = (ax.BATCH, None)
    out = dict(
        tokens=ax.constrain(jnp.full((rows, gen_len), pad_id, jnp.int32), names),
        # float32; float64 for a float64 model (x64 numerics checks)
        logprobs=ax.constrain(jnp.zeros((rows, gen_len), accumulation_dtype(dtype)), names),
        untruncated=ax.constrain(jnp.zeros((rows, gen_len), accumulation_dtype(dtype)), names),
    )
    if hidden is not None:
        out["hidden"] = ax.constrain(jnp.zeros((rows, gen_len, hidden), dtype), (*names, None))
    if drafted:
        out["drafted"] = ax.constrain(jnp.zeros((rows, gen_len), jnp.int8), names)
    return out


def write_tokens(
    out: dict[str, Array],
    rows: Int[Array, " S"],
    cols: Int[Array, " S"],
    ids: Int[Array, "S T"],
    valid: Bool[Array, "S T"],
    logprobs: Float[Array, "S T"],
    untruncated: Float[Array, "S T"],
    *,
    groups: Groups,
) -> dict[str, Array]:
    """Writes ``ids[s]`` with their log-probs into output row ``rows[s]`` (-1: none) from
    column ``cols[s]`` on: observations (log-probs zero: they were not sampled), or a carried
    row's tokens drawn by an earlier call (partial rollouts). Hidden states and draft outcomes
    are zero."""
    S, T = ids.shape
    dropped = out["tokens"].shape[0]  # out of range: the write is dropped
    at = jnp.where(valid & (rows[:, None] >= 0), rows[:, None], dropped).reshape(-1)
    col = (cols[:, None] + jnp.arange(T)).reshape(-1)
    values = {name: jnp.zeros((S * T, *buf.shape[2:]), buf.dtype) for name, buf in out.items()}
    values["tokens"] = ids.reshape(-1)
    values["logprobs"] = logprobs.reshape(-1)
    values["untruncated"] = untruncated.reshape(-1)
    return write_rows(out, at, col, values, groups)


def prefill_chunk(
    weights: Weights,
    pool: PagePool,
    tokens: Tokens,
    pages: PageList | Int[Array, "B NB"],
    *,
    graphdef: nnx.GraphDef,
    backend: PagedBackend,
) -> PagePool:
    """Writes the K/V of a chunk of prompt ``tokens`` into the prompts' pages (no LM head).

    ``pages``: the rows' pages as ``backend.prefill_attention`` reads them: a flat list
    (:func:`~delta_jax.sampling.attention.paged.xla_attention`), or page tables from position 0 (the
    CPU path's :func:`~delta_jax.sampling.attention.dense_cpu.dense_attention`: each row's pages
    gathered once per layer and attended to in one batched attention, where the list's block loop
    runs as many small steps); ``weights.layers``: the per-layer weights sliced once per request
    (CPU), or None.
    """
    model: Transformer = nnx.merge(graphdef, weights.params, weights.rest)
    layers = model.layer_params() if weights.layers is None else weights.layers
    attend, groups = backend.prefill_attention, backend.groups
    _, pool = paged_forward(model, layers, tokens, pool, pages, attend=attend, groups=groups)
    return pool
