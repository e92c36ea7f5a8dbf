"""The continuous engine's device programs as pure functions of the parameters, the page pool
and the output buffers: the decode chunk (the static decode loop, a ``lax.while_loop`` of
decode steps over the slots), the prefill chunk and the observation write.
:class:`~delta_jax.sampling.engine.programs.EnginePrograms` compiles them and owns their state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Int

from delta_jax.models import Transformer, lm_head_weight
from delta_jax.models import axes as ax
from delta_jax.models.attention import accumulation_dtype
from delta_jax.sampling.attention.backends import PagedBackend
from delta_jax.sampling.attention.paged import (
    Groups,
    PageList,
    PagePool,
    Tokens,
    copy_pages,
    paged_forward,
    write_rows,
)
from delta_jax.sampling.engine.requests import SLOT_FIELDS, STATUS_FIELDS, EngineSpec
from delta_jax.sampling.speculation.drafts import SOURCES, Drafts
from delta_jax.sampling.speculation.speculate import (
    DRAFT_ACCEPTED,
    DRAFT_NONE,
    DRAFT_REJECTED,
    Trie,
    accepted_path,
    ancestors,
    line_trie,
    lookup_drafts,
    lookup_tree,
    next_tail,
)
from delta_jax.sampling.strategies import Categorical, Greedy

__all__ = [
    "DecodeOptions",
    "RequestInputs",
    "SlotState",
    "Verified",
    "Weights",
    "advance_by",
    "decode_chunk",
    "decode_program",
    "init_outputs",
    "prefill_chunk",
    "speculative_step",
    "token_sampler",
    "unpack_slots",
    "write_observations",
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
    def one(p, s, t):
        return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(seed, p), s), t)

    return jax.vmap(one)(prompt, sample, count)


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
    """What every decode chunk of one request reads: the sampling strategy and its seed,
    whether a sequence that stops may continue later from its pages (``resumable``: a
    multi-turn request, a turn's end), and a multi-turn request's stop sequences (see
    :func:`decode_chunk`; None for single-turn requests)."""

    strategy: Greedy | Categorical
    seed: Int[Array, ""]
    resumable: Bool[Array, ""]
    stop_sequences: Int[Array, "Q L"] | None = None


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


def decode_chunk(
    options: DecodeOptions,
    weights: Weights,
    pool: PagePool,
    out: dict[str, Array],
    slots: SlotState,
    limit: Int[Array, ""],
    request: RequestInputs,
    drafts: Drafts | None = None,
) -> dict[str, Any]:
    """Up to ``limit`` decode steps of every live slot (exits early when none is live).

    Each step's token, log-probs and hidden state go straight into the request's output
    buffers ``out`` (``[rows, gen_len]``, carried on device from chunk to chunk and read once
    at the end) at the sequence's row and token index, so a chunk returns only the slots' new
    state and its length is a traced value (no recompilation for a longer chunk).

    ``request.stop_sequences`` (multi-turn requests): a slot also stops at the step where the
    ids it drew in its turn (``slots.recent``, shifted every step) end with one of these rows,
    right-aligned and left-padded with -1 (a wildcard); None (single-turn requests) leaves the
    window out of the program and of the status.

    ``request.resumable`` (multi-turn requests): a sequence that stops in this chunk may
    continue later from its pages (a turn's end). The CPU path writes the chunk's K/V back into
    the pages only when a sequence may read them again: one still live after the chunk, or a
    resumable one; the last chunk of a request skips the write-back.

    ``options.backend``: the paged attention path
    (:mod:`delta_jax.sampling.attention.backends`): what a step attends with, and what a
    chunk's start and end do (the CPU path's views and chunk-local buffers). ``weights``: see
    :class:`Weights`.

    ``drafts`` (speculative chunks, ``options.draft_tokens`` = k >= 1): each step is a verify
    step (:func:`speculative_step`) scoring up to ``k`` drafted tokens per slot (a line, or
    with ``draft_depth`` a trie up to that deep); the chunk also returns the tokens each slot
    emitted (``emitted [S, emitted_width]``, -1 after them) and per-slot counters ``counts [S,
    1 + 2 * len(SOURCES)]``: verify steps, then drafted and accepted tokens by draft source.
    """
    backend, stop_sequences = options.backend, request.stop_sequences
    model: Transformer = nnx.merge(options.graphdef, weights.params, weights.rest)
    pool = copy_pages(pool, slots.copy_src, slots.copy_dst, backend.groups)
    draw = token_sampler(
        model, request.strategy, request.seed, options.return_hidden, options.pad_id
    )
    start, first = slots.pos, slots.count

    def body(carry):
        i, state, s, written, draft_state = carry
        layers = model.layer_params() if weights.layers is None else weights.layers
        if drafts is None:
            h, state = backend.step(model, layers, s, state)
            cols = draw(h[:, 0], s)
            written = backend.write(written, cols, s, i)
            return i + 1, state, _advance(s, cols["tokens"], stop_sequences), written, draft_state
        tail, emitted, counts = draft_state
        window = drafts.window
        new, state, v = speculative_step(
            options, model, layers, draw, s, state, window, tail, stop_sequences
        )
        written = backend.write_verified(written, v.cols, s, v.taken, first)
        emitted = _record(emitted, v.cols["tokens"], s.count - first, v.taken)
        counts = counts + _draft_counts(drafts.sources, v, s.active)
        return i + 1, state, new, written, (v.tail, emitted, counts)

    def cond(carry):
        i, _, s, _, _ = carry
        return (i < limit) & jnp.any(s.active)

    draft_state = ()  # a speculative chunk's carry: each slot's tail, emitted tokens, counters
    if drafts is not None:
        S = slots.last.shape[0]
        emitted = jnp.full((S, options.emitted_width), -1, jnp.int32)
        counts = jnp.zeros((S, 1 + 2 * len(SOURCES)), jnp.int32)
        draft_state = (drafts.tail, emitted, counts)
    state, written = backend.begin_chunk(pool, slots, out, drafts is not None)
    _, state, slots, written, draft_state = jax.lax.while_loop(
        cond, body, (jnp.zeros((), jnp.int32), state, slots, written, draft_state)
    )
    keep = request.resumable | jnp.any(slots.active)
    pool, out = backend.end_chunk(state, written, out, first, start, slots, keep)
    status = jnp.stack([getattr(slots, f).astype(jnp.int32) for f in STATUS_FIELDS], axis=1)
    if stop_sequences is not None:
        status = jnp.concatenate([status, slots.recent], axis=1)
    result = dict(pool=pool, out=out, status=status)
    if drafts is not None:
        result["emitted"], result["counts"] = draft_state[1], draft_state[2]
    return result


def _record(emitted, tokens, at, taken):
    """``emitted`` with each slot's first ``taken`` ``tokens`` written from column ``at``."""
    S, E = emitted.shape
    j = jnp.arange(tokens.shape[1])
    col = jnp.where(j < taken[:, None], at[:, None] + j, E)  # out of range: dropped
    return emitted.at[jnp.arange(S)[:, None], col].set(tokens, mode="drop")


def _draft_counts(sources, v: Verified, live) -> Int[Array, "S C"]:
    """One verify step's counters per slot: 1 (a live slot's step), then its drafted and its
    accepted tokens by source (one column per :data:`SOURCES` entry each)."""
    trie, N = v.trie, v.trie.tokens.shape[1]
    src = jnp.take_along_axis(sources, jnp.clip(trie.where, 0, sources.shape[1] - 1), 1)
    onehot = src[:, :, None] == jnp.arange(len(SOURCES))  # [S, N, sources]
    j = jnp.arange(v.path.shape[1])[None, :, None]
    node = jnp.arange(1, N + 1)[None, None, :]
    kept = jnp.any((v.path[:, :, None] == node) & (j < v.taken[:, None, None]), axis=1)
    drafted = trie.real[:, :, None] & onehot
    accepted = (kept & trie.real)[:, :, None] & onehot
    per = [live[:, None], drafted.sum(1), accepted.sum(1)]
    return jnp.concatenate([x.astype(jnp.int32) for x in per], axis=1)


def token_sampler(model: Transformer, strategy, seed, return_hidden: bool, pad_id: int):
    """``draw(h [S, H], slots)``: every slot's next token drawn from its hidden state (``pad_id``
    for idle slots), with its log-probs (and the hidden state), each slot with its sequence's
    RNG stream at its token index."""
    tied = model.config.tie_word_embeddings
    head = (model.embed[...] if tied else lm_head_weight(model)).astype(model.dtype)
    head_spec = "SH,VH->SV" if tied else "SH,HV->SV"
    key = jax.random.key(seed)
    acc = accumulation_dtype(model.dtype)  # float32; float64 for a float64 model (x64 checks)

    def draw(h, s: SlotState) -> dict[str, Array]:
        logits = jnp.einsum(head_spec, h, head, preferred_element_type=acc)
        keys = _row_keys(key, s.prompt, s.sample, s.count)
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Verified:
    """What one verify step did, per slot: the drafts it scored (``trie``), the positions it
    kept (``path``, :func:`~delta_jax.sampling.speculation.speculate.accepted_path`), the drawn
    columns along the path ``cols`` (``[S, depth + 1]``: tokens, log-probs, hidden, draft outcomes),
    the tokens emitted (the first ``taken`` columns), and the slot's last tokens after them."""

    trie: Trie
    path: Int[Array, "S L"]
    cols: dict[str, Array]
    taken: Int[Array, " S"]
    tail: Int[Array, "S m"]


def speculative_step(
    options: DecodeOptions,
    model: Transformer,
    layers,
    draw,
    s: SlotState,
    state,
    window: Int[Array, "S D"],
    tail: Int[Array, "S m"],
    stop_sequences=None,
):
    """One verify step of every slot: its drafts looked up in its window by its last tokens
    ``tail``, scored with the fed token in one forward pass, the token at each position drawn
    with the key of its index, the drafts kept down the path of the drawn tokens.

    The drafts (``k``, ``depth``: ``options.draft_tokens``, ``options.draft_depth``; the
    verify step runs on ``options.backend``): with ``depth = 0`` one line of up to ``k`` tokens
    (:func:`~delta_jax.sampling.speculation.speculate.lookup_drafts`); else a trie of up to ``k``
    nodes at most ``depth`` deep (:func:`~delta_jax.sampling.speculation.speculate.lookup_tree`),
    each node attending to its ancestors only. ``draw``: :func:`token_sampler`'s ``draw(h [S, H],
    slots)``. A slot drafts no further than one token short of its budget, at positions its
    pages hold.

    Returns:
      ``(slots, state, verified)``: the slots advanced by the tokens emitted, the attention
      state, and what the step did (:class:`Verified`).
    """
    backend, k, depth = options.backend, options.draft_tokens, options.draft_depth
    tree = depth > 0
    if tree:
        trie = lookup_tree(window, tail, k, depth)
    else:
        trie, depth = line_trie(*lookup_drafts(window, tail, k)), k
    # A slot drafts no further than one token short of its budget, and scores a node only at a
    # position plain decoding writes (up to ``left - 1`` past the fed token's; the page tables
    # hold no more). A node sits at its index, its level at most that (a line's: equal).
    left = (s.max_new - s.count)[:, None]
    trie = trie._replace(real=trie.real & (jnp.arange(1, k + 1) < left))
    S, T = s.last.shape[0], k + 1
    ids = jnp.concatenate([s.last[:, None], trie.tokens], axis=1)
    level = jnp.concatenate([jnp.zeros((S, 1), jnp.int32), trie.level], axis=1)
    valid = s.active[:, None] & jnp.concatenate([jnp.ones((S, 1), bool), trie.real], axis=1)
    inside = ancestors(trie, depth) if tree else None
    h, state = backend.verify(model, layers, s, ids, level, inside, valid, state)

    def at(lv, h_t):  # a position at level lv: the key of index count + lv
        return draw(h_t, dataclasses.replace(s, count=s.count + lv))

    cols = jax.vmap(at, in_axes=(1, 1), out_axes=1)(level, h)
    path, emit = accepted_path(trie, cols["tokens"], depth)
    if tree:  # the columns along the kept path (a line's are its first ones already)
        cols = {name: _along(col, path) for name, col in cols.items()}
    new = advance_by(s, cols["tokens"], emit, stop_sequences)
    taken = new.count - s.count
    cols["drafted"] = _outcomes(trie, path, taken)
    state = backend.kept(state, s, path, taken, T, tree)
    tail = next_tail(tail, cols["tokens"], taken)
    return new, state, Verified(trie, path, cols, taken, tail)


def _along(col, path):
    """``col [S, T, ...]`` at each slot's ``path [S, L]`` positions."""
    index = path.reshape(*path.shape, *(1,) * (col.ndim - 2))
    return jnp.take_along_axis(col, index, axis=1)


def _outcomes(trie: Trie, path, taken) -> Int[Array, "S L"]:
    """Each emitted token's draft outcome: a kept node's token was drafted and accepted; the
    last token was drawn in place of a rejected draft where its position had a drafted child,
    else nothing was drafted at its index."""
    up = jnp.where(trie.real, trie.parent + 1, -1)  # each node's parent position
    has_child = jnp.any(up[:, None, :] == path[:, :, None], axis=2)  # [S, L]
    j = jnp.arange(path.shape[1])
    rejected = jnp.where(has_child, DRAFT_REJECTED, DRAFT_NONE)
    return jnp.where(j < taken[:, None] - 1, DRAFT_ACCEPTED, rejected).astype(jnp.int8)


def _advance(s: SlotState, token, stop_sequences) -> SlotState:
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


def advance_by(
    s: SlotState, drawn: Int[Array, "S k1"], emit: Int[Array, " S"], stop_sequences=None
) -> SlotState:
    """The slots after a verify step that emits ``drawn[:, :emit]``: as that many decode steps
    (:func:`_advance`, in order), so a slot still stops at the first stop id, stop sequence or
    the end of its budget among them; the tokens after a stop are not counted."""
    for j in range(drawn.shape[1]):
        go = s.active & (j < emit)
        step = _advance(dataclasses.replace(s, active=go), drawn[:, j], stop_sequences)
        s = dataclasses.replace(step, active=jnp.where(go, step.active, s.active))
    return s


def decode_program(
    options: DecodeOptions,
    weights: Weights,
    pool: PagePool,
    out: dict[str, Array],
    packed: Int[Array, "S F"],
    pages: Int[Array, "U 3"],
    limit: Int[Array, ""],
    request: RequestInputs,
    drafts: Drafts | None = None,
) -> dict[str, Any]:
    """:func:`decode_chunk` on the packed slot matrix and page list the host sends."""
    stop_sequences = request.stop_sequences
    window = 0 if stop_sequences is None else stop_sequences.shape[1]
    slots = unpack_slots(packed, pages, options.stop_width, window)
    return decode_chunk(options, weights, pool, out, slots, limit, request, drafts)


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


def write_observations(
    out: dict[str, Array],
    rows: Int[Array, " S"],
    cols: Int[Array, " S"],
    ids: Int[Array, "S T"],
    valid: Bool[Array, "S T"],
    *,
    groups: Groups,
) -> dict[str, Array]:
    """Writes observation ``ids[s]`` into output row ``rows[s]`` (-1: none) from column
    ``cols[s]`` on; their log-probs (and hidden states) are zero: they were not sampled."""
    S, T = ids.shape
    dropped = out["tokens"].shape[0]  # out of range: the write is dropped
    at = jnp.where(valid & (rows[:, None] >= 0), rows[:, None], dropped).reshape(-1)
    col = (cols[:, None] + jnp.arange(T)).reshape(-1)
    values = {name: jnp.zeros((S * T, *buf.shape[2:]), buf.dtype) for name, buf in out.items()}
    values["tokens"] = ids.reshape(-1)
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
