"""Paged KV cache: a page pool per layer, the paged attentions and the paged forward pass.

Every layer keeps its keys and values in one pool of ``num_pages`` fixed-size pages laid out as
JAX's ragged paged attention kernel reads them, ``[pages, page_size, 2K, D]`` with keys in the
even and values in the odd combined heads. A sequence owns a *page table*, the list of pages that
hold its positions ``0, page_size, 2 page_size, ...``. Page 0 is a scratch page: padding tokens
write there and unused page-table entries point there, so no real page is ever touched by them.

The forward pass (:func:`paged_forward`) takes ``T`` tokens per sequence at given positions,
writes their K/V into the pages those positions fall in, and attends over the sequence's pages
with a paged attention, all of one signature (:data:`PagedAttention`):

* :func:`xla_attention`: the pages in use, as one flat list (a power-of-two bucket of the
  total), each attended to on its own and merged per sequence with the flash-attention
  rescaling, so the work grows with the sum of the actual lengths, not with the longest one or
  the pool; used on GPU, and for prefill on accelerators;
* :func:`pallas_attention`: JAX's ``ragged_paged_attention`` TPU kernel (decode: one query
  per sequence, or a few at consecutive positions); a verify step of a trie of drafts, whose
  mask that kernel does not take, runs on :mod:`delta_jax.sampling.attention.trie_kernel`'s;
* :func:`~delta_jax.sampling.attention.dense_cpu.dense_attention`: the CPU path (XLA:CPU, where
  per-op overheads dominate small steps): every sequence's page-table pages gathered into one
  contiguous view and attended to at once with the static sampler's attention; its decode runs
  on views gathered once per chunk (:mod:`delta_jax.sampling.attention.dense_cpu`).

Which one an engine uses, with the page layout the host sends it, is its backend
(:mod:`delta_jax.sampling.attention.backends`), picked once.

On a mesh the pool is split like the sequences: the page axis over the row (data) axes, so each
data group of the sampling mesh holds its own share of the pages next to its own slots, and the
KV heads over ``tensor``. Page tables and page lists hold *group-local* page indices (every
group's share starts with its own scratch page 0); the K/V writes and the attention run under
``shard_map`` (:class:`Groups`), so a group reads and writes only its own pages and attends for
its own sequences only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from flax.core import spmd
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from delta_jax.models import Transformer
from delta_jax.models import axes as ax
from delta_jax.models.attention import accumulation_dtype
from delta_jax.sampling.attention import smem
from delta_jax.sampling.attention.pages import SCRATCH_PAGE, PageAllocator

__all__ = [
    "PAGE_AXES",
    "SCRATCH_PAGE",
    "Groups",
    "PageAllocator",
    "PageList",
    "PagePool",
    "PagedAttention",
    "Tokens",
    "combined",
    "copy_pages",
    "init_pool",
    "move_kv",
    "paged_forward",
    "pallas_attention",
    "write_rows",
    "write_slots",
    "xla_attention",
]

# Logical axes of a layer's pages: the pages follow the rows (each data group owns a contiguous
# share of the page axis, as it owns a contiguous block of the slots), the KV heads are split
# over ``tensor``.
PAGE_AXES = (ax.BATCH, None, ax.KV_HEADS, ax.HEAD_DIM)
# Ragged paged attention kernel blocks: KV pages and queries (sequences, at decode) per block;
# a prefill's queries (a row's chunk of tokens) in larger blocks: each block reads its row's K/V
# pages up to its last position once, so a chunk of T tokens reads them T / block times.
PALLAS_KV_PAGES_PER_BLOCK = 16
PALLAS_QUERIES_PER_BLOCK = 32
PALLAS_PREFILL_QUERIES_PER_BLOCK = 128
# XLA path: pages gathered and attended to at once (about 1 MiB of float32 K/V for small heads).
XLA_PAGES_PER_BLOCK = 64

# A paged attention: ``attend(q [B, T, N, D], kv [pages, page_size, 2K, D], positions [B, T],
# valid [B, T], pages) -> [B, T, N, D]``, the new K/V already in ``kv``; ``pages`` is a flat
# :class:`PageList` or page tables ``[B, NB]``, as the attention reads them.
PagedAttention = Callable[..., jax.Array]


@flax.struct.dataclass
class PagePool:
    """K/V pages of every layer: a tuple of L arrays ``[pages, page_size, 2K, D]``."""

    kv: tuple[Float[Array, "P S C D"], ...]

    @property
    def page_size(self) -> int:
        return self.kv[0].shape[1]


def init_pool(model: Transformer, num_pages: int, page_size: int, dtype: Any) -> PagePool:
    """An all-zero pool (call inside ``jit`` so that it is created sharded, never on one host).

    ``num_pages`` counts every data group's share (a multiple of the number of groups).
    """
    c = model.config
    shape = (num_pages, page_size, 2 * c.num_kv_heads, c.head_dim)
    return PagePool(
        kv=tuple(ax.constrain(jnp.zeros(shape, dtype), PAGE_AXES) for _ in range(c.num_layers))
    )


@flax.struct.dataclass
class PageList:
    """Every page of a batch of sequences as one flat list (what the XLA path reads).

    Entries are packed from the start in sequence order (a sequence's pages together, sequences
    ascending), padding entries last: the XLA path stops reading at the last real entry.

    Attributes:
      page: pool page of each entry (scratch for padding entries).
      seq: the sequence (row) an entry belongs to; ``B`` (out of range) for padding.
      index: the entry's page index within its sequence (it holds positions
        ``[index * page_size, (index + 1) * page_size)``).
    """

    page: Int[Array, " U"]
    seq: Int[Array, " U"]
    index: Int[Array, " U"]


def write_slots(
    positions: Int[Array, "B T"],
    valid: Bool[Array, "B T"],
    page_size: int,
    pages: PageList | None = None,
    page_table: Int[Array, "B NB"] | None = None,
) -> tuple[Int[Array, "B T"], Int[Array, "B T"]]:
    """(page, offset) each token's K/V is written at, the same for every layer.

    From the flat list: the entry of the token's sequence and page index; from a page table: the
    entry at the page index. Padding tokens write to the scratch page.
    """
    logical = positions // page_size
    if pages is not None:
        rows = jnp.arange(positions.shape[0])[:, None, None]
        hit = (pages.seq == rows) & (pages.index == logical[:, :, None])  # [B, T, U]
        page = jnp.sum(jnp.where(hit, pages.page, 0), axis=-1)
    else:
        logical = jnp.minimum(logical, page_table.shape[1] - 1)
        page = jnp.take_along_axis(page_table, logical, axis=1)
    return jnp.where(valid, page, SCRATCH_PAGE), positions % page_size


def combined(k, v):
    """K and V ``[B, T, K, D]`` in the pool's layout ``[B, T, 2K, D]``: keys even, values odd."""
    B, T, K, D = k.shape
    return jnp.stack([k, v], axis=3).reshape(B, T, 2 * K, D)


def _write_pages(kv, new, page, offset):
    """Scatters each token's combined K/V [B, T, 2K, D] into (page, offset)."""
    flat = new.reshape(-1, *new.shape[2:]).astype(kv.dtype)
    return kv.at[page.reshape(-1), offset.reshape(-1)].set(flat, mode="drop")


def xla_attention(q, kv, positions, valid, pages: PageList, inside=None):
    """Attention of q [B,T,N,D] over the listed pages: work grows with the pages in use.

    ``inside [B, T, T]`` (a verify step of a trie of drafts, written at consecutive positions
    from ``positions[:, 0]``): which of the call's own positions each query attends to (its
    ancestors); None: every position up to its own.

    The list is walked in blocks of ``XLA_PAGES_PER_BLOCK`` pages by a ``while_loop`` that
    stops after the last real entry (the list is packed from its start), so padding entries
    cost nothing and one list length serves every batch. Each block's pages are gathered (a
    block stays in cache, where one gather of the whole list would not), attended to by their
    sequence's queries, and merged into per-sequence running sums with the flash-attention
    rescaling by the running max. Exact in float32 (float64 for a float64 model).
    """
    B, T, N, D = q.shape
    _, page_size, C, _ = kv.shape
    K = C // 2
    block = min(XLA_PAGES_PER_BLOCK, pages.page.shape[0])
    padded = -(-pages.page.shape[0] // block) * block
    entries = [
        jnp.pad(a, (0, padded - a.shape[0]), constant_values=fill)
        for a, fill in ((pages.page, SCRATCH_PAGE), (pages.seq, B), (pages.index, 0))
    ]
    num_blocks = -(-jnp.sum(pages.seq < B) // block)
    qg = q.reshape(B, T, K, N // K, D)
    acc = accumulation_dtype(q.dtype)  # float32; float64 for a float64 model (x64 checks)

    def body(carry):
        i, run_max, run_sum, run_out = carry
        page, seq, index = (jax.lax.dynamic_slice_in_dim(a, i * block, block) for a in entries)
        row = jnp.minimum(seq, B - 1)
        # Gathered from the pool seen as [pages, page_size * 2K, D]: on a TPU, gathering from
        # [pages, page_size, 2K, D] (minor dims 2K x D, a few rows of a tile) makes the compiler
        # copy the layer's whole pool share into another layout first, at every layer of every
        # call (the pool's layout is the one the decode kernel reads).
        flat = kv.reshape(kv.shape[0], page_size * C, D)
        ctx = jnp.take(flat, page, axis=0, mode="clip").reshape(block, page_size, K, 2, D)
        k, v = ctx[..., 0, :].astype(q.dtype), ctx[..., 1, :].astype(q.dtype)  # [U, P, K, D]
        qu = jnp.take(qg, row, axis=0)
        scores = jnp.einsum("UTKGD,UPKD->UKTGP", qu, k, preferred_element_type=acc)
        scores = scores * (D**-0.5)
        key_pos = index[:, None] * page_size + jnp.arange(page_size)  # [U, P]
        visible = key_pos[:, None, :] <= jnp.take(positions, row, axis=0)[:, :, None]
        if inside is not None:  # the call's own positions: the query's ancestors only
            rel = key_pos - jnp.take(positions[:, 0], row)[:, None]  # [U, P]
            mine = jnp.take(inside, row, axis=0)  # [U, T, T]
            ancestor = jnp.take_along_axis(mine, jnp.clip(rel, 0, T - 1)[:, None, :], axis=2)
            visible &= ((rel < 0) | (rel >= T))[:, None, :] | ancestor
        visible = (visible & (seq < B)[:, None, None])[:, None, :, None, :]  # [U, 1, T, 1, P]
        scores = jnp.where(visible, scores, -jnp.inf)
        page_max = jnp.max(scores, axis=-1)  # [U, K, T, G]
        new_max = jnp.maximum(run_max, _segment_max(page_max, seq, B))
        ref = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # [B, K, T, G]
        weights = jnp.exp(scores - jnp.take(ref, row, axis=0)[..., None])  # 0: not visible
        page_out = jnp.einsum("UKTGP,UPKD->UKTGD", weights.astype(v.dtype), v)
        scale = jnp.exp(run_max - ref)  # 0 while a sequence has seen no key
        run_sum = run_sum * scale + _segment_sum(jnp.sum(weights, axis=-1), seq, B)
        run_out = run_out * scale[..., None] + _segment_sum(page_out.astype(acc), seq, B)
        return i + 1, new_max, run_sum, run_out

    shape = (B, K, T, N // K)
    _, _, total, out = jax.lax.while_loop(
        lambda carry: carry[0] < num_blocks,
        body,
        (
            jnp.zeros((), num_blocks.dtype),
            jnp.full(shape, -jnp.inf, acc),
            jnp.zeros(shape, acc),
            jnp.zeros((*shape, D), acc),
        ),
    )
    out = out / jnp.where(total > 0, total, 1.0)[..., None]  # rows with no key: 0
    return jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(B, T, N, D).astype(q.dtype)


def _segment_max(x, segments, num):
    return jax.ops.segment_max(x, segments, num_segments=num, indices_are_sorted=True)


def _segment_sum(x, segments, num):
    return jax.ops.segment_sum(x, segments, num_segments=num, indices_are_sorted=True)


def pallas_attention(q, kv, positions, valid, page_table, queries_per_block=None):
    """Paged attention with JAX's ragged paged attention TPU kernel (one group): ``T`` queries
    per row at consecutive positions, the row's last ``T`` (a decode step: 1; a speculative
    verify step: the fed token and its drafts; a prefill chunk: a row's next ``T`` tokens),
    each attending to the positions up to its own.

    A row's queries past its valid ones may read stale K/V at the positions after them (their
    own writes went to the scratch page); their outputs are the caller's to discard, as an idle
    row's are. ``queries_per_block``: the kernel's block of queries, which may span rows
    (default ``PALLAS_QUERIES_PER_BLOCK``; a prefill's: ``PALLAS_PREFILL_QUERIES_PER_BLOCK``).
    """
    B, T, N, D = q.shape
    block = PALLAS_QUERIES_PER_BLOCK if queries_per_block is None else queries_per_block
    # The kernel copies every sequence's pages up to its length: an idle slot gets length T
    # (its scratch page) instead of the stale position it stopped at.
    kv_lens = jnp.where(valid[:, 0], positions[:, -1] + 1, T).astype(jnp.int32)
    # The page table is a scalar-memory (SMEM) operand of 1 MiB at most: slots go through the
    # kernel in calls that each fit (``smem``); every call reads the same pool in HBM.
    out = smem.in_row_chunks(
        lambda q, lens, table: _ragged_call(q.reshape(-1, N, D), kv, lens, table, T, block),
        page_table.shape[1],
        q,
        kv_lens,
        page_table,
    )
    return out.reshape(B, T, N, D)


def _ragged_call(q, kv, kv_lens, page_table, T: int, queries_per_block: int):
    """One ragged paged attention kernel call: ``T`` queries per row, ``q [B * T, N, D]``."""
    # Lazy: the Pallas TPU kernel's module (Mosaic) loads only where the kernel is called.
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    B, D = kv_lens.shape[0], q.shape[-1]
    # Block sizes given explicitly: the kernel's tuned table looks up jax.devices(), which is
    # not the target TPU when compiling ahead of time for a topology.
    return ragged_paged_attention(
        q,
        kv,
        kv_lens,
        page_table,
        jnp.arange(B + 1, dtype=jnp.int32) * T,
        jnp.array([B], jnp.int32),
        sm_scale=D**-0.5,
        num_kv_pages_per_block=min(page_table.shape[1], PALLAS_KV_PAGES_PER_BLOCK),
        num_queries_per_block=queries_per_block,
    )


@dataclasses.dataclass(frozen=True)
class Groups:
    """The data groups a paged program runs in: the sampling ``mesh`` (None: one group) and the
    model's ``kv_heads`` (split over the KV-head axis when they divide). Fixed per engine: the
    backend holds one (:mod:`~delta_jax.sampling.attention.backends`)."""

    mesh: Mesh | None = None
    kv_heads: int = 1

    def __call__(self, fn, in_specs, out_specs):
        """``fn`` run by every data group on its own rows, pages and KV heads (``shard_map``).

        Specs are strings, one letter per dimension: ``R`` rows or pages (split over the row
        axes of the active rules, i.e. over the data groups), ``H`` heads (split over the
        KV-head axis when it divides ``kv_heads``; query heads follow their KV heads), ``-``
        whole. Inside, ``fn`` sees one group: its slots and its share of the pool, indexed
        group-locally. Mosaic kernels are not partitioned by XLA, and XLA may partition a
        gather or scatter at data-dependent pages of a pool split over groups by gathering the
        pool; under ``shard_map`` each group touches its own share only. Without a mesh ``fn``
        runs as it is (one group).
        """
        mesh = self.mesh
        if mesh is None:
            return fn
        rules = spmd.get_logical_axis_rules()
        axes = {
            "R": ax.logical_to_mesh((ax.BATCH,), rules, mesh)[0],
            "H": ax.logical_to_mesh((ax.KV_HEADS,), rules, mesh, (self.kv_heads,))[0],
            "-": None,
        }

        def spec(letters: str) -> P:
            return P(*(axes[c] for c in letters))

        return jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=tuple(spec(x) for x in in_specs),
            out_specs=jax.tree.map(spec, out_specs),
            check_vma=False,
        )


def copy_pages(pool: PagePool, src, dst, groups: Groups) -> PagePool:
    """Copies page ``src[s]`` onto page ``dst[s]`` of slot ``s``'s group, in every layer."""

    def copy(kv, src, dst):
        return kv.at[dst].set(kv[src])

    copy = groups(copy, ("R-H-", "R", "R"), "R-H-")
    return PagePool(kv=tuple(copy(kv, src, dst) for kv in pool.kv))


class Tokens(NamedTuple):
    """``T`` tokens per sequence: their ids, the positions their K/V are written at, and which
    of them are real (the others write to the scratch page)."""

    ids: Int[Array, "B T"]
    positions: Int[Array, "B T"]
    valid: Bool[Array, "B T"]


def paged_forward(
    model: Transformer,
    layers: list[dict[str, jax.Array]],
    tokens: Tokens,
    pool: PagePool,
    pages: PageList | Int[Array, "B NB"],
    *,
    attend: PagedAttention = xla_attention,
    groups: Groups = Groups(),
    rope: Int[Array, "B T"] | None = None,
    inside: Bool[Array, "B T T"] | None = None,
) -> tuple[Float[Array, "B T H"], PagePool]:
    """Runs the decoder on ``T`` ``tokens`` per sequence over its pages.

    Token ``(b, t)`` is written at ``positions[b, t]`` (when ``valid``) and attends to positions
    ``<= positions[b, t]`` of its sequence, which must all have been written before or in this
    call, with the paged attention ``attend`` (:data:`PagedAttention`: :func:`xla_attention`,
    :func:`pallas_attention`, or the CPU path's
    :func:`~delta_jax.sampling.attention.dense_cpu.dense_attention`). The sequences' pages come as
    ``attend`` reads them: a flat :class:`PageList`, or page tables ``[B, NB]`` listing each
    sequence's pages from position 0 on, in group-local page indices: with a mesh (``groups``),
    rows, page lists and pool pages are split over the data groups (the ``batch`` rule) and
    each group's writes and attention run on its own share.

    A verify step of a trie of drafts (the paths whose attention takes ``inside``): its ``T``
    tokens are written at consecutive positions, each token's rotary embedding at its depth
    ``rope`` (default: ``positions``), each attending to the sequence before the step and to
    the step's positions ``inside`` marks (its ancestors).

    Returns:
      The final RMS-normed hidden states [B, T, H] and the updated pool.
    """
    ids, positions, valid = tokens
    page_size = pool.page_size
    listed = isinstance(pages, PageList)
    pages_spec = "R" if listed else "R-"

    def where(positions, valid, pages):
        at = dict(pages=pages) if listed else dict(page_table=pages)
        return write_slots(positions, valid, page_size, **at)

    page, offset = groups(where, ("R-", "R-", pages_spec), ("R-", "R-"))(positions, valid, pages)

    def write_and_attend(kv, new, q, positions, valid, page, offset, pages, *mask):
        kv = _write_pages(kv, new, page, offset)
        return attend(q, kv, positions, valid, pages, *mask), kv

    mask = () if inside is None else (inside,)
    specs = ("R-H-", "R-H-", "R-H-", "R-", "R-", "R-", "R-", pages_spec) + ("R--",) * len(mask)
    group_layer = groups(write_and_attend, specs, ("R-H-", "R-H-"))

    def layer_kv(q, k, v, kv):
        return group_layer(kv, combined(k, v), q, positions, valid, page, offset, pages, *mask)

    rope = positions if rope is None else rope
    hidden, new = model.forward_with(ids, rope, layer_kv, list(pool.kv), layers)
    return hidden, PagePool(kv=tuple(ax.constrain(kv, PAGE_AXES) for kv in new))


def move_kv(pool: PagePool, src, dst, moved, pages, groups: Groups):
    """Every layer's K/V at positions ``src [B, T]`` copied to positions ``dst`` of the same
    sequence, where ``moved`` (the kept path of a verify step of a trie, to the consecutive
    positions after its root); ``pages``: the sequences' flat :class:`PageList` or page
    tables."""
    page_size = pool.page_size
    listed = isinstance(pages, PageList)

    def move(kv, src, dst, moved, pages):
        at = dict(pages=pages) if listed else dict(page_table=pages)
        sp, so = write_slots(src, moved, page_size, **at)
        dp, do = write_slots(dst, moved, page_size, **at)
        dp = jnp.where(moved, dp, kv.shape[0])  # out of range: dropped
        return kv.at[dp, do].set(kv[sp, so], mode="drop")

    specs = ("R-H-", "R-", "R-", "R-", "R" if listed else "R-")
    move = groups(move, specs, "R-H-")
    return PagePool(kv=tuple(move(kv, src, dst, moved, pages) for kv in pool.kv))


def write_rows(out, row, count, cols, groups: Groups):
    """Writes each live slot's column value at (its row, its token index) of the output
    buffers; idle slots' rows are out of range and dropped. Per data group on a mesh (rows
    group-local, each group's block of the buffers)."""

    def write(buf, row, count, col):
        return buf.at[row, count].set(col.astype(buf.dtype), mode="drop")

    new = {}
    for name, col in cols.items():
        spec = "R" + "-" * (out[name].ndim - 1)
        fn = groups(write, (spec, "R", "R", "R" + "-" * (col.ndim - 1)), spec)
        new[name] = fn(out[name], row, count, col)
    return new
