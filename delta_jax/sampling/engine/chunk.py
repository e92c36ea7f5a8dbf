"""The continuous engine's decode chunk: a ``lax.while_loop`` of steps over the slots (the
static decode loop), each step one of two behind one interface, picked once per program from
its options: :class:`PlainStep` (every live slot feeds its last token and draws the next) or,
with drafts (``options.draft_tokens`` = k >= 1), :class:`VerifyStep` (every live slot scores
up to ``k`` drafted tokens with the fed one and keeps those its draws confirm,
:func:`speculative_step`). :class:`~delta_jax.sampling.engine.programs.EnginePrograms` compiles
it (:func:`decode_program`) and owns its state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Int

from delta_jax.models import Transformer
from delta_jax.sampling.attention.paged import PagePool, copy_pages
from delta_jax.sampling.engine.decode import (
    DecodeOptions,
    RequestInputs,
    SlotState,
    Weights,
    advance,
    token_sampler,
    unpack_slots,
)
from delta_jax.sampling.engine.requests import STATUS_FIELDS
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

__all__ = [
    "PlainStep",
    "Verified",
    "VerifyStep",
    "advance_by",
    "chunk_step",
    "decode_chunk",
    "decode_program",
    "speculative_step",
]


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
    """Up to ``limit`` steps of every live slot (exits early when none is live, or once
    ``request.refill`` >= 1 of the slots live at its start have ended: their slots can take
    waiting sequences).

    Each step's tokens, log-probs and hidden states go straight into the request's output
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
    :class:`~delta_jax.sampling.engine.decode.Weights`.

    The step (:func:`chunk_step`): a decode step, or with ``options.draft_tokens`` = k >= 1 a
    verify step (:func:`speculative_step`) scoring up to ``k`` of each slot's ``drafts`` (a
    line, or with ``draft_depth`` a trie up to that deep); the chunk then also returns the
    tokens each slot emitted (``emitted [S, emitted_width]``, -1 after them) and per-slot
    counters ``counts [S, 1 + 2 * len(SOURCES)]``: verify steps, then drafted and accepted
    tokens by draft source.
    """
    backend, stop_sequences = options.backend, request.stop_sequences
    model: Transformer = nnx.merge(options.graphdef, weights.params, weights.rest)
    pool = copy_pages(pool, slots.copy_src, slots.copy_dst, backend.groups)
    draw = token_sampler(model, request.strategy, options.return_hidden, options.pad_id)
    start, first = slots.pos, slots.count
    step = chunk_step(options, draw, stop_sequences, drafts, first)

    def body(carry):
        i, state, s, written, extra = carry
        layers = model.layer_params() if weights.layers is None else weights.layers
        state, s, written, extra = step(model, layers, i, state, s, written, extra)
        return i + 1, state, s, written, extra

    live = slots.active

    def cond(carry):
        i, _, s, _, _ = carry
        ended = jnp.sum(live & ~s.active)
        refill = request.refill
        return (i < limit) & jnp.any(s.active) & ((refill == 0) | (ended < refill))

    state, written, extra = step.begin(pool, slots, out)
    _, state, slots, written, extra = jax.lax.while_loop(
        cond, body, (jnp.zeros((), jnp.int32), state, slots, written, extra)
    )
    keep = request.resumable | jnp.any(slots.active)
    pool, out = backend.end_chunk(state, written, out, first, start, slots, keep)
    status = jnp.stack([getattr(slots, f).astype(jnp.int32) for f in STATUS_FIELDS], axis=1)
    if stop_sequences is not None:
        status = jnp.concatenate([status, slots.recent], axis=1)
    return dict(pool=pool, out=out, status=status, **step.outputs(extra))


class PlainStep:
    """A decode step: every live slot feeds its last token, writes its K/V and draws the next
    token (``draw``: :func:`~delta_jax.sampling.engine.decode.token_sampler`'s), written at its
    index; the chunk carries nothing more and returns nothing more."""

    def __init__(self, options: DecodeOptions, draw, stop_sequences):
        self.backend, self.draw, self.stop_sequences = options.backend, draw, stop_sequences

    def begin(self, pool: PagePool, slots: SlotState, out):
        """The chunk's start: the attention state, the buffers the steps write, the carry."""
        state, written = self.backend.begin_chunk(pool, slots, out, False)
        return state, written, ()

    def __call__(self, model, layers, i, state, s: SlotState, written, extra):
        """Step ``i``: the attention state, the slots, the buffers written and the carry
        after it."""
        h, state = self.backend.step(model, layers, s, state)
        cols = self.draw(h[:, 0], s)
        written = self.backend.write(written, cols, s, i)
        return state, advance(s, cols["tokens"], self.stop_sequences), written, extra

    def outputs(self, extra) -> dict[str, Array]:
        """What the chunk returns besides the pool, the buffers and the status."""
        return {}


class VerifyStep(PlainStep):
    """A verify step (:func:`speculative_step`) of each slot's ``drafts``; the chunk carries
    each slot's last tokens, the tokens it emitted from its count at the chunk's start
    (``first``) on, and its counters, and returns the last two (``emitted``, ``counts``)."""

    def __init__(self, options: DecodeOptions, draw, stop_sequences, drafts: Drafts, first):
        super().__init__(options, draw, stop_sequences)
        self.options, self.drafts, self.first = options, drafts, first

    def begin(self, pool, slots, out):
        S = slots.last.shape[0]
        emitted = jnp.full((S, self.options.emitted_width), -1, jnp.int32)
        counts = jnp.zeros((S, 1 + 2 * len(SOURCES)), jnp.int32)
        extra = (self.drafts.tail, emitted, counts)
        state, written = self.backend.begin_chunk(pool, slots, out, True)
        return state, written, extra

    def __call__(self, model, layers, i, state, s, written, extra):
        tail, emitted, counts = extra
        window, first = self.drafts.window, self.first
        new, state, v = speculative_step(
            self.options, model, layers, self.draw, s, state, window, tail, self.stop_sequences
        )
        written = self.backend.write_verified(written, v.cols, s, v.taken, first)
        emitted = _record(emitted, v.cols["tokens"], s.count - first, v.taken)
        counts = counts + _draft_counts(self.drafts.sources, v, s.active)
        return state, new, written, (v.tail, emitted, counts)

    def outputs(self, extra):
        return dict(emitted=extra[1], counts=extra[2])


def chunk_step(options: DecodeOptions, draw, stop_sequences, drafts: Drafts | None, first):
    """The step of a chunk built with ``options``: :class:`VerifyStep` of ``drafts`` with
    ``options.draft_tokens``, else :class:`PlainStep` (``drafts`` unused)."""
    if options.draft_tokens:
        return VerifyStep(options, draw, stop_sequences, drafts, first)
    return PlainStep(options, draw, stop_sequences)


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
    each node attending to its ancestors only. ``draw``:
    :func:`~delta_jax.sampling.engine.decode.token_sampler`'s ``draw(h [S, H], slots)``. A
    slot drafts no further than one token short of its budget, at positions its pages hold.

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


def advance_by(
    s: SlotState, drawn: Int[Array, "S k1"], emit: Int[Array, " S"], stop_sequences=None
) -> SlotState:
    """The slots after a verify step that emits ``drawn[:, :emit]``: as that many decode steps
    (:func:`~delta_jax.sampling.engine.decode.advance`, in order), so a slot still stops at
    the first stop id, stop sequence or the end of its budget among them; the tokens after a
    stop are not counted."""
    for j in range(drawn.shape[1]):
        go = s.active & (j < emit)
        step = advance(dataclasses.replace(s, active=go), drawn[:, j], stop_sequences)
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
