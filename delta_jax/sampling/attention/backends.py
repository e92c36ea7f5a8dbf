"""The continuous engine's paged attention backends, picked once when the engine is built.

A backend is one paged attention path with both of its halves: how the host lays out the pages
it reads (a flat page list or page tables, how wide, how many steps a chunk may run), and what
the device programs do with them (the prefill's attention, a decode step, the start and end of
a decode chunk). The scheduler and the programs call the same methods whatever the backend;
none of them branches on the platform or the attention path.

* :class:`XlaBackend`: flat page lists and :func:`~delta_jax.sampling.attention.paged.xla_attention`
  (GPU);
* :class:`PallasBackend`: page tables and the TPU kernel, for decode and prefill;
* :class:`DenseCpuBackend`: page tables and the CPU path
  (:mod:`delta_jax.sampling.attention.dense_cpu`), whose views and chunk-local buffers stay
  inside it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, Protocol

import jax.numpy as jnp
import numpy as np

from delta_jax.models import Transformer
from delta_jax.sampling.attention import dense_cpu, smem
from delta_jax.sampling.attention.paged import (
    PALLAS_PREFILL_QUERIES_PER_BLOCK,
    Groups,
    PagedAttention,
    PageList,
    PagePool,
    Tokens,
    move_kv,
    paged_forward,
    pallas_attention,
    write_rows,
    xla_attention,
)
from delta_jax.sampling.attention.pages import page_lists, page_tables, pages_for, pow2
from delta_jax.sampling.attention.trie_kernel import trie_attention

__all__ = [
    "NAMES",
    "DenseCpuBackend",
    "EngineShape",
    "PagedBackend",
    "PallasBackend",
    "TablesBackend",
    "XlaBackend",
    "backend_for",
    "resolve_attention",
]


class EngineShape(Protocol):
    """What a backend's host half reads of an engine call's static configuration (the engine's
    :class:`~delta_jax.sampling.engine.requests.EngineSpec`, which sits above this package)."""

    page_size: int
    steps: int
    seq_pages: int  # pages of the longest sequence
    max_table: int  # page-table width cap
    draft_tokens: int  # tokens drafted per slot and verify step (0: plain decode steps)

    @property
    def group_slots(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class PagedBackend:
    """What the engine asks of a paged attention path (the XLA path's behaviour by default).

    Host methods take NumPy; device methods run inside the decode and prefill programs, in the
    engine's data ``groups`` (its mesh and the model's KV heads, bound when the backend is
    picked: :func:`backend_for`).
    """

    groups: Groups = Groups()

    name: ClassVar[str] = "xla"
    # The prefill's and the decode's paged attention (one signature, ``PagedAttention``), and
    # a verify step's of a trie of drafts (the same, with the ancestors' mask ``inside``).
    prefill_attention: ClassVar[PagedAttention] = staticmethod(xla_attention)
    decode_attention: ClassVar[PagedAttention] = staticmethod(xla_attention)
    trie_attention: ClassVar[PagedAttention] = staticmethod(xla_attention)

    # ---- host ------------------------------------------------------------------------------

    def refusal(self, spec: EngineShape) -> str | None:
        """Why this path cannot run ``spec`` whatever the request (one line), or None."""
        return None

    def decode_list_pages(self, spec: EngineShape) -> int:
        """The length of one data group's flat page list in a decode program (every slot at the
        longest sequence; 1, unused, for the paths that read page tables)."""
        return spec.group_slots * spec.seq_pages

    def table(self, spec: EngineShape, tables, rows: int) -> np.ndarray:
        """Every group's per-row page tables, one width per request (``max_table``, or what the
        path reads at most): the decode and prefill programs keep one shape whatever the
        sequences' lengths (the kernels read a row's pages up to its length only)."""
        return page_tables(tables, rows, self._widest(spec))

    def _widest(self, spec: EngineShape) -> int:
        return spec.max_table

    def prefill_pages(self, spec: EngineShape, tables, rows: int, length: int) -> np.ndarray:
        """The pages a prefill call of ``length`` tokens per row reads: flat page lists, one
        length per group (a power of two)."""
        used = max(sum(map(len, t)) for t in tables)
        size = pow2(max(used, rows * pages_for(length, spec.page_size)))
        return page_lists(tables, rows, size)

    def decode_pages(self, spec: EngineShape, tables, rows: int, pos, left, steps: int):
        """``(steps, page table, page list)`` of a decode chunk over ``rows`` rows per group
        (``pos``, ``left``: the live rows' positions and token budgets left). One list length
        per row bucket (every row at the longest sequence): the XLA path reads only the real
        entries, so a longer list costs nothing but its indices."""
        table = np.zeros((len(tables) * rows, 1), np.int32)
        return steps, table, page_lists(tables, rows, self.decode_list_pages(spec))

    # ---- device ----------------------------------------------------------------------------

    def prefill_layout(self, pages: np.ndarray, place):
        """The prefill's pages on device (:class:`PageList` from ``[U, 3]`` entries)."""
        return PageList(*(place(pages[:, i]) for i in range(3)))

    def begin_chunk(self, pool: PagePool, slots, out, speculative=False):
        """A decode chunk's start: the state its steps (verify steps when ``speculative``)
        carry, and the buffers they write."""
        return pool, out

    def step(self, model: Transformer, layers, slots, state):
        """One decode step of every slot: the hidden states ``[S, 1, H]`` and the new state."""
        return paged_forward(
            model,
            layers,
            Tokens(slots.last[:, None], slots.pos[:, None], slots.active[:, None]),
            state,
            self._decode_pages(slots),
            attend=self.decode_attention,
            groups=self.groups,
        )

    def verify(self, model: Transformer, layers, slots, ids, level, inside, valid, state):
        """A speculative verify step: every slot's fed token and its drafted ones (``ids [S,
        T]``, at consecutive positions from ``pos``, each at the rotary position ``pos +
        level``); the hidden states ``[S, T, H]`` and the new state. ``inside [S, T, T]`` (a
        trie of drafts; None: a line): the step's positions each one attends to (its
        ancestors). K/V of the positions not ``valid`` go to the scratch page."""
        return paged_forward(
            model,
            layers,
            Tokens(ids, slots.pos[:, None] + jnp.arange(ids.shape[1]), valid),
            state,
            self._decode_pages(slots),
            attend=self.decode_attention if inside is None else self.trie_attention,
            groups=self.groups,
            rope=slots.pos[:, None] + level,
            inside=inside,
        )

    def kept(self, state, slots, path, taken, T: int, trie: bool):
        """The state after a verify step of ``T`` positions that kept each slot's first
        ``taken`` positions of ``path`` (from ``pos``): a line's are its first ``taken`` (the
        rejected K/V sit at positions the next tokens overwrite); a trie's kept K/V move to
        the positions after its root, in order."""
        if not trie:
            return state
        j = jnp.arange(path.shape[1])
        moved = slots.active[:, None] & (j < taken[:, None]) & (path != j)
        src, dst = slots.pos[:, None] + path, slots.pos[:, None] + j
        return move_kv(state, src, dst, moved, self._decode_pages(slots), self.groups)

    def _decode_pages(self, slots):
        return slots.pages

    def write(self, out, cols, slots, i):
        """Step ``i``'s outputs ``cols`` (per slot) into the buffers, at each live slot's row
        and token index (idle slots' rows are out of range: dropped)."""
        rows = jnp.where(slots.active, slots.row, out["tokens"].shape[0])
        return write_rows(out, rows, slots.count, cols, self.groups)

    def write_verified(self, out, cols, slots, taken, first):
        """A verify step's outputs ``cols`` (``[S, k + 1]`` per slot) into the buffers: each
        slot's first ``taken`` columns from its token index on (the rest dropped; ``first``:
        the token indices at the chunk's start)."""
        S, T = cols["tokens"].shape
        j = jnp.arange(T)
        dropped = out["tokens"].shape[0]
        rows = jnp.where(slots.active[:, None] & (j < taken[:, None]), slots.row[:, None], dropped)
        index = slots.count[:, None] + j
        flat = {name: col.reshape(S * T, *col.shape[2:]) for name, col in cols.items()}
        return write_rows(out, rows.reshape(-1), index.reshape(-1), flat, self.groups)

    def end_chunk(self, state, written, out, first, start, slots, keep):
        """A decode chunk's end: ``(pool, output buffers)``."""
        return state, written


class XlaBackend(PagedBackend):
    """Flat page lists, :func:`~delta_jax.sampling.attention.paged.xla_attention` (GPU)."""


class TablesBackend(PagedBackend):
    """A path that reads page tables (one row per sequence, from position 0), in decode and
    prefill alike, where the XLA path reads flat page lists."""

    def decode_list_pages(self, spec):
        return 1

    def prefill_pages(self, spec, tables, rows, length):
        return self.table(spec, tables, rows)

    def prefill_layout(self, pages, place):
        return place(pages)


class PallasBackend(TablesBackend):
    """Page tables and the ragged paged attention TPU kernel, for decode (verify steps of tries:
    :mod:`~delta_jax.sampling.attention.trie_kernel`) and prefill. The prefill on the kernel
    reads each row's pages up to its position once per block of its queries; the XLA path's
    block loop would carry a row's whole chunk of queries to every page of its context (at a
    chunk of 2,048 tokens over a long continuation, bytes far beyond the K/V's)."""

    name = "pallas"
    prefill_attention = staticmethod(
        functools.partial(pallas_attention, queries_per_block=PALLAS_PREFILL_QUERIES_PER_BLOCK)
    )
    decode_attention = staticmethod(pallas_attention)
    trie_attention = staticmethod(trie_attention)

    def refusal(self, spec):
        # The kernel's page table is a TPU scalar-memory operand (see :mod:`smem`).
        if smem.max_rows_per_call(spec.max_table) == 0:
            return smem.page_table_error(spec.max_table)
        return super().refusal(spec)

    def decode_pages(self, spec, tables, rows, pos, left, steps):
        return steps, self.table(spec, tables, rows), page_lists([[]] * len(tables), rows, 1)

    def _decode_pages(self, slots):
        return slots.page_table


class DenseCpuBackend(TablesBackend):
    """The CPU path (:mod:`delta_jax.sampling.attention.dense_cpu`): page tables, gathered into
    views once per chunk; a prefill gathers each row's table once per layer."""

    name = "dense"
    prefill_attention = staticmethod(dense_cpu.dense_attention)

    def _widest(self, spec):
        # The CPU path gathers every table entry: the longest sequence, plus the columns a
        # speculative chunk's verify steps write past it.
        return spec.seq_pages + self._verify_pages(spec)

    def _verify_pages(self, spec):
        # A verify step writes ``k + 1`` columns of every sequence whatever it keeps.
        T = spec.draft_tokens + 1
        return pages_for(spec.steps * T, spec.page_size) if spec.draft_tokens else 0

    def decode_pages(self, spec, tables, rows, pos, left, steps):
        # Right-aligned views: the longest context plus the columns the chunk's steps write
        # (one per step; k + 1 per verify step) must fit in the views, as wide as the page
        # table; a chunk that would not fit in the widest table runs fewer steps.
        T = spec.draft_tokens + 1
        base = int(pos.max(initial=0))
        widest = (spec.seq_pages + self._verify_pages(spec)) * spec.page_size
        steps = max(1, min(steps, (widest - base) // T))
        return steps, self.table(spec, tables, rows), page_lists([[]] * len(tables), rows, 1)

    def begin_chunk(self, pool, slots, out, speculative=False):
        return dense_cpu.begin_chunk(
            pool, slots.active, slots.pos, slots.page_table, out, self.groups, speculative
        )

    def step(self, model, layers, slots, state: dense_cpu.ViewState):
        hidden, views = dense_cpu.decode_forward(
            model,
            layers,
            slots.last[:, None],
            slots.pos[:, None],
            slots.active[:, None],
            state.views,
            state.shift,
            self.groups,
        )
        return hidden, state._replace(views=views)

    def verify(self, model, layers, slots, ids, level, inside, valid, state: dense_cpu.ViewState):
        # Every sequence's tokens at the same columns; which of them later queries see is
        # settled by :meth:`kept` (the views' K/V of the others are never read).
        positions = slots.pos[:, None] + level
        hidden, views = dense_cpu.verify_forward(
            model, layers, ids, positions, inside, state.views, state.columns, self.groups
        )
        return hidden, state._replace(views=views)

    def kept(self, state: dense_cpu.ViewState, slots, path, taken, T, trie):
        # The kept columns become visible; the chunk's end writes them back in order.
        return state._replace(columns=dense_cpu.keep_columns(state.columns, path, taken, T))

    def write_verified(self, out, cols, slots, taken, first):
        return dense_cpu.write_verified(out, cols, slots.count - first, taken)

    def write(self, out, cols, slots, i):
        return dense_cpu.write_column(out, cols, i)

    def end_chunk(self, state, written, out, first, start, slots, keep):
        return dense_cpu.end_chunk(state, written, out, first, start, slots, keep, self.groups)


_BACKENDS: dict[str, Any] = {
    "xla": XlaBackend,
    "pallas": PallasBackend,
    "dense": DenseCpuBackend,
}
# The attention paths a sampler may name (``"auto"``: :func:`resolve_attention`).
NAMES = ("auto", *_BACKENDS)


# JAX's ragged paged attention kernel lays a head out on the 128 lanes of a TPU vector register.
KERNEL_HEAD_DIM_MULTIPLE = 128


def resolve_attention(attention: str, platform: str, head_dim: int = 128) -> str:
    """The path ``attention`` names on ``platform``: ``"auto"`` is the TPU kernel on TPU (the XLA
    path for a head size the kernel does not tile), the dense path on CPU and the XLA path
    elsewhere; a named path is itself (the kernel refuses such a head size in one line)."""
    tiles = head_dim % KERNEL_HEAD_DIM_MULTIPLE == 0
    if attention == "auto":
        return {"tpu": "pallas" if tiles else "xla", "cpu": "dense"}.get(platform, "xla")
    if attention == "pallas" and not tiles:
        raise ValueError(
            f"attention='pallas': the TPU kernel needs a head size that is a multiple of "
            f"{KERNEL_HEAD_DIM_MULTIPLE} (this model's: {head_dim}); use 'auto' or 'xla'"
        )
    return attention


def backend_for(attention: str, groups: Groups | None = None) -> PagedBackend:
    """The backend of an attention path (``EngineSpec.attention``: ``"xla"``, ``"pallas"`` or
    ``"dense"``) for programs in ``groups`` (the engine's mesh and the model's KV heads; the
    default, one group, is enough for the host methods)."""
    return _BACKENDS[attention](Groups() if groups is None else groups)
