"""Paged KV cache: a page pool per layer, a host-side page allocator and the paged forward pass.

Every layer keeps its keys and values in one pool of ``num_pages`` fixed-size pages laid out as
JAX's ragged paged attention kernel reads them, ``[pages, page_size, 2K, D]`` with keys in the
even and values in the odd combined heads. A sequence owns a *page table*, the list of pages that
hold its positions ``0, page_size, 2 page_size, ...``. Page 0 is a scratch page: padding tokens
write there and unused page-table entries point there, so no real page is ever touched by them.

The forward pass (:func:`paged_forward`) takes ``T`` tokens per sequence at given positions,
writes their K/V into the pages those positions fall in, and attends over the sequence's pages:

* ``xla``: a gather of the sequence's first ``NB`` pages (``NB`` the page-table width of the
  call, bucketed by the caller to the longest live sequence), so the work grows with the actual
  lengths, not with the pool; used on CPU and GPU, and for prefill everywhere;
* ``pallas``: JAX's ``ragged_paged_attention`` TPU kernel (one query per sequence, decode), under
  ``shard_map`` over the KV-head axis.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import flax.struct
import jax
import jax.numpy as jnp
from flax.core import spmd
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from delta_jax.models import Transformer
from delta_jax.models import axes as ax
from delta_jax.models.transformer import _attention, _rms_norm, _rope, _rope_tables

__all__ = ["PAGE_AXES", "PageAllocator", "PagePool", "init_pool", "paged_forward"]

# Logical axes of a layer's pages: only the KV heads are sharded (tensor parallel).
PAGE_AXES = (None, None, ax.KV_HEADS, ax.HEAD_DIM)
SCRATCH_PAGE = 0
# Ragged paged attention kernel blocks: KV pages and queries (sequences, at decode) per block.
PALLAS_KV_PAGES_PER_BLOCK = 16
PALLAS_QUERIES_PER_BLOCK = 32

Attention = Literal["xla", "pallas"]


@flax.struct.dataclass
class PagePool:
    """K/V pages of every layer: a tuple of L arrays ``[pages, page_size, 2K, D]``."""

    kv: tuple[Float[Array, "P S C D"], ...]

    @property
    def page_size(self) -> int:
        return self.kv[0].shape[1]


def init_pool(model: Transformer, num_pages: int, page_size: int, dtype: Any) -> PagePool:
    """An all-zero pool (call inside ``jit`` so that it is created sharded, never on one host)."""
    c = model.config
    shape = (num_pages, page_size, 2 * c.num_kv_heads, c.head_dim)
    return PagePool(
        kv=tuple(ax.constrain(jnp.zeros(shape, dtype), PAGE_AXES) for _ in range(c.num_layers))
    )


class PageAllocator:
    """Free list of the pool's pages (host side); page 0 is the scratch page, never handed out.

    Attributes:
      num_pages: pages in the pool, scratch included.
      high_water: the most pages ever in use at once since construction.
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))
        self.high_water = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def alloc(self, count: int) -> list[int] | None:
        """``count`` pages, or None (nothing taken) when fewer are free."""
        if count > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(count)]
        self.high_water = max(self.high_water, self.num_used)
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


def _write_pages(
    kv: Float[Array, "P S C D"],
    new: Float[Array, "B T C D"],
    positions: Int[Array, "B T"],
    valid: Bool[Array, "B T"],
    page_table: Int[Array, "B NB"],
) -> jax.Array:
    """Scatters each valid token's combined K/V into its page; padding goes to the scratch page."""
    page_size = kv.shape[1]
    logical = jnp.minimum(positions // page_size, page_table.shape[1] - 1)
    page = jnp.where(valid, jnp.take_along_axis(page_table, logical, axis=1), SCRATCH_PAGE)
    offset = positions % page_size
    flat = new.reshape(-1, *new.shape[2:]).astype(kv.dtype)
    return kv.at[page.reshape(-1), offset.reshape(-1)].set(flat, mode="drop")


def _xla_attention(q, kv, positions, page_table):
    """Attention of q [B,T,N,D] over the first NB pages of each sequence (gathered)."""
    B, NB = page_table.shape
    ctx = kv[page_table].reshape(B, NB * kv.shape[1], *kv.shape[2:])  # [B, L, 2K, D]
    k = jnp.swapaxes(ctx[:, :, 0::2], 1, 2)  # [B, K, L, D]
    v = jnp.swapaxes(ctx[:, :, 1::2], 1, 2)
    mask = jnp.arange(ctx.shape[1])[None, None, :] <= positions[:, :, None]
    return _attention(q, k.astype(q.dtype), v.astype(q.dtype), mask)


def _pallas_attention(q, kv, positions, page_table, mesh: Mesh | None):
    """Decode attention (T = 1) with JAX's ragged paged attention TPU kernel."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    B, T, N, D = q.shape
    if T != 1:
        raise ValueError(f"the pallas paged attention path is for decode (T = 1), got T = {T}")
    kv_lens = (positions[:, 0] + 1).astype(jnp.int32)
    cu_q_lens = jnp.arange(B + 1, dtype=jnp.int32)
    num_seqs = jnp.array([B], jnp.int32)

    def kernel(q, kv, kv_lens, page_table, cu_q_lens, num_seqs):
        # Block sizes given explicitly: the kernel's tuned table looks up jax.devices(), which
        # is not the target TPU when compiling ahead of time for a topology.
        return ragged_paged_attention(
            q,
            kv,
            kv_lens,
            page_table,
            cu_q_lens,
            num_seqs,
            sm_scale=D**-0.5,
            num_kv_pages_per_block=min(page_table.shape[1], PALLAS_KV_PAGES_PER_BLOCK),
            num_queries_per_block=PALLAS_QUERIES_PER_BLOCK,
        )

    if mesh is not None:
        # Mosaic kernels are not partitioned by XLA: one kernel per KV-head shard, every
        # sequence on every shard (heads are what tensor parallelism splits).
        heads = ax.logical_to_mesh((ax.KV_HEADS,), spmd.get_logical_axis_rules(), mesh)[0]
        kernel = jax.shard_map(
            kernel,
            mesh=mesh,
            in_specs=(P(None, heads, None), P(None, None, heads, None), P(), P(), P(), P()),
            out_specs=P(None, heads, None),
            check_vma=False,
        )
    out = kernel(q.reshape(B, N, D), kv, kv_lens, page_table, cu_q_lens, num_seqs)
    return out.reshape(B, T, N, D)


def _paged_block(cfg, dtype, p, x, cos, sin, kv, positions, valid, page_table, attend):
    """One decoder block (the maths of ``transformer._block``) with paged K/V."""
    eps = cfg.rms_norm_eps
    w = {k: v.astype(dtype) for k, v in p.items()}
    h = _rms_norm(x, w["attn_norm"], eps, dtype)
    q = jnp.einsum("BTH,HND->BTND", h, w["wq"])
    k = jnp.einsum("BTH,HKD->BTKD", h, w["wk"])
    v = jnp.einsum("BTH,HKD->BTKD", h, w["wv"])
    if cfg.qkv_bias:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    if cfg.qk_norm:
        q = _rms_norm(q, w["q_norm"], eps, dtype)
        k = _rms_norm(k, w["k_norm"], eps, dtype)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    B, T, K, D = k.shape
    combined = jnp.stack([k, v], axis=3).reshape(B, T, 2 * K, D)  # keys even, values odd
    kv = _write_pages(kv, combined, positions, valid, page_table)
    attn = attend(q, kv, positions, page_table)
    N = attn.shape[2]
    x = x + jnp.einsum("BTE,EH->BTH", attn.reshape(B, T, N * D), w["wo"].reshape(N * D, -1))
    h = _rms_norm(x, w["mlp_norm"], eps, dtype)
    gate = jnp.einsum("BTH,HF->BTF", h, w["w_gate"])
    up = jnp.einsum("BTH,HF->BTF", h, w["w_up"])
    x = x + jnp.einsum("BTF,FH->BTH", jax.nn.silu(gate) * up, w["w_down"])
    return x, kv


def paged_forward(
    model: Transformer,
    layers: list[dict[str, jax.Array]],
    ids: Int[Array, "B T"],
    positions: Int[Array, "B T"],
    valid: Bool[Array, "B T"],
    page_table: Int[Array, "B NB"],
    pool: PagePool,
    *,
    attention: Attention = "xla",
    mesh: Mesh | None = None,
) -> tuple[Float[Array, "B T H"], PagePool]:
    """Runs the decoder on ``T`` tokens per sequence over its pages.

    Token ``(b, t)`` is written at ``positions[b, t]`` (when ``valid``) and attends to positions
    ``<= positions[b, t]`` of its sequence, which must all have been written before or in this
    call. ``page_table[b]`` lists the sequence's pages from position 0 on (unused entries 0).

    Returns:
      The final RMS-normed hidden states [B, T, H] and the updated pool.
    """
    cfg, dtype = model.config, model.dtype
    if attention == "pallas":
        attend = functools.partial(_pallas_attention, mesh=mesh)
    else:
        attend = _xla_attention
    x = jnp.take(model.embed[...], ids, axis=0).astype(dtype)
    x = ax.constrain(x, (ax.BATCH, ax.LENGTH, ax.EMBED))
    cos, sin = _rope_tables(cfg, positions, dtype)
    new = []
    for layer, kv in enumerate(pool.kv):
        x, kv = _paged_block(
            cfg, dtype, layers[layer], x, cos, sin, kv, positions, valid, page_table, attend
        )
        new.append(ax.constrain(kv, PAGE_AXES))
    hidden = _rms_norm(x, model.final_norm[...], cfg.rms_norm_eps, dtype)
    return hidden, PagePool(kv=tuple(new))
