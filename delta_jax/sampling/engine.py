"""Continuous-batching rollout engine over a paged KV cache.

The static sampler runs a batch until its longest row ends and attends over every cache slot at
every step; with ragged RL lengths most of that work is spent on finished rows and empty slots.
This engine keeps ``decode_slots`` sequences running instead:

1. every ``(prompt, sample)`` pair is a *sequence*; they wait in a queue, longest
   ``max_new_tokens`` first (so that no long sequence is left running alone at the end);
2. a free slot takes the next sequence. Its prompt, if not resident yet, is *prefilled* once into
   pages of the pool (all but its last token, in chunks of a bucketed length); the ``n`` samples
   of a prompt share those pages read-only. A sample owns the pages from the prompt's last
   (partially filled) page on: that page is copied into the sample's own page when it joins, so
   no sample ever writes into a shared page;
3. the *decode program* runs ``k`` steps on device (``lax.while_loop``): every live slot feeds its
   last token (first the prompt's last token), writes its K/V into its pages and draws the next
   token, written with its log-probs (and hidden state) straight into the request's output
   buffers on device, at the sequence's row and token index. The host then reads back only the
   slots' status (one small array: which ended, stop token or their own ``max_new_tokens``),
   frees their pages, refills the slots and allocates pages for the next ``k`` steps. Once
   every queue is empty (no slot can be refilled), the next chunk runs all that is left
   (the chunk length is a traced value); the buffers are read once, at the end;
4. when the pool runs out, the youngest running sequence is preempted (pages freed, put back at
   the front of the queue, recomputed later) instead of failing;
5. multi-turn requests (:class:`Turns`): a sequence that ends a turn leaves its slot but keeps
   its pages while the host answers (a tool runs, in a pool of its own); the observation's ids
   are written into its output row and prefilled into its own pages from where the turn ended,
   and it re-joins a free slot. The history is prefilled once; only a sequence preempted after
   a hand-over prefills its context again (from the host's copy). Sequences waiting on the
   host are preempted last.

On a mesh the engine is data parallel: the ``decode_slots`` slots and the pool's pages split
evenly over the *data groups* (the row shards of the sampling mesh, e.g. 4 groups of 8 chips for
Qwen3-8B on v5p-64), and every group is an engine of its own: its slot set, its page allocator
(group-local page indices) and its queue. Each prompt goes to one group, with all its ``n``
samples (they share its pages), prompts spread by work (:func:`assign_groups`); a group's
programs read and write only its own pages and attend for its own slots (``shard_map``). One
device call still serves every group at once, so the host rounds stay in step.

Every sequence draws token ``t`` with the key ``fold_in(fold_in(fold_in(key(seed), prompt),
sample), t)``, so its tokens do not depend on the slot count, the slot order or preemptions.
Programs have fixed shapes: slots (``decode_slots`` capped at the request's rows), the output
buffers and the pool are fixed per request bucket, the chunk length is traced; the XLA
path's flat page list has one length per request bucket (it stops reading at the last real
entry, so attention work follows the actual lengths), the Pallas and dense (CPU) paths'
page-table width is a power of two of pages (the longest live sequence; the dense path's at
most the longest sequence) and prefill shapes are power-of-two buckets;
each program compiles once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Int

from delta_jax.models import Transformer, lm_head_weight
from delta_jax.models import axes as ax
from delta_jax.models.attention import accumulation_dtype
from delta_jax.models.axes import logical_to_mesh
from delta_jax.sampling import smem
from delta_jax.sampling.paged import (
    PAGE_AXES,
    SCRATCH_PAGE,
    Attention,
    PageAllocator,
    PageList,
    PagePool,
    copy_pages,
    dense_views,
    init_pool,
    paged_forward,
    per_group,
    views_to_pages,
)
from delta_jax.sampling.strategies import Categorical, Greedy, strategy_signature

__all__ = [
    "EngineSpec",
    "EngineStats",
    "SlotState",
    "Turns",
    "decode_chunk",
    "generate_continuous",
    "pages_for",
    "prefill_chunk",
    "run_engine",
    "validate_engine_request",
]

logger = logging.getLogger(__name__)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


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
# the page table into one [S, F] matrix: one host-to-device copy per chunk instead of one per
# field.
_SLOT_FIELDS = ("last", "pos", "count", "active", "max_new", "prompt", "sample", "row")
_SLOT_FIELDS += ("copy_src", "copy_dst")
# What the host reads back after a chunk, one [S, 4 + L] matrix (then the window ``recent``).
_STATUS_FIELDS = ("last", "pos", "count", "active")
_READ_ROWS = 8  # rows per host read of finished outputs (one compiled gather)


def unpack_slots(
    packed: Int[Array, "S F"], pages: Int[Array, "U 3"], stop_width: int, window: int = 0
):
    """The :class:`SlotState` of a packed ``[S, fields + stops + window + table]`` matrix and a
    ``[U, 3]`` (page, seq, index) page list."""
    cols = {name: packed[:, i] for i, name in enumerate(_SLOT_FIELDS)}
    cols["active"] = cols["active"] > 0
    F, W = len(_SLOT_FIELDS), stop_width
    return SlotState(
        **cols,
        stops=packed[:, F : F + W],
        recent=packed[:, F + W : F + W + window],
        page_table=packed[:, F + W + window :],
        pages=PageList(page=pages[:, 0], seq=pages[:, 1], index=pages[:, 2]),
    )


def _write_rows(out, row, count, cols, mesh, kv_heads):
    """Writes each live slot's column value at (its row, its token index) of the output
    buffers; idle slots' rows are out of range and dropped. Per data group on a mesh (rows
    group-local, each group's block of the buffers)."""

    def write(buf, row, count, col):
        return buf.at[row, count].set(col.astype(buf.dtype), mode="drop")

    new = {}
    for name, col in cols.items():
        spec = "R" + "-" * (out[name].ndim - 1)
        fn = per_group(write, mesh, kv_heads, (spec, "R", "R", "R" + "-" * (col.ndim - 1)), spec)
        new[name] = fn(out[name], row, count, col)
    return new


def _write_column(buf, col, i):
    """Column ``i`` of a chunk-local buffer ``[S, G, ...]`` set to ``col`` (every slot)."""
    return jax.lax.dynamic_update_slice_in_dim(buf, col[:, None].astype(buf.dtype), i, 1)


def _write_chunk(out, local, row, first, count, mesh, kv_heads):
    """The dense path's chunk-local outputs into the request's buffers: slot ``s``'s first
    ``count[s]`` columns (its live steps) at its row, from its token index ``first[s]`` on;
    the rest (idle slots, steps after a slot stopped) is dropped. Per data group on a mesh."""

    S, G = local["tokens"].shape
    j = jnp.arange(G)[None, :]
    rows = jnp.where(j < count[:, None], row[:, None], out["tokens"].shape[0])  # else dropped
    cols = first[:, None] + j
    values = {name: buf.reshape(S * G, *buf.shape[2:]) for name, buf in local.items()}
    return _write_rows(out, rows.reshape(-1), cols.reshape(-1), values, mesh, kv_heads)


def decode_chunk(
    params: nnx.State,
    rest: nnx.State,
    pool: PagePool,
    out: dict[str, Array],
    slots: SlotState,
    limit: Int[Array, ""],
    resumable: Bool[Array, ""],
    seed: Int[Array, ""],
    strategy: Greedy | Categorical,
    layers: list[dict[str, Array]] | None = None,
    stop_sequences: Int[Array, "Q L"] | None = None,
    *,
    graphdef: nnx.GraphDef,
    return_hidden: bool,
    pad_id: int,
    attention: Attention,
    mesh: Mesh | None,
) -> dict[str, Any]:
    """Up to ``limit`` decode steps of every live slot (exits early when none is live).

    Each step's token, log-probs and hidden state go straight into the request's output
    buffers ``out`` (``[rows, gen_len]``, carried on device from chunk to chunk and read once
    at the end) at the sequence's row and token index, so a chunk returns only the slots' new
    state and its length is a traced value (no recompilation for a longer chunk).

    ``stop_sequences`` (multi-turn requests): a slot also stops at the step where the ids it
    drew in its turn (``slots.recent``, shifted every step) end with one of these rows,
    right-aligned and left-padded with -1 (a wildcard); None (single-turn requests) leaves the
    window out of the program and of the status.

    ``resumable`` (multi-turn requests): a sequence that stops in this chunk may continue
    later from its pages (a turn's end). The ``dense`` path writes the chunk's K/V back into
    the pages only when a sequence may read them again: one still live after the chunk, or a
    resumable one; the last chunk of a request skips the write-back.

    ``layers`` (the CPU path): each layer's weights, sliced once per request
    (:func:`engine_programs`) instead of at every step, which XLA:CPU does not reliably hoist
    out of the loop; None (accelerators) slices them inside the loop, where the slices fuse
    into the matmuls (a copy would hold every weight twice).
    """
    model: Transformer = nnx.merge(graphdef, params, rest)
    K = model.config.num_kv_heads
    pool = copy_pages(pool, slots.copy_src, slots.copy_dst, mesh, K)
    tied = model.config.tie_word_embeddings
    head = (model.embed[...] if tied else lm_head_weight(model)).astype(model.dtype)
    head_spec = "SH,VH->SV" if tied else "SH,HV->SV"
    key = jax.random.key(seed)
    acc = accumulation_dtype(model.dtype)  # float32; float64 for a float64 model (x64 checks)

    def draw(logits, keys):
        return jax.vmap(lambda row, k: strategy(row[None], k))(logits, keys)

    def body(carry):
        i, pool, s, out = carry
        h, pool = paged_forward(
            model,
            model.layer_params() if layers is None else layers,
            s.last[:, None],
            s.pos[:, None],
            s.active[:, None],
            pool,
            pages=s.pages,
            page_table=s.page_table,
            attention=attention,
            mesh=mesh,
            view_shift=shift,
        )
        h = h[:, 0]
        logits = jnp.einsum(head_spec, h, head, preferred_element_type=acc)
        res = draw(logits, _row_keys(key, s.prompt, s.sample, s.count))
        live = s.active
        token = jnp.where(live, res.token[:, 0], pad_id)
        cols = dict(
            tokens=token,
            logprobs=res.logprob[:, 0],
            untruncated=res.untruncated_logprob[:, 0],
        )
        if return_hidden:
            cols["hidden"] = h
        if buffered:  # every slot at the step's column; the chunk's end writes the live ones
            out = {name: _write_column(out[name], col, i) for name, col in cols.items()}
        else:
            rows = jnp.where(live, s.row, out["tokens"].shape[0])  # idle: out of range, dropped
            out = _write_rows(out, rows, s.count, cols, mesh, K)
        count = s.count + live
        stopped = jnp.any(token[:, None] == s.stops, axis=-1) | (count >= s.max_new)
        recent = s.recent
        if stop_sequences is not None:
            shifted = jnp.concatenate([recent[:, 1:], token[:, None]], axis=1)
            recent = jnp.where(live[:, None], shifted, recent)
            ends = (stop_sequences < 0) | (recent[:, None, :] == stop_sequences)  # [S, Q, L]
            stopped |= jnp.any(jnp.all(ends, axis=-1), axis=-1)
        s = dataclasses.replace(
            s,
            recent=recent,
            last=jnp.where(live, token, s.last),
            pos=s.pos + live,
            count=count,
            active=live & ~stopped,
        )
        return i + 1, pool, s, out

    def cond(carry):
        i, _, s, _ = carry
        return (i < limit) & jnp.any(s.active)

    # The dense (CPU) path collects the chunk's outputs in chunk-local [slots, gen_len]
    # buffers, written by one dynamic-update-slice per field and step, and writes them into the
    # request's buffers once at the chunk's end: per step a scatter of each slot's value at its
    # row and token index (what the other paths do) costs XLA:CPU more than the step's column.
    buffered = attention == "dense"
    start, first = slots.pos, slots.count
    steps_out, shift = out, None
    if buffered:
        # Right-aligned views (PagePool): every live slot feeds its next token at column
        # ``base`` (the longest context), so a step writes one column of all of them. The host
        # sized the page table for ``base`` plus the chunk's steps.
        base = jnp.max(jnp.where(slots.active, slots.pos, 0))
        shift = jnp.where(slots.active, base - slots.pos, 0)
        pool = dense_views(pool, slots.page_table, shift, mesh, K)
        S, G = slots.row.shape[0], out["tokens"].shape[1]
        steps_out = {
            name: ax.constrain(
                jnp.zeros((S, G, *buf.shape[2:]), buf.dtype), (ax.BATCH,) + (None,) * (buf.ndim - 1)
            )
            for name, buf in out.items()
        }
    _, pool, slots, steps_out = jax.lax.while_loop(
        cond, body, (jnp.zeros((), jnp.int32), pool, slots, steps_out)
    )
    if buffered:
        out = _write_chunk(out, steps_out, slots.row, first, slots.count - first, mesh, K)
    else:
        out = steps_out
    if attention == "dense":
        pool = jax.lax.cond(
            resumable | jnp.any(slots.active),
            lambda pool: views_to_pages(pool, slots.page_table, start, slots.pos, shift, mesh, K),
            lambda pool: pool.replace(views=None),
            pool,
        )
    status = jnp.stack([getattr(slots, f).astype(jnp.int32) for f in _STATUS_FIELDS], axis=1)
    if stop_sequences is not None:
        status = jnp.concatenate([status, slots.recent], axis=1)
    return dict(pool=pool, out=out, status=status)


def decode_program(
    params,
    rest,
    pool,
    out,
    packed,
    pages,
    limit,
    resumable,
    seed,
    strategy,
    layers=None,
    stop_sequences=None,
    *,
    stop_width,
    **kw,
):
    """:func:`decode_chunk` on the packed slot matrix and page list the host sends."""
    window = 0 if stop_sequences is None else stop_sequences.shape[1]
    return decode_chunk(
        params,
        rest,
        pool,
        out,
        unpack_slots(packed, pages, stop_width, window),
        limit,
        resumable,
        seed,
        strategy,
        layers,
        stop_sequences,
        **kw,
    )


def init_outputs(rows: int, gen_len: int, hidden: int | None, dtype, pad_id: int):
    """The output buffers of one request (call inside ``jit``: created sharded by rows)."""
    names = (ax.BATCH, None)
    out = dict(
        tokens=ax.constrain(jnp.full((rows, gen_len), pad_id, jnp.int32), names),
        # float32; float64 for a float64 model (x64 numerics checks)
        logprobs=ax.constrain(jnp.zeros((rows, gen_len), accumulation_dtype(dtype)), names),
        untruncated=ax.constrain(jnp.zeros((rows, gen_len), accumulation_dtype(dtype)), names),
    )
    if hidden is not None:
        out["hidden"] = ax.constrain(jnp.zeros((rows, gen_len, hidden), dtype), (*names, None))
    return out


def write_observations(
    out: dict[str, Array],
    rows: Int[Array, " S"],
    cols: Int[Array, " S"],
    ids: Int[Array, "S T"],
    valid: Bool[Array, "S T"],
    *,
    mesh: Mesh | None,
    kv_heads: int,
) -> dict[str, Array]:
    """Writes observation ``ids[s]`` into output row ``rows[s]`` (-1: none) from column
    ``cols[s]`` on; their log-probs (and hidden states) are zero: they were not sampled."""
    S, T = ids.shape
    dropped = out["tokens"].shape[0]  # out of range: the write is dropped
    at = jnp.where(valid & (rows[:, None] >= 0), rows[:, None], dropped).reshape(-1)
    col = (cols[:, None] + jnp.arange(T)).reshape(-1)
    values = {name: jnp.zeros((S * T, *buf.shape[2:]), buf.dtype) for name, buf in out.items()}
    values["tokens"] = ids.reshape(-1)
    return _write_rows(out, at, col, values, mesh, kv_heads)


def prefill_chunk(
    params: nnx.State,
    rest: nnx.State,
    pool: PagePool,
    ids: Int[Array, "B T"],
    positions: Int[Array, "B T"],
    valid: Bool[Array, "B T"],
    pages: PageList | Int[Array, "B NB"],
    layers: list[dict[str, Array]] | None = None,
    *,
    graphdef: nnx.GraphDef,
    mesh: Mesh | None,
    attention: Attention = "xla",
) -> PagePool:
    """Writes the K/V of a chunk of prompt tokens into the prompts' pages (no LM head).

    ``pages``: the rows' pages as a flat list (``xla``), or as page tables from position 0
    (``dense``, the CPU path: each row's pages gathered once per layer and attended to in one
    batched attention, where the list's block loop runs as many small steps); ``layers``: the
    per-layer weights sliced once per request (CPU), or None.
    """
    model: Transformer = nnx.merge(graphdef, params, rest)
    layers = model.layer_params() if layers is None else layers
    where = dict(page_table=pages) if attention == "dense" else dict(pages=pages)
    _, pool = paged_forward(
        model, layers, ids, positions, valid, pool, attention=attention, mesh=mesh, **where
    )
    return pool


@dataclasses.dataclass
class _Seq:
    """Host record of one (prompt, sample) sequence."""

    prompt: int
    sample: int
    max_new: int
    stops: np.ndarray
    order: int = 0  # admission counter: the largest is the youngest
    row: int = 0  # row of its group's block of the output buffers
    pages: list[int] = dataclasses.field(default_factory=list)  # own pages
    table: list[int] = dataclasses.field(default_factory=list)  # all pages from position 0
    length: int = 0
    index: int = 0  # request row (prompt * n + sample)
    # Multi-turn: the turns handed over, the response's tokens on the host (from the first
    # hand-over on, up to ``length`` when the sequence waits or re-joins), the observations'
    # columns, the pending observation, and the work before its next decode: tokens to prefill
    # from a position on, observation ids to write into its output row from a column on.
    turns: int = 0
    history: list[int] | None = None
    observed: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    future: concurrent.futures.Future | None = None
    resume: tuple[int, np.ndarray] | None = None
    write: tuple[int, np.ndarray] | None = None


@dataclasses.dataclass
class _Prompt:
    ids: np.ndarray
    group: int = 0  # the data group whose pool holds the prompt's pages and runs its samples
    pages: list[int] | None = None  # resident pages of the prefix (all but the last token)
    running: int = 0
    left: int = 0  # samples not finished yet

    @property
    def prefix(self) -> int:
        return self.ids.size - 1


@dataclasses.dataclass(frozen=True)
class Turns:
    """A multi-turn request: where a turn ends, and how the host answers it.

    A sequence that draws one of ``stop_ids``, or whose ids drawn in the current turn end with
    one of ``stop_sequences`` (an environment's stop strings, tokenized; ids of the prompt or
    of an observation never count toward a match), has ended a *turn*, not its episode (unless
    it was its ``max_turns``-th turn, or its token budget is spent): the engine reads the turn's
    tokens, calls ``submit(row, turn)`` (``row``: the request row ``prompt * n + sample``;
    ``turn``: its ids since the last observation, the stop id or sequence included) and gives
    the slot to another sequence while the host works. The sequence keeps its KV pages. The
    future's result is the observation's ids: they are written into the sequence's output row
    (as context, never sampled) and prefilled into its own pages, and the sequence re-joins a
    free slot for its next turn; the history is never prefilled again. ``None`` ends the
    episode, as does an observation that leaves no room in the budget (observation tokens count
    against ``max_new_tokens``) for one more token.

    Token ``t`` of a sequence is still drawn with the key of its column ``t``, so the tokens do
    not depend on the slot count, on how long the host takes or on preemptions. Stop sequences
    are matched on device, at the step that draws their last id (a window of the turn's last
    ids per slot, see :func:`decode_chunk`); a one-id sequence is a stop id.
    """

    stop_ids: tuple[int, ...]
    max_turns: int
    submit: Callable[[int, list[int]], concurrent.futures.Future]
    stop_sequences: tuple[tuple[int, ...], ...] = ()


def _turn_stops(turns: Turns | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The ids that end a turn (``stop_ids`` and the one-id sequences) and the longer stop
    sequences as an int32 ``[Q, L]`` matrix, right-aligned and left-padded with -1 (None when
    there are none: the decode program then has no window)."""
    if turns is None:
        return np.zeros(0, np.int32), None
    seqs = [tuple(q) for q in turns.stop_sequences]
    ids = list(turns.stop_ids) + [q[0] for q in seqs if len(q) == 1]
    longer = [q for q in seqs if len(q) > 1]
    if not longer:
        return np.asarray(ids, np.int32), None
    L = max(map(len, longer))
    patterns = np.full((len(longer), L), -1, np.int32)
    for i, q in enumerate(longer):
        patterns[i, L - len(q) :] = q
    return np.asarray(ids, np.int32), patterns


@dataclasses.dataclass
class EngineStats:
    """What one engine call did (for tests and benchmarks); page figures are per data group."""

    decode_steps: int = 0  # slot-steps run: chunks x steps x slots (every group's)
    useful_steps: int = 0  # generated tokens
    chunks: int = 0
    prefill_calls: int = 0
    preemptions: int = 0
    handovers: int = 0  # turns handed to the host (multi-turn)
    observation_tokens: int = 0  # observation ids appended to sequences
    resumed_tokens: int = 0  # ids prefilled into sequences' own pages (observations, and the
    # context of multi-turn sequences preempted after a hand-over)
    wait_s: float = 0.0  # host time blocked on observations, no slot able to run
    waiting_pages_peak: tuple[int, ...] = ()  # per group: most pages held by waiting sequences
    high_water_pages: tuple[int, ...] = ()  # per group: the most pages in use at once
    free_pages_after: tuple[int, ...] = ()  # per group: free pages after the call
    group_pages: int = 0  # pages in one group's share of the pool (its scratch page included)

    @property
    def occupancy(self) -> float:
        """Fraction of slot-steps that produced a token."""
        return self.useful_steps / max(1, self.decode_steps)


@dataclasses.dataclass
class EngineSpec:
    """Static configuration of one engine call (what the compiled programs depend on).

    ``slots`` and ``num_pages`` count the whole mesh; both split evenly over the ``groups`` data
    groups (the sampling mesh's row shards), each group owning a contiguous block of slots and
    of pool pages (its own scratch page first).
    """

    slots: int
    steps: int
    page_size: int
    num_pages: int
    seq_pages: int  # pages of the longest sequence (prompt bucket + generation bucket)
    max_table: int  # page-table width cap (``seq_pages`` up to a power of two)
    prefill_len: int  # longest prefill chunk
    min_len: int  # floor of the prefill-chunk and page-table (in tokens) buckets
    prefill_rows: int  # prompts per prefill call, every group's (fixed: no recompilation)
    groups: int  # data groups: independent slot sets and page pools
    attention: Attention
    return_hidden: bool
    pad_id: int

    @property
    def group_slots(self) -> int:
        return self.slots // self.groups

    @property
    def group_pages(self) -> int:
        return self.num_pages // self.groups


class _Group:
    """One data group's host state: its slots (global slots ``base + i``), its page allocator
    (group-local page indices) and its queue of sequences."""

    def __init__(self, base: int, slots: int, num_pages: int, seqs: list[_Seq]):
        self.base = base
        self.slots: list[_Seq | None] = [None] * slots
        self.alloc = PageAllocator(num_pages)
        self.queue = collections.deque(seqs)
        self.waiting: list[_Seq] = []  # multi-turn: sequences whose observation is pending
        self.waiting_pages_peak = 0

    @property
    def running(self) -> list[tuple[int, _Seq]]:
        """``(global slot, sequence)`` of the occupied slots, oldest admission first."""
        pairs = [(self.base + i, s) for i, s in enumerate(self.slots) if s is not None]
        return sorted(pairs, key=lambda p: p[1].order)


class _Scheduler:
    """Host side of one engine call: a queue, slots and pages per data group; one device call
    (prefill or decode) serves every group at once. The device programs are callbacks."""

    def __init__(
        self,
        spec: EngineSpec,
        prompts,
        groups: list[list[_Seq]],
        compile_fn,
        stats,
        on_done=None,
        turns: Turns | None = None,
        read=None,
    ):
        self.spec = spec
        self.prompts = prompts
        Sg, Pg = spec.group_slots, spec.group_pages
        self.groups = [_Group(g * Sg, Sg, Pg, seqs) for g, seqs in enumerate(groups)]
        self.compile = compile_fn
        self.stats = stats
        self.on_done = on_done  # on_done(sequences) with those that ended in a host round
        self.turns = turns
        self.turn_ids, self.stop_sequences = _turn_stops(turns)
        self.read = read  # read(seqs) -> their tokens [:length] (multi-turn hand-overs)
        self.admitted = 0
        self.done: list[_Seq] = []
        self.ended: list[_Seq] = []  # ended since the last report (on_done)

    # ---- pages -------------------------------------------------------------------------------

    def _pos(self, seq: _Seq) -> int:
        """Position of the token the sequence feeds next (its column ``length - 1``'s token,
        or the prompt's last one)."""
        return self.prompts[seq.prompt].prefix + seq.length

    def _end_pos(self, seq: _Seq) -> int:
        """Last position the sequence writes K/V at (its last token is never fed back)."""
        return self.prompts[seq.prompt].prefix + seq.max_new - 1

    def _chunk_pages(self, seq: _Seq, pos: int, steps: int | None = None) -> int:
        steps = self.spec.steps if steps is None else steps
        return min(pos + steps - 1, self._end_pos(seq)) // self.spec.page_size + 1

    def _release(self, group: _Group, seq: _Seq) -> None:
        group.alloc.free(seq.pages)
        seq.pages, seq.table = [], []
        self.prompts[seq.prompt].running -= 1

    def _free_idle_prompts(self, group: _Group, keep: int = -1) -> bool:
        """Frees the pages of the group's resident prompts with no running sample (but prompt
        ``keep``): cheaper to prefill again than preempting a running sequence."""
        g = self.groups.index(group)
        idle = [
            p
            for i, p in enumerate(self.prompts)
            if p.group == g and p.pages and p.running == 0 and i != keep
        ]
        for p in idle:
            group.alloc.free(p.pages)
            p.pages = None
        return bool(idle)

    def _preempt_youngest(self, group: _Group, keep: _Seq | None) -> bool:
        """Frees idle prompt pages, or else the pages of the group's youngest running sequence
        (back to its queue front), or else those of its youngest sequence holding pages without
        a slot (waiting on the host, or queued after its observation).

        A preempted sequence restarts from its last hand-over: its context up to there is on
        the host and is prefilled again when it re-joins (from the start when it has none).
        """
        if self._free_idle_prompts(group):
            return True
        running = [(s.order, i) for i, s in enumerate(group.slots) if s not in (None, keep)]
        if running:
            _, i = max(running)
            seq = group.slots[i]
            group.slots[i] = None
            group.queue.appendleft(seq)
        else:
            # Sequences holding pages without a slot: waiting on the host, or answered and
            # queued to re-join (their observation is kept and written when they do).
            held = [s for s in (*group.waiting, *group.queue) if s.table and s is not keep]
            if not held:
                return False
            seq = max(held, key=lambda s: s.order)
        self._release(group, seq)
        # Its rows of the output buffers are written again from there on.
        seq.length = len(seq.history or ())
        seq.resume = None
        self.stats.preemptions += 1
        return True

    def _grow(self, group: _Group, seq: _Seq, pos: int, steps: int | None = None) -> bool:
        """Pages for the next chunk of ``seq``, preempting younger sequences if needed."""
        need = self._chunk_pages(seq, pos, steps) - len(seq.table)
        while need > 0:
            got = group.alloc.alloc(need)
            if got is not None:
                seq.pages += got
                seq.table += got
                return True
            if not self._preempt_youngest(group, keep=seq):
                return False
        return True

    # ---- admission and prefill ---------------------------------------------------------------

    def _admit(self, group: _Group, state: dict[str, np.ndarray]) -> list[int]:
        """Fills the group's free slots from its queue while its pages allow; returns the
        prompts to prefill."""
        ps = self.spec.page_size
        new_prompts: list[int] = []
        free_slots = [i for i, s in enumerate(group.slots) if s is None]
        joined = False
        while free_slots and group.queue:
            seq = group.queue[0]
            prompt = self.prompts[seq.prompt]
            full = prompt.prefix // ps
            kept = bool(seq.table)  # re-joins after an observation, its pages its own
            fresh = not kept and prompt.pages is None and seq.prompt not in new_prompts
            need = pages_for(prompt.prefix, ps) if fresh else 0
            need += self._chunk_pages(seq, self._pos(seq)) - (len(seq.table) if kept else full)
            if need > group.alloc.num_free and self._free_idle_prompts(group, seq.prompt):
                continue
            if need > group.alloc.num_free:
                if any(s is not None for s in group.slots) or joined:
                    break  # wait for running sequences to end
                if not self._preempt_youngest(group, keep=seq if kept else None):
                    break
                continue
            group.queue.popleft()
            if kept:
                got = group.alloc.alloc(need) if need > 0 else []
                seq.pages += got
                seq.table += got
            else:
                if fresh:
                    prompt.pages = group.alloc.alloc(pages_for(prompt.prefix, ps))
                    new_prompts.append(seq.prompt)
                own = group.alloc.alloc(self._chunk_pages(seq, self._pos(seq)) - full)
                seq.pages = own
                seq.table = prompt.pages[:full] + own
                prompt.running += 1
                if seq.history:
                    # Preempted after a hand-over: its context is prefilled again into its own
                    # pages, from the prompt's partial last page on (not copied from it).
                    ids = np.concatenate([prompt.ids[full * ps :], seq.history[:-1]])
                    seq.resume = (full * ps, ids.astype(np.int32))
            if not seq.history:
                seq.order = self.admitted
                self.admitted += 1
            slot = free_slots.pop(0)
            group.slots[slot] = seq
            joined = True
            self._join(group.base + slot, seq, state)
        return new_prompts

    def _join(self, slot: int, seq: _Seq, state: dict[str, np.ndarray]) -> None:
        prompt, ps = self.prompts[seq.prompt], self.spec.page_size
        full = prompt.prefix // ps
        state["last"][slot] = seq.history[-1] if seq.history else prompt.ids[-1]
        state["pos"][slot] = self._pos(seq)
        state["count"][slot] = seq.length
        state["active"][slot] = True
        state["max_new"][slot] = seq.max_new
        state["prompt"][slot] = seq.prompt
        state["sample"][slot] = seq.sample
        state["row"][slot] = seq.row
        state["stops"][slot] = seq.stops
        # A sequence joins at the start of a turn (its prompt's end, an observation's end, or
        # its last hand-over when preempted: it restarts from there): no id of it counts yet.
        state["recent"][slot] = -1
        if not seq.history and prompt.prefix % ps:
            # The partial last prompt page becomes the sample's own copy.
            state["copy_src"][slot] = prompt.pages[full]
            state["copy_dst"][slot] = seq.table[full]

    def _prefill(self, per_group: list[list[tuple[np.ndarray, int, list[int]]]]) -> None:
        """Runs every group's prefill jobs ``(ids, first position, page table from position
        0)``, ``prefill_rows / groups`` rows per group per call (group ``g``'s jobs in its block
        of rows, with its own page list)."""
        spec, ps = self.spec, self.spec.page_size
        rows = spec.prefill_rows // spec.groups
        per_group = [[job for job in jobs if job[0].size] for jobs in per_group]
        rounds = max(-(-len(jobs) // rows) for jobs in per_group)
        for start in range(0, rounds * rows, rows):
            batch = [jobs[start : start + rows] for jobs in per_group]
            longest = max(ids.size for jobs in batch for ids, _, _ in jobs)
            T = min(spec.prefill_len, max(spec.min_len, _pow2(longest)))
            for offset in range(0, longest, T):
                ids = np.zeros((spec.prefill_rows, T), np.int32)
                valid = np.zeros((spec.prefill_rows, T), bool)
                positions = np.zeros((spec.prefill_rows, T), np.int32)
                positions[:] = np.arange(offset, offset + T, dtype=np.int32)
                for g, jobs in enumerate(batch):
                    for r, (job, first, _) in enumerate(jobs):
                        part = job[offset : offset + T]
                        ids[g * rows + r, : part.size] = part
                        valid[g * rows + r, : part.size] = True
                        positions[g * rows + r] += first
                # Pages up to this chunk's end (the earlier chunks' ones and the context's).
                tables = [
                    [table[: pages_for(first + offset + T, ps)] for _, first, table in jobs]
                    for jobs in batch
                ]
                if spec.attention == "dense":  # page tables (see prefill_chunk)
                    pages = self._page_tables(tables, rows)
                else:
                    used = max(sum(map(len, t)) for t in tables)
                    pages = _page_lists(tables, rows, _pow2(max(used, rows * pages_for(T, ps))))
                self.compile("prefill", ids, positions, valid, pages)
                self.stats.prefill_calls += 1

    def _page_tables(self, tables: list[list[list[int]]], rows: int, least: int = 0) -> np.ndarray:
        """Every group's per-row page tables (group ``g``'s in rows ``g * rows`` on) as one
        int32 array, as wide as the widest (and ``least`` pages) up to a power of two of pages
        (from the length bucket's floor up to ``max_table``); unused entries hold the scratch
        page."""
        spec = self.spec
        widest = max(least, *(len(t) for group in tables for t in group))
        nb = min(spec.max_table, _pow2(max(widest, pages_for(spec.min_len, spec.page_size))))
        if spec.attention == "dense":
            # The CPU path gathers every table entry: never wider than the longest sequence.
            nb = min(nb, spec.seq_pages)
        table = np.full((len(tables) * rows, nb), SCRATCH_PAGE, np.int32)
        for g, group in enumerate(tables):
            for r, t in enumerate(group):
                table[g * rows + r, : len(t)] = t
        return table

    def _prefill_prompts(self, per_group: list[list[int]]) -> None:
        """Prefills the new prompts (all but their last token) into their pages."""
        jobs = [
            [(self.prompts[i].ids[: self.prompts[i].prefix], 0, self.prompts[i].pages) for i in new]
            for new in per_group
        ]
        self._prefill(jobs)

    def _resume(self) -> None:
        """Before a decode: the running sequences' pending context (prefilled into their own
        pages) and observations (written into their output rows)."""
        jobs: list[list] = [[] for _ in self.groups]
        writes = []
        for g, group in enumerate(self.groups):
            for slot, seq in group.running:
                if seq.resume is not None:
                    first, ids = seq.resume
                    jobs[g].append((ids, first, seq.table))
                    self.stats.resumed_tokens += ids.size
                    seq.resume = None
                if seq.write is not None:
                    writes.append((slot, seq))
        if any(jobs):
            self._prefill(jobs)
        if writes:
            width = _pow2(max(max(s.write[1].size for _, s in writes), self.spec.min_len))
            rows = np.full(self.spec.slots, -1, np.int32)  # -1: nothing to write
            cols = np.zeros(self.spec.slots, np.int32)
            ids = np.zeros((self.spec.slots, width), np.int32)
            valid = np.zeros((self.spec.slots, width), bool)
            for slot, seq in writes:
                col, obs = seq.write
                rows[slot], cols[slot] = seq.row, col
                ids[slot, : obs.size] = obs
                valid[slot, : obs.size] = True
                seq.write = None
            self.compile("write", rows, cols, ids, valid)

    # ---- the loop ----------------------------------------------------------------------------

    def run(self) -> list[_Seq]:
        spec = self.spec
        S = spec.slots
        width = next(g.queue[0] for g in self.groups if g.queue).stops.size
        state = {name: np.zeros(S, np.int32) for name in _SLOT_FIELDS}
        state["stops"] = np.full((S, width), -1, np.int32)
        window = 0 if self.stop_sequences is None else self.stop_sequences.shape[1]
        state["recent"] = np.full((S, window), -1, np.int32)
        while any(g.queue or g.running or g.waiting for g in self.groups):
            self._collect(block=False)
            state["copy_src"][:] = SCRATCH_PAGE
            state["copy_dst"][:] = SCRATCH_PAGE
            new = [self._admit(g, state) for g in self.groups]
            if any(new):
                self._prefill_prompts(new)
            steps = self._tail_steps(state)
            for group in self.groups:
                for slot, seq in group.running:
                    if group.slots[slot - group.base] is not seq:
                        continue  # preempted while an older sequence grew
                    if not self._grow(group, seq, int(state["pos"][slot]), steps):
                        raise RuntimeError("page pool exhausted by a single sequence")
                for i, s in enumerate(group.slots):
                    if s is None:  # idle, or joined then preempted: no copy, no step
                        state["active"][group.base + i] = False
                        state["copy_src"][group.base + i] = SCRATCH_PAGE
                        state["copy_dst"][group.base + i] = SCRATCH_PAGE
            if not any(g.running for g in self.groups):
                if any(g.waiting for g in self.groups):
                    self._collect(block=True)  # every sequence left waits on the host
                    continue
                if not any(g.queue for g in self.groups):
                    break  # the last episodes ended on the host (no observation came back)
                raise RuntimeError(  # validated up front: a bug if it happens
                    "no sequence fits the page pool: "
                    + "; ".join(
                        f"group {i}: {g.alloc.num_free} free pages, queue "
                        + str([(s.index, len(s.table), s.length, s.turns) for s in g.queue])
                        for i, g in enumerate(self.groups)
                    )
                )
            self._resume()
            self._decode(state, steps)
        self.stats.high_water_pages = tuple(g.alloc.high_water for g in self.groups)
        self.stats.free_pages_after = tuple(g.alloc.num_free for g in self.groups)
        self.stats.waiting_pages_peak = tuple(g.waiting_pages_peak for g in self.groups)
        return self.done

    def _tail_steps(self, state: dict[str, np.ndarray]) -> int:
        """Steps of the next chunk: ``spec.steps``, or, once every queue is empty (no slot can
        be refilled), all that the running sequences have left in one chunk, when their pages
        for it are free now (no host round trip that could not change anything). When sequences
        are handed over as they end (``on_done``), a chunk does not run past the next one's
        end: up to its budget without stop ids, ``spec.steps`` with them. Multi-turn requests
        run ``spec.steps``: any step may end a turn that the host should start answering. A
        tail chunk also ends where its sequences' budgets leave at most half its rows busy
        (:meth:`_bucket`)."""
        if self.turns is not None or any(g.queue for g in self.groups):
            return self.spec.steps
        left, rests = 0, []
        for group in self.groups:
            need = 0
            rests.append([])
            for slot, seq in group.running:
                if self.on_done is not None and (seq.stops >= 0).any():
                    # Streaming: any step may end this sequence, whose reward should start then.
                    return self.spec.steps
                pos, rest = int(state["pos"][slot]), seq.max_new - int(state["count"][slot])
                left = max(left, rest)
                rests[-1].append(rest)
                need += self._chunk_pages(seq, pos, seq.max_new) - len(seq.table)
            if need > group.alloc.num_free:
                return self.spec.steps
        if self.on_done is not None:  # no stop ids: end the chunk where the next one ends
            left = min(min(r, default=left) for r in rests)
        # ... and where every group is down to half the chunk's rows (``_bucket``): the next
        # chunk runs on half the slots.
        B = self._bucket(max(map(len, rests)))
        if B > self._bucket(1):  # steps until each group has at most B // 2 budgets left
            until_half = [sorted(r, reverse=True)[B // 2] for r in rests if len(r) > B // 2]
            left = min(left, max(until_half, default=left))
        return max(left, self.spec.steps)

    def _bucket(self, occupied: int) -> int:
        """Slots per group a decode chunk runs for ``occupied`` sequences in the fullest group:
        the next power of two, from an eighth of the group's slots up to all of them (at most
        four decode programs). Sequences are packed into the chunk's first rows, so a group
        whose sequences are ending (the ragged tail of a rollout) stops paying for its idle
        slots; a slot's row is host state (its page table, its RNG stream is the sequence's),
        so which row a sequence decodes in changes nothing it draws."""
        S = self.spec.group_slots
        return min(S, max(-(-S // 8), _pow2(occupied)))

    def _decode(self, state: dict[str, np.ndarray], steps: int) -> None:
        spec = self.spec
        occupied = [[i for i, s in enumerate(g.slots) if s is not None] for g in self.groups]
        B = self._bucket(max(map(len, occupied)))
        rows, tables = [], []  # the chunk's rows: each group's sequences, then idle slots
        for group, used in zip(self.groups, occupied, strict=True):
            idle = [i for i in range(spec.group_slots) if group.slots[i] is None]
            local = (used + idle)[:B]
            rows += [group.base + i for i in local]
            tables.append([[] if group.slots[i] is None else group.slots[i].table for i in local])
        rows = np.asarray(rows)
        least = 0
        if spec.attention == "dense":
            # Right-aligned views (decode_chunk): the longest context plus the steps the chunk
            # runs must fit in the views, as wide as the page table; a chunk that would not fit
            # in the widest table runs fewer steps.
            live = state["active"][rows].astype(bool)
            base = int(state["pos"][rows][live].max(initial=0))
            steps = max(1, min(steps, min(spec.max_table, spec.seq_pages) * spec.page_size - base))
            left = (state["max_new"] - state["count"])[rows][live]
            least = pages_for(base + min(steps, int(left.max(initial=1))), spec.page_size)
        if spec.attention in ("pallas", "dense"):
            table = self._page_tables(tables, B, least)
            pages = _page_lists([[] for _ in self.groups], B, size=1)
        else:
            # One list length per row bucket (every row at the longest sequence): the XLA path
            # reads only the real entries, so a longer list costs nothing but its indices.
            table = np.zeros((len(rows), 1), np.int32)
            pages = _page_lists(tables, B, B * spec.seq_pages)
        before = state["count"].copy()
        fields = np.stack([state[name][rows] for name in _SLOT_FIELDS], axis=1)
        packed = np.concatenate(
            [fields, state["stops"][rows], state["recent"][rows], table], axis=1
        )
        status = self.compile("decode", packed, pages, steps)
        self.stats.chunks += 1
        for i, name in enumerate(_STATUS_FIELDS):
            state[name][rows] = status[:, i]
        state["recent"][rows] = status[:, len(_STATUS_FIELDS) :]
        new = state["count"] - before
        self.stats.decode_steps += int(new.max()) * len(rows)
        turn_ends = []
        for group in self.groups:
            for slot, seq in group.running:
                seq.length += int(new[slot])
                self.stats.useful_steps += int(new[slot])
                if state["active"][slot]:
                    continue
                group.slots[slot - group.base] = None
                if self._turn_ended(seq, int(state["last"][slot]), state["recent"][slot]):
                    turn_ends.append((group, seq))
                else:
                    self._finish(group, seq)
        if turn_ends:
            self._hand_over(turn_ends)
        self._report()

    # ---- turns -------------------------------------------------------------------------------

    def _turn_ended(self, seq: _Seq, last: int, recent: np.ndarray) -> bool:
        """The sequence stopped at a turn's end (its last id, or the window of its turn's last
        ids that the decode program returned) with turns and budget left."""
        t, patterns = self.turns, self.stop_sequences
        if t is None or seq.length >= seq.max_new or seq.turns + 1 >= t.max_turns:
            return False
        if last in self.turn_ids:
            return True
        return patterns is not None and bool(((patterns < 0) | (recent == patterns)).all(1).any())

    def _hand_over(self, ended: list[tuple[_Group, _Seq]]) -> None:
        """Sends the turns that just ended to the host (one read of their rows); the sequences
        wait, holding their pages."""
        tokens = self.read([seq for _, seq in ended])
        for (group, seq), ids in zip(ended, tokens, strict=True):
            start = seq.observed[-1][1] if seq.observed else 0
            seq.history = list(ids)
            seq.turns += 1
            seq.future = self.turns.submit(seq.index, seq.history[start:])
            group.waiting.append(seq)
            self.stats.handovers += 1
        for group in self.groups:
            held = sum(len(s.pages) for s in group.waiting)
            group.waiting_pages_peak = max(group.waiting_pages_peak, held)

    def _collect(self, block: bool) -> None:
        """Takes in the observations that are ready (``block``: waits for one first): each
        sequence goes back to its queue's front with its observation to write and prefill, or
        ends."""
        pending = [s.future for g in self.groups for s in g.waiting]
        if not pending:
            return
        if block:
            start = time.perf_counter()
            concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            self.stats.wait_s += time.perf_counter() - start
        for group in self.groups:
            for seq in [s for s in group.waiting if s.future.done()]:
                group.waiting.remove(seq)
                obs = seq.future.result()
                seq.future = None
                if obs is None or len(obs) >= seq.max_new - seq.length:
                    self._finish(group, seq)  # the episode is over, or its budget is
                    continue
                obs = np.asarray(obs, np.int32).reshape(-1)
                col = seq.length
                if obs.size:
                    if seq.table:  # its pages hold the context: only the new ids are prefilled
                        first = self.prompts[seq.prompt].prefix + col
                        ids = np.concatenate([seq.history[-1:], obs[:-1]]).astype(np.int32)
                        seq.resume = (first, ids)
                    seq.write = (col, obs)
                    seq.observed.append((col, col + obs.size))
                    seq.history += obs.tolist()
                    seq.length += obs.size
                    self.stats.observation_tokens += obs.size
                group.queue.appendleft(seq)
        self._report()

    def _finish(self, group: _Group, seq: _Seq) -> None:
        if seq.table:  # else preempted while it waited: its pages and prompt hold are gone
            self._release(group, seq)
        prompt = self.prompts[seq.prompt]
        prompt.left -= 1
        self.done.append(seq)
        self.ended.append(seq)
        if prompt.left == 0:
            group.alloc.free(prompt.pages or [])
            prompt.pages = None

    def _report(self) -> None:
        """Hands the sequences that ended in this host round over (one ``on_done`` call)."""
        if self.on_done is not None and self.ended:
            self.on_done(self.ended)
        self.ended = []


def _page_lists(tables: list[list[list[int]]], rows: int, size: int) -> np.ndarray:
    """Flat :class:`PageList` entries ``[U, 3]`` (page, seq, index), one list of ``size``
    entries per data group, concatenated
    (the list is split over the groups like the rows): group ``g``'s per-row page lists in
    group-local rows and pages, padded (row ``rows``: out of range) up to ``size``."""
    page = np.full((len(tables), size), SCRATCH_PAGE, np.int32)
    seq = np.full((len(tables), size), rows, np.int32)
    index = np.zeros((len(tables), size), np.int32)
    for g, group in enumerate(tables):
        at = 0
        for row, table in enumerate(group):
            page[g, at : at + len(table)] = table
            seq[g, at : at + len(table)] = row
            index[g, at : at + len(table)] = np.arange(len(table))
            at += len(table)
    return np.stack([page.reshape(-1), seq.reshape(-1), index.reshape(-1)], axis=1)


def assign_groups(prompts: list[np.ndarray], n: int, max_new: np.ndarray, groups: int):
    """The data group of each prompt (all its ``n`` samples run there, sharing its pages).

    Longest-processing-time first: prompts by decreasing work (their samples' token budgets
    plus the prompt's own tokens), each to the group with the least work so far. A function of
    the request only, so every process of a multi-host run assigns the same.
    """
    work = [len(p) + int(max_new[i * n : (i + 1) * n].sum()) for i, p in enumerate(prompts)]
    load = [0] * groups
    owner = [0] * len(prompts)
    for i in sorted(range(len(prompts)), key=lambda i: (-work[i], i)):
        g = min(range(groups), key=lambda g: (load[g], g))
        owner[i] = g
        load[g] += work[i]
    return owner


def output_rows(owner: list[int], n: int, groups: int) -> tuple[np.ndarray, int]:
    """Each request row's row in its data group's block of the output buffers, and the rows of
    one block (the most rows any group runs); with one group, row ``r`` is row ``r``."""
    rows = np.zeros(len(owner) * n, np.int64)
    used = [0] * groups
    for r in range(len(owner) * n):
        g = owner[r // n]
        rows[r] = used[g]
        used[g] += 1
    return rows, max(used)


def run_engine(
    spec: EngineSpec,
    prompts: list[np.ndarray],
    n: int,
    max_new: np.ndarray,
    stop_ids: np.ndarray,
    call,
    on_done=None,
    turns: Turns | None = None,
    read=None,
) -> tuple[list[_Seq], EngineStats]:
    """Runs every (prompt, sample) sequence to its end; returns them in row order and stats.

    ``on_done(seqs)``, when given, is called with the sequences that ended in each host round
    (their outputs are final), while the others are still being decoded.

    ``call(kind, *arrays)`` runs the compiled program on the pool and the output buffers (which
    it owns): ``"prefill"`` (ids, positions, valid, page list; page tables on the ``dense``
    path) returns nothing, ``"write"``
    (per-slot output row or -1, first column, ids, valid) writes observation ids into the
    output buffers, ``"decode"`` (packed slot matrix, page list, steps) returns the slots'
    ``[S, 4 + L]`` status (``_STATUS_FIELDS``, then the stop-sequence window of multi-turn
    requests with stop sequences of up to ``L`` ids) as NumPy.

    ``turns`` (multi-turn requests, :class:`Turns`) needs ``read(seqs)``: the sequences'
    output tokens ``[:length]`` as lists, read when their turns end.
    """
    stats = EngineStats(group_pages=spec.group_pages)
    owner = assign_groups(prompts, n, max_new, spec.groups)
    rows, _ = output_rows(owner, n, spec.groups)
    records = [_Prompt(ids=p, group=owner[i], left=n) for i, p in enumerate(prompts)]
    seqs = [
        _Seq(
            prompt=r // n,
            sample=r % n,
            max_new=int(max_new[r]),
            stops=stop_ids[r],
            row=rows[r],
            index=r,
        )
        for r in range(len(prompts) * n)
    ]
    # Longest budget first: a long sequence admitted last would run on alone while the other
    # slots idle. The order changes no token (each sequence has its own RNG stream).
    seqs.sort(key=lambda s: -s.max_new)
    groups = [[s for s in seqs if owner[s.prompt] == g] for g in range(spec.groups)]
    done = _Scheduler(spec, records, groups, call, stats, on_done, turns, read).run()
    done.sort(key=lambda s: (s.prompt, s.sample))
    return done, stats


def validate_engine_request(
    spec: EngineSpec, prompts: list[np.ndarray], n: int, max_new: np.ndarray
) -> None:
    """Raises ``ValueError`` for requests the engine cannot run, before any compilation."""
    G, Sg = spec.groups, spec.group_slots
    if n > Sg:
        where = (
            f"decode_slots={spec.slots}"
            if G == 1
            else f"the {Sg} decode slots of one data group (decode_slots={spec.slots} is the "
            f"total over {G} data groups; a prompt's samples run in one group, sharing its pages)"
        )
        raise ValueError(f"n={n} samples per prompt exceeds {where}; raise decode_slots or lower n")
    ps, usable = spec.page_size, spec.group_pages - 1
    share = "" if G == 1 else f" (one data group's share of {spec.num_pages} pages over {G})"
    for r, budget in enumerate(max_new[: len(prompts) * n]):
        prefix = prompts[r // n].size - 1
        # The prompt's pages plus the sequence's own ones (from the partial last page on).
        need = pages_for(prefix, ps) + pages_for(prefix + int(budget), ps) - prefix // ps
        if need > usable:
            raise ValueError(
                f"the page pool{share} ({usable} usable pages of {ps} tokens) is too small for "
                f"one sequence: prompt {r // n} with max_new_tokens {budget} needs {need} pages"
            )
    longest = max(p.size for p in prompts) + int(max_new.max())
    if pages_for(longest, ps) > spec.max_table:
        raise ValueError(f"a sequence of {longest} tokens exceeds the page-table width")
    if spec.attention == "pallas":  # the kernel's page table is a TPU scalar-memory operand
        smem.check_page_table(spec.max_table)


def engine_programs(
    sampler,
    spec: EngineSpec,
    graphdef,
    params,
    rest,
    strategy,
    seed,
    width,
    rows,
    gen_len,
    stop_sequences: np.ndarray | None = None,
    resumable: bool = False,
):
    """Returns ``call`` for :func:`run_engine` and ``results()``, compiling each program once
    per key (``stop_sequences``: a multi-turn request's ``[Q, L]`` matrix, sent once;
    ``resumable``: a multi-turn request, whose sequences continue after a turn's end).

    Compiled programs are cached on the sampler (``sampler._programs``). The pool and the
    ``rows x gen_len`` output buffers live in the returned closure and are donated to every
    program, so XLA updates them in place; ``results()`` hands the buffers over at the end.
    Per chunk the host sends one packed slot matrix and one page list and reads back the
    slots' status, nothing else.
    """
    mesh, rules = sampler.mesh, sampler.rules
    cache_dtype = sampler.resolved_cache_dtype()
    param_avals = tuple(
        (x.shape, x.dtype, getattr(x, "sharding", None)) for x in jax.tree.leaves(params)
    )
    base = (
        "engine",
        spec.slots,
        spec.page_size,
        spec.num_pages,
        jnp.dtype(cache_dtype).name,
        jax.tree.structure(params),
        param_avals,
    )

    def place(x: np.ndarray) -> jax.Array | np.ndarray:
        """Per-row arrays and per-group page lists, split over the data groups (without a
        mesh the host array goes to the compiled call as it is: no separate transfer call)."""
        if mesh is None:
            return x
        names = ("batch",) + (None,) * (x.ndim - 1)
        return jax.device_put(x, NamedSharding(mesh, logical_to_mesh(names, rules, mesh, x.shape)))

    def build(key, fn, args, donate=()):
        compiled = sampler._programs.get(key)
        if compiled is None:
            start = time.perf_counter()
            jitted = jax.jit(fn, donate_argnums=donate)
            if mesh is None:
                compiled = jitted.lower(*args).compile()
            else:
                with jax.set_mesh(mesh), spmd.logical_axis_rules(rules):
                    compiled = jitted.lower(*args).compile()
            sampler._programs[key] = compiled
            logger.info(
                "engine compile #%d: %s (%.2fs)",
                len(sampler._programs),
                key[len(base) :],
                time.perf_counter() - start,
            )
        return compiled

    model = sampler.model  # for its config and dtype
    make_pool = functools.partial(init_pool, model, spec.num_pages, spec.page_size, cache_dtype)
    hidden = model.config.hidden_size if spec.return_hidden else None
    make_out = functools.partial(init_outputs, rows, gen_len, hidden, model.dtype, spec.pad_id)
    platform = (jax.devices() if mesh is None else mesh.devices.flat)[0].platform
    cpu = platform == "cpu"

    def setup(params, rest):
        """The pool, the output buffers and, on CPU, each layer's weights sliced once for every
        program of the request (see :func:`decode_chunk`): one call."""
        layers = nnx.merge(graphdef, params, rest).layer_params() if cpu else None
        return make_pool(), make_out(), layers

    key = base + ("setup", rows, gen_len, hidden, cpu)
    pool, out, layers = build(key, setup, (params, rest))(params, rest)
    pool, out = [pool], [out]
    decode = functools.partial(
        decode_program,
        stop_width=width,
        graphdef=graphdef,
        return_hidden=spec.return_hidden,
        pad_id=spec.pad_id,
        attention=spec.attention,
        mesh=mesh,
    )
    sequences = () if stop_sequences is None else (jnp.asarray(stop_sequences),)
    if sequences and mesh is not None:
        sequences = (jax.device_put(sequences[0], NamedSharding(mesh, P())),)
    decode_key = (width, strategy_signature(strategy), spec.return_hidden, spec.attention)
    decode_key += tuple(q.shape for q in sequences)

    def call(kind: str, *arrays):
        if kind == "write":
            args = (out[0], *(place(a) for a in arrays))
            key = base + ("write", args[3].shape, rows, gen_len, hidden)
            kv_heads = model.config.num_kv_heads
            fn = functools.partial(write_observations, mesh=mesh, kv_heads=kv_heads)
            out[0] = build(key, fn, args, (0,))(*args)
            return None
        if kind == "prefill":
            if spec.attention == "dense":  # page tables
                pages = place(arrays[-1])
            else:
                pages = PageList(*(place(arrays[-1][:, i]) for i in range(3)))
            ids, positions, valid = (place(a) for a in arrays[:3])
            key = base + ("prefill", ids.shape, jax.tree.leaves(pages)[0].shape)
            prefill = "dense" if spec.attention == "dense" else "xla"  # pallas: decode only
            fn = functools.partial(prefill_chunk, graphdef=graphdef, mesh=mesh, attention=prefill)
            args = (params, rest, pool[0], ids, positions, valid, pages, layers)
            pool[0] = build(key, fn, args, (2,))(*args)
            return None
        packed, pages, steps = place(arrays[0]), place(arrays[1]), np.int32(arrays[2])
        key = base + ("decode", packed.shape, pages.shape, rows, gen_len, *decode_key)
        args = (params, rest, pool[0], out[0], packed, pages, steps, np.bool_(resumable), seed)
        args += (strategy, layers, *sequences)
        result = build(key, decode, args, (2, 3))(*args)
        pool[0], out[0] = result["pool"], result["out"]
        return _to_host(result["status"])

    def results():
        buffers, out[0] = out[0], None
        return buffers

    def peek(rows: np.ndarray) -> np.ndarray:
        """Tokens ``[len(rows), G]`` of finished buffer rows, on the host: read in blocks of
        ``_READ_ROWS`` rows (one shape, whatever number of rows a round hands over: the gather
        compiles once)."""
        pad = np.resize(rows, -(-len(rows) // _READ_ROWS) * _READ_ROWS).astype(np.int32)
        blocks = [
            _to_host(jnp.take(out[0]["tokens"], place(pad[i : i + _READ_ROWS]), axis=0))
            for i in range(0, len(pad), _READ_ROWS)
        ]
        return np.concatenate(blocks)[: len(rows)]

    return call, results, peek


def _to_host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


@functools.partial(jax.jit, static_argnames="pad_id")
def _assemble(buffers, index, lengths, prompt_ids, prompt_mask, repeat, *, pad_id):
    """The request's rows of the output buffers in row order (positions at or after a row's
    length hold ``pad_id`` / 0: a preempted sequence's first run may have written there), its
    lengths and longest length, and each row's prompt (``repeat``: its prompt's index); one
    call for everything the output holds."""
    G = buffers["tokens"].shape[1]
    valid = jnp.arange(G)[None, :] < lengths[:, None]
    out = {}
    for name, buf in buffers.items():
        rows = jnp.take(buf, index, axis=0)
        mask = valid.reshape(valid.shape + (1,) * (rows.ndim - 2))
        out[name] = jnp.where(mask, rows, pad_id if name == "tokens" else 0)
    out["lengths"], out["steps"] = lengths, jnp.max(lengths)
    out["prompt_ids"] = jnp.take(prompt_ids, repeat, axis=0)
    out["prompt_mask"] = jnp.take(prompt_mask, repeat, axis=0)
    return out


def generate_continuous(
    sampler,
    request,
    prompts: list[np.ndarray],
    n: int,
    strategy,
    seed,
    return_hidden,
    params,
    on_sample_done=None,
    turns: Turns | None = None,
):
    """The engine behind ``Sampler(engine="continuous").generate``; same output as the static one.

    ``on_sample_done(row, tokens)`` gets each request row's generated ids as soon as it ends,
    while the others decode. ``turns``: a multi-turn request
    (:class:`Turns`); the output's ``action_mask_array`` then marks the sampled tokens.

    Returns:
      ``(SamplerOutput, EngineStats)``.
    """
    from delta_jax.sampling.sampler import SamplerOutput

    spec = sampler.engine_spec(request, n, return_hidden, multi_turn=turns is not None)
    validate_engine_request(spec, prompts, n, request.max_new)
    graphdef, own, rest = nnx.split(sampler.model, nnx.Param, ...)
    params = own if params is None else params
    stop_ids = request.stop_ids
    turn_ids, stop_sequences = _turn_stops(turns)
    if turns is not None:  # a turn's end stops the sequence too; the host tells them apart
        extra = np.broadcast_to(turn_ids, (len(stop_ids), turn_ids.size))
        stop_ids = np.concatenate([stop_ids, extra], axis=1)
    width = stop_ids.shape[1]
    owner = assign_groups(prompts, n, request.max_new, spec.groups)
    local, block = output_rows(owner, n, spec.groups)
    call, results, peek = engine_programs(
        sampler,
        spec,
        graphdef,
        params,
        rest,
        strategy,
        seed,
        width,
        spec.groups * block,
        request.gen_len,
        stop_sequences,
        resumable=turns is not None,
    )

    def read(seqs: list[_Seq]) -> list[list[int]]:
        rows = np.array([owner[s.prompt] * block + local[s.index] for s in seqs], np.int32)
        tokens = peek(rows)
        return [tokens[i, : s.length].tolist() for i, s in enumerate(seqs)]

    on_done = None
    if on_sample_done is not None:

        def on_done(seqs: list[_Seq]) -> None:  # one read of the rows that ended this round
            for seq, tokens in zip(seqs, read(seqs), strict=True):
                on_sample_done(seq.index, tokens)

    seqs, stats = run_engine(
        spec, prompts, n, request.max_new, stop_ids, call, on_done, turns, read
    )

    rows = len(seqs)
    lengths = np.array([s.length for s in seqs], np.int32)
    # Global buffer row of each request row: its group's block, then its row in the block.
    index = np.array([owner[r // n] * block + local[r] for r in range(rows)], np.int32)
    repeat = np.repeat(np.arange(len(prompts)), n).astype(np.int32)
    out = _assemble(
        results(),
        index,
        lengths,
        request.prompt_ids,
        request.prompt_mask,
        repeat,
        pad_id=spec.pad_id,
    )
    output = SamplerOutput(
        token_array=out["tokens"],
        logprob_array=out["logprobs"],
        untruncated_logprob_array=out["untruncated"],
        length_array=out["lengths"],
        hidden_array=out.get("hidden"),
        prompt_array=out["prompt_ids"],
        prompt_mask_array=out["prompt_mask"],
        num_steps=out["steps"],
        num_rows=rows,
    )
    if turns is not None:
        actions = np.arange(request.gen_len)[None, :] < lengths[:, None]
        for r, seq in enumerate(seqs):
            for start, end in seq.observed:
                actions[r, start:end] = False
        output = dataclasses.replace(output, action_mask_array=jnp.asarray(actions))
    return output, stats


def _abstract(config, mesh: Mesh, rules, dtype):
    """Abstract parameters in ``dtype`` placed by ``rules`` (none materialised) and ``aval``:
    a ``ShapeDtypeStruct`` of logical axes ``names`` on ``mesh`` (missing trailing names: whole).
    """
    from delta_jax.sharding import param_shardings

    abstract = nnx.eval_shape(lambda: Transformer(config, dtype=dtype, param_dtype=dtype))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    shardings = param_shardings(params, mesh, rules)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings
    )

    def aval(shape, dt, names=()):
        names = tuple(names) + (None,) * (len(shape) - len(names))
        where = NamedSharding(mesh, logical_to_mesh(names, rules, mesh, shape))
        return jax.ShapeDtypeStruct(shape, dt, sharding=where)

    return graphdef, params, rest, aval


def _abstract_pool(config, aval, num_pages: int, page_size: int, dtype) -> PagePool:
    page = (num_pages, page_size, 2 * config.num_kv_heads, config.head_dim)
    return PagePool(kv=tuple(aval(page, dtype, PAGE_AXES) for _ in range(config.num_layers)))


def _abstract_outputs(aval, rows: int, gen_len: int) -> dict[str, Any]:
    """The output buffers of :func:`init_outputs` (no hidden states), ``rows`` x ``gen_len``."""
    R, G = rows, gen_len
    return dict(
        tokens=aval((R, G), jnp.int32, ("batch",)),
        logprobs=aval((R, G), jnp.float32, ("batch",)),
        untruncated=aval((R, G), jnp.float32, ("batch",)),
    )


def lower_decode(
    config,
    mesh: Mesh,
    rules,
    *,
    slots: int,
    steps: int,
    page_size: int,
    num_pages: int,
    table_pages: int,
    list_pages: int = 1,
    dtype: Any = jnp.bfloat16,
    attention: Attention = "pallas",
    stop_width: int = 1,
    cache_dtype: Any = None,
    rows: int | None = None,
    gen_len: int | None = None,
    stop_sequences: tuple[int, int] = (0, 0),
) -> jax.stages.Lowered:
    """The decode program lowered for abstract inputs on ``mesh`` (no parameters materialised).

    For compile-only checks and cost figures on a topology without its devices (the TPU compiler
    through ``jax.experimental.topologies``): parameters in ``dtype`` placed by ``rules``.
    ``slots`` and ``num_pages`` count every data group's (the mesh's row shards); ``table_pages``
    is the page-table width (``pallas``), ``list_pages`` one group's flat page list length
    (``xla``); the pool is in ``cache_dtype`` (default ``dtype``). The output buffers hold
    ``rows`` (default ``slots``) x ``gen_len`` (default ``steps``) tokens; the chunk's length
    is a traced value (``steps`` is what a real call passes). ``stop_sequences``: the ``(Q, L)``
    shape of a multi-turn request's stop-sequence matrix (``L = 0``: none).
    """
    from delta_jax.sampling.strategies import make_strategy
    from delta_jax.sharding import batch_divisor

    graphdef, params, rest, aval = _abstract(config, mesh, rules, dtype)
    i32, row = jnp.int32, ("batch",)
    groups = batch_divisor(mesh, rules)
    Q, L = stop_sequences
    packed = aval((slots, len(_SLOT_FIELDS) + stop_width + L + table_pages), i32, row)
    pages = aval((groups * list_pages, 3), i32, row)
    pool_dtype = dtype if cache_dtype is None else cache_dtype
    pool = _abstract_pool(config, aval, num_pages, page_size, pool_dtype)
    out = _abstract_outputs(aval, rows or slots, gen_len or steps)
    fn = functools.partial(
        decode_program,
        stop_width=stop_width,
        graphdef=graphdef,
        return_hidden=False,
        pad_id=0,
        attention=attention,
        mesh=mesh,
    )
    scalar = NamedSharding(mesh, P())
    limit = jax.ShapeDtypeStruct((), i32, sharding=scalar)
    resumable = jax.ShapeDtypeStruct((), jnp.bool_, sharding=scalar)
    seed = jax.ShapeDtypeStruct((), jnp.uint32, sharding=scalar)
    strategy = make_strategy(1.0)
    sequences = (jax.ShapeDtypeStruct((Q, L), i32, sharding=scalar),) if L else ()
    with jax.set_mesh(mesh), spmd.logical_axis_rules(rules):
        return jax.jit(fn, donate_argnums=(2, 3)).lower(
            params,
            rest,
            pool,
            out,
            packed,
            pages,
            limit,
            resumable,
            seed,
            strategy,
            None,
            *sequences,
        )


def lower_prefill(
    config,
    mesh: Mesh,
    rules,
    *,
    rows: int,
    length: int,
    page_size: int,
    num_pages: int,
    list_pages: int,
    dtype: Any = jnp.bfloat16,
    cache_dtype: Any = None,
) -> jax.stages.Lowered:
    """The prefill program (:func:`prefill_chunk`) lowered for abstract inputs on ``mesh``.

    The same program prefills a prompt (positions from 0) and continues a sequence in its own
    pages (an observation, or the context of a sequence preempted after a hand-over: positions
    from where it stopped, its pages from position 0 on in the list); the positions are values,
    the list length ``list_pages`` (one group's) is what a continuation makes longer. ``rows``
    (every group's) x ``length`` tokens per call; see :func:`lower_decode` for the rest.
    """
    from delta_jax.sharding import batch_divisor

    graphdef, params, rest, aval = _abstract(config, mesh, rules, dtype)
    pool_dtype = dtype if cache_dtype is None else cache_dtype
    pool = _abstract_pool(config, aval, num_pages, page_size, pool_dtype)
    listed = batch_divisor(mesh, rules) * list_pages
    pages = PageList(*(aval((listed,), jnp.int32, ("batch",)) for _ in range(3)))
    tokens = [aval((rows, length), dt, ("batch",)) for dt in (jnp.int32, jnp.int32, jnp.bool_)]
    fn = functools.partial(prefill_chunk, graphdef=graphdef, mesh=mesh)
    with jax.set_mesh(mesh), spmd.logical_axis_rules(rules):
        return jax.jit(fn, donate_argnums=(2,)).lower(params, rest, pool, *tokens, pages)


def lower_write(
    config, mesh: Mesh, rules, *, slots: int, width: int, rows: int, gen_len: int
) -> jax.stages.Lowered:
    """The observation write (:func:`write_observations`) lowered for abstract inputs: up to
    ``width`` ids for each of ``slots`` slots into ``rows`` x ``gen_len`` output buffers (no
    hidden states), donated as the engine donates them."""
    _, _, _, aval = _abstract(config, mesh, rules, jnp.float32)
    out = _abstract_outputs(aval, rows, gen_len)
    row = ("batch",)
    args = (
        aval((slots,), jnp.int32, row),
        aval((slots,), jnp.int32, row),
        aval((slots, width), jnp.int32, row),
        aval((slots, width), jnp.bool_, row),
    )
    fn = functools.partial(write_observations, mesh=mesh, kv_heads=config.num_kv_heads)
    with jax.set_mesh(mesh), spmd.logical_axis_rules(rules):
        return jax.jit(fn, donate_argnums=(0,)).lower(out, *args)
