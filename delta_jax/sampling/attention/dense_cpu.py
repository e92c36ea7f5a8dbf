"""The dense CPU path of the continuous engine: what only XLA:CPU needs, in one place.

XLA:CPU runs a decode step of a small batch as a few dozen small ops, where per-op overheads
dominate. This path turns the paged pool into the static sampler's contiguous cache once per
decode chunk and decodes on that:

* *views*: every sequence's page-table pages gathered once per chunk into contiguous keys
  ``[B, K, D, W]`` and values ``[B, K, W, D]`` per layer (``W = NB * page_size``), the static
  sampler's cache layout, right-aligned as its left-padded cache is: sequence ``b``'s position
  ``p`` sits in column ``p + shift[b]``, so that every sequence feeds its next token at the same
  column and a step writes one column of all of them (a dynamic-update-slice, not a scatter at
  per-sequence positions); the steps attend with the static sampler's slot attention;
* the chunk's K/V are written back into the pages once, at its end (:func:`views_to_pages`),
  only when a sequence may read them again;
* the chunk's outputs are collected in chunk-local ``[slots, gen_len]`` buffers, written by one
  dynamic-update-slice per field and step, and scattered into the request's buffers once at its
  end (per step a scatter at each slot's row and token index costs XLA:CPU more than the step);
* a prefill chunk gathers each row's table pages once per layer and attends in one batched
  attention (:func:`dense_attention`), where the XLA path's page-block loop runs many small steps.

The views are this path's state only: the pool
(:class:`~delta_jax.sampling.attention.paged.PagePool`) holds pages, nothing else.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from delta_jax.models import Transformer
from delta_jax.models import axes as ax
from delta_jax.models.attention import slot_attention
from delta_jax.sampling.attention.paged import Groups, PagePool, combined, write_rows

__all__ = [
    "Columns",
    "ViewState",
    "Views",
    "begin_chunk",
    "decode_forward",
    "dense_attention",
    "dense_views",
    "end_chunk",
    "keep_columns",
    "slices_layers_once",
    "view_attention",
    "verify_forward",
    "view_mask",
    "views_to_pages",
    "write_column",
    "write_verified",
    "write_views",
]


def slices_layers_once(mesh) -> bool:
    """Whether both engines slice each layer's weights once per call instead of at every
    decode step: on CPU (XLA:CPU does not reliably hoist the slices out of the loop).
    Accelerators fuse the slices into the matmuls for free, where a copy would hold every
    weight twice."""
    return (jax.devices() if mesh is None else mesh.devices.flat)[0].platform == "cpu"


# Per layer: keys [B, K, D, W] and values [B, K, W, D].
Views = tuple[tuple[Float[Array, "B K D W"], Float[Array, "B K W D"]], ...]


def dense_views(pool: PagePool, page_table, shift, groups: Groups) -> Views:
    """Every sequence's table pages gathered once into contiguous key and value views in the
    static sampler's cache layout, sequence ``b``'s position ``p`` in column ``p + shift[b]``
    (right-aligned, see the module docstring).

    XLA:CPU runs a decode step of a small batch as a few dozen small ops, and gathering the
    pages at every step (plus transposing them to batch-leading layouts for the dots) costs
    more than the attention itself; gathered once per chunk, a step only writes its new K/V
    into the views and attends with the static sampler's attention. Unused table entries point
    at the scratch page and are masked like positions past the query.
    """

    specs = ("R-H-", "R-", "R")
    gather = groups(_gather_views, specs, ("RH--", "RH--"))
    return tuple(gather(kv, page_table, shift) for kv in pool.kv)


def _gather_views(kv, table, shift=None):
    """Every sequence's table pages as contiguous keys ``[B, K, D, L]`` and values
    ``[B, K, L, D]`` (``L = NB * page_size``), the static sampler's cache layout; with
    ``shift [B]``, position ``p`` of sequence ``b`` in column ``p + shift[b]`` (one gather of
    positions; columns before ``shift[b]`` hold position 0 and are never visible)."""
    B, NB = table.shape
    _, page_size, C, D = kv.shape
    L = NB * page_size
    if shift is None:
        ctx = jnp.take(kv, table, axis=0, mode="clip").reshape(B, L, C, D)
    else:
        pos = jnp.clip(jnp.arange(L)[None, :] - shift[:, None], 0, L - 1)  # [B, L]
        flat = jnp.take_along_axis(table, pos // page_size, axis=1) * page_size + pos % page_size
        ctx = jnp.take(kv.reshape(-1, C, D), flat, axis=0, mode="clip")  # [B, L, C, D]
    ctx = ctx.reshape(B, L, C // 2, 2, D)
    keys = jnp.transpose(ctx[..., 0, :], (0, 2, 3, 1))  # [B, K, D, L]
    return keys, jnp.swapaxes(ctx[..., 1, :], 1, 2)  # [B, K, L, D]


def views_to_pages(
    pool: PagePool,
    views: Views,
    page_table,
    start,
    end,
    columns,
    groups: Groups,
) -> PagePool:
    """The write-back, once per chunk: positions ``[start[b], end[b])`` of
    sequence ``b`` (those its steps wrote; position ``p`` in column ``columns[b, p]``, ``[B,
    NB * page_size]``) from its views into its pages; nothing else is written (shared prompt
    pages, other positions and the scratch page keep their contents).

    Writing each step's K/V into the pages as well made XLA:CPU copy a layer's pool share at
    every step of the loop; the views are what the steps read, the pages what later chunks
    gather and the prefill continues.
    """

    def write(kv, keys, values, table, start, end, columns):
        page_size, L = kv.shape[1], keys.shape[-1]
        pos = jnp.arange(table.shape[1] * page_size)
        new = combined(jnp.einsum("BKDL->BLKD", keys), jnp.einsum("BKLD->BLKD", values))
        cols = jnp.clip(columns, 0, L - 1)  # [B, NB * page_size]
        new = jnp.take_along_axis(new, cols[:, :, None, None], axis=1)
        written = (pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])
        page = jnp.where(written, table[:, pos // page_size], kv.shape[0])  # else dropped
        offset = jnp.broadcast_to(pos % page_size, page.shape)
        return kv.at[page, offset].set(new.astype(kv.dtype), mode="drop")

    specs = ("R-H-", "RH--", "RH--", "R-", "R", "R", "R-")
    write = groups(write, specs, "R-H-")
    kv = tuple(
        write(kv, keys, values, page_table, start, end, columns)
        for kv, (keys, values) in zip(pool.kv, views, strict=True)
    )
    return PagePool(kv=kv)


def view_attention(q, keys, values, visible):
    """Attention of ``q [B, T, N, D]`` over contiguous views (the new K/V already written),
    each query over the columns ``visible [B, T, L]`` marks."""
    return slot_attention(q, keys.astype(q.dtype), values.astype(q.dtype), visible)


def view_mask(shift: Int[Array, " B"], columns: Int[Array, " B"], width: int):
    """``[B, 1, width]``: the view columns a decode query of sequence ``b`` sees, its positions
    from column ``shift[b]`` up to its own column ``columns[b]``."""
    j = jnp.arange(width)[None, None, :]
    return (j >= shift[:, None, None]) & (j <= columns[:, None, None])


def write_views(keys, values, k, v, col):
    """Writes every sequence's new K and V ``[B, 1, K, D]`` at column ``col`` of the
    right-aligned views (one dynamic-update-slice each)."""
    keys = jax.lax.dynamic_update_slice_in_dim(
        keys, jnp.einsum("BTKD->BKDT", k).astype(keys.dtype), col, axis=3
    )
    values = jax.lax.dynamic_update_slice_in_dim(
        values, jnp.einsum("BTKD->BKTD", v).astype(values.dtype), col, axis=2
    )
    return keys, values


def dense_attention(
    q: Float[Array, "B T N D"],
    kv: Float[Array, "P S C D"],
    positions: Int[Array, "B T"],
    valid: Bool[Array, "B T"],
    table: Int[Array, "B NB"],
) -> Float[Array, "B T N D"]:
    """The paged attention of the CPU path's prefill (the backends' one signature): each row's
    table pages gathered once, one batched attention of every query over the positions up to
    its own."""
    keys, values = _gather_views(kv, table)
    visible = jnp.arange(keys.shape[-1])[None, None, :] <= positions[:, :, None]
    return view_attention(q, keys, values, visible)


def decode_forward(
    model: Transformer,
    layers,
    ids: Int[Array, "B 1"],
    positions: Int[Array, "B 1"],
    valid: Bool[Array, "B 1"],
    views: Views,
    view_shift: Int[Array, " B"],
    groups: Groups,
) -> tuple[Float[Array, "B 1 H"], Views]:
    """One decode step on the views: token ``b`` is written and attends at column
    ``positions[b] + view_shift[b]``, the same for every live sequence; it sees its own
    positions (from column ``view_shift[b]`` on) up to that one."""
    if ids.shape[1] != 1:
        raise ValueError(f"the dense paged attention path is for decode (T = 1), got {ids.shape}")
    columns = positions[:, 0] + view_shift
    col = jnp.max(jnp.where(valid[:, 0], columns, 0))
    visible = view_mask(view_shift, columns, views[0][0].shape[-1])
    return _forward_on_views(model, layers, ids, positions, views, visible, col, groups)


class Columns(NamedTuple):
    """Where a speculative chunk's verify steps write in the views. A verify step writes the
    ``T`` tokens it scores of every sequence at the same columns ``[at, at + T)``; the columns
    of the tokens it keeps become visible to later queries, the others are never read (and
    the next step writes after them), so a sequence's positions fill its views in order, with
    gaps."""

    seen: Bool[Array, "B W"]  # the columns each sequence's later queries see
    base: Int[Array, ""]  # the chunk's first new column
    at: Int[Array, ""]  # the next verify step's first column


def verify_forward(
    model: Transformer,
    layers,
    ids: Int[Array, "B T"],
    positions: Int[Array, "B T"],
    inside: Bool[Array, "B T T"] | None,
    views: Views,
    columns: Columns,
    groups: Groups,
) -> tuple[Float[Array, "B T H"], Views]:
    """A speculative verify step on the views: every sequence's ``T`` tokens (at ``positions``,
    for the rotary embedding) written at columns ``[at, at + T)``, token ``t`` seeing its
    sequence's kept columns and the step's columns ``at + u`` where ``inside[b, t, u]`` (its
    ancestors in a trie of drafts; None, a line: ``u <= t``)."""
    W, T = views[0][0].shape[-1], ids.shape[1]
    u = jnp.arange(W)[None, None, :] - columns.at  # the step's position a column holds
    if inside is None:
        step = (u >= 0) & (u <= jnp.arange(T)[None, :, None])
    else:
        step = jnp.take_along_axis(inside, jnp.clip(u, 0, T - 1), axis=2) & (u >= 0) & (u < T)
    visible = columns.seen[:, None, :] | step
    return _forward_on_views(model, layers, ids, positions, views, visible, columns.at, groups)


def keep_columns(columns: Columns, path: Int[Array, "B L"], taken: Int[Array, " B"], T: int):
    """After a verify step of ``T`` columns that kept each sequence's first ``taken`` positions
    of ``path`` (ascending: a trie's parents come before their children)."""
    cols = jnp.where(jnp.arange(path.shape[1]) < taken[:, None], columns.at + path, -1)
    j = jnp.arange(columns.seen.shape[1])
    kept = jnp.any(j[None, :, None] == cols[:, None, :], axis=2)  # [B, W]
    return Columns(columns.seen | kept, columns.base, columns.at + T)


def _forward_on_views(model, layers, ids, positions, views, visible, col, groups: Groups):
    """The decoder on the views: each layer writes the tokens' K/V at columns ``col`` on (the
    same for every sequence) and attends over the ``visible [B, T, W]`` columns."""

    def write_and_attend(keys, values, k, v, q, visible, col):
        keys, values = write_views(keys, values, k, v, col)
        return view_attention(q, keys, values, visible), (keys, values)

    specs = ("RH--", "RH--", "R-H-", "R-H-", "R-H-", "R--", "")
    outs = ("R-H-", ("RH--", "RH--"))
    group = groups(write_and_attend, specs, outs)

    def attend(q, k, v, layer_views):
        return group(*layer_views, k, v, q, visible, col)

    hidden, new = model.forward_with(ids, positions, attend, list(views), layers)
    return hidden, tuple(new)


class ViewState(NamedTuple):
    """A decode chunk's state on this path: the pool (written to at the chunk's end only), the
    views, each sequence's ``shift`` and, in a speculative chunk, its :class:`Columns`."""

    pool: PagePool
    views: Views
    shift: Int[Array, " B"]
    columns: Columns | None = None


def begin_chunk(
    pool: PagePool,
    active,
    pos,
    page_table,
    out,
    groups: Groups,
    speculative: bool = False,
) -> tuple[ViewState, dict[str, Array]]:
    """A decode chunk's start: the right-aligned views and chunk-local output buffers
    ``[slots, gen_len]``. Every live slot feeds its next token at column ``base`` (the longest
    context), so a step writes one column of all of them; the host sized the page table for
    ``base`` plus the chunk's steps (times the tokens a verify step scores).

    Returns:
      The chunk's :class:`ViewState` (with the :class:`Columns` of a ``speculative`` chunk)
      and the chunk-local buffers.
    """
    base = jnp.max(jnp.where(active, pos, 0))
    shift = jnp.where(active, base - pos, 0)
    views = dense_views(pool, page_table, shift, groups)
    S, G = active.shape[0], out["tokens"].shape[1]
    local = {
        name: ax.constrain(
            jnp.zeros((S, G, *buf.shape[2:]), buf.dtype), (ax.BATCH,) + (None,) * (buf.ndim - 1)
        )
        for name, buf in out.items()
    }
    if not speculative:
        return ViewState(pool, views, shift), local
    j = jnp.arange(views[0][0].shape[-1])[None, :]
    seen = (j >= shift[:, None]) & (j < base)
    return ViewState(pool, views, shift, Columns(seen, base, base)), local


def write_column(local, cols, i):
    """Step ``i``'s outputs of every slot into column ``i`` of the chunk-local buffers."""

    def write(buf, col):
        return jax.lax.dynamic_update_slice_in_dim(buf, col[:, None].astype(buf.dtype), i, 1)

    return {name: write(local[name], col) for name, col in cols.items()}


def write_verified(local, cols, at, taken):
    """A verify step's outputs ``cols`` (``[S, T]`` per slot) into the chunk-local buffers:
    slot ``s``'s first ``taken[s]`` from its column ``at[s]`` on (the rest dropped)."""
    S, T = cols["tokens"].shape
    j = jnp.arange(T)[None, :]
    index = jnp.where(j < taken[:, None], at[:, None] + j, local["tokens"].shape[1])
    rows = jnp.arange(S)[:, None]

    def write(buf, col):
        return buf.at[rows, index].set(col.astype(buf.dtype), mode="drop")

    return {name: write(local[name], col) for name, col in cols.items()}


def end_chunk(state: ViewState, local, out, first, start, slots, keep, groups: Groups):
    """A decode chunk's end: the chunk-local outputs into the request's buffers (slot ``s``'s
    first ``count[s] - first[s]`` columns, its live steps, at its row from its token index
    ``first[s]`` on; the rest is dropped), and the chunk's K/V into the pages when ``keep``
    (a sequence may read them again: one still live, or a resumable one). ``state.columns``:
    the :class:`Columns` of a speculative chunk, None for one of decode steps.

    Returns:
      The pool and the output buffers.
    """
    S, G = local["tokens"].shape
    j = jnp.arange(G)[None, :]
    live = j < (slots.count - first)[:, None]
    rows = jnp.where(live, slots.row[:, None], out["tokens"].shape[0])  # else dropped
    cols = first[:, None] + j
    values = {name: buf.reshape(S * G, *buf.shape[2:]) for name, buf in local.items()}
    out = write_rows(out, rows.reshape(-1), cols.reshape(-1), values, groups)
    pool, views, shift, columns = state
    P = slots.page_table.shape[1] * pool.page_size
    if columns is None:  # position p in column p + shift
        where = jnp.arange(P)[None, :] + shift[:, None]
    else:  # the chunk's positions in its kept columns, in order
        where = _kept_columns(columns, start, P)
    pool = jax.lax.cond(
        keep,
        lambda pool: views_to_pages(pool, views, slots.page_table, start, slots.pos, where, groups),
        lambda pool: pool,
        pool,
    )
    return pool, out


def _kept_columns(columns: Columns, start, P: int):
    """``[B, P]``: the column of each position from ``start[b]`` on (the chunk's), the ``r``-th
    kept column from ``base`` on holding position ``start[b] + r``."""
    W = columns.seen.shape[1]
    new = columns.seen & (jnp.arange(W)[None, :] >= columns.base)
    kept = jnp.cumsum(new, axis=1)  # [B, W]: kept columns up to each
    rank = jnp.arange(P)[None, :] - start[:, None] + 1  # [B, P]
    return jax.vmap(lambda c, r: jnp.searchsorted(c, r, side="left"))(kept, rank)
