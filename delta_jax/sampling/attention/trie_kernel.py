"""A verify step's trie of drafts on TPU: paged attention with each query's ancestors as its mask.

JAX's ragged paged attention kernel masks causally; a trie's node must see the sequence before
the step and its own ancestors among the step's positions only. This Pallas TPU kernel splits
the keys the same way:

* the *prefix* (the positions before the step, the bulk of the K/V): read from the pages in
  blocks of ``KV_PAGES_PER_BLOCK`` pages, each block's copy from HBM started while the one
  before it is attended to (and the next slot's first block while a slot's last one is), every
  query seeing every position below the slot's length;
* the step's *own* ``T`` positions: gathered from the pages they were just written to (a few
  rows per slot), each query seeing the positions its mask marks.

Both fold into one online softmax (float32 running max, sum and output per query row), as a
flash attention's blocks do. Queries are grouped by KV head: the ``G`` query heads of a KV head
at each of the ``T`` positions are one block of ``T G`` rows (padded to the sublane tile), so
one matmul scores them all against a block of keys.

The pool's layout interleaves keys and values (``[pages, page_size, 2K, D]``, keys even);
a block is loaded per KV head with a strided read. A 16-bit pool packs each key with its value
in one 32-bit word: the kernel reads the words and splits them (the key in the low half).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float, Int

from delta_jax.sampling.attention import smem
from delta_jax.sampling.attention.paged import write_slots

__all__ = ["KV_PAGES_PER_BLOCK", "trie_attention"]

KV_PAGES_PER_BLOCK = 16
_MASKED = -1e30  # finite: a row that has seen no key yet keeps exp(0 - 0) sums of zero weight


def trie_attention(
    q: Float[Array, "B T N D"],
    kv: Float[Array, "P S C D"],
    positions: Int[Array, "B T"],
    valid: Bool[Array, "B T"],
    page_table: Int[Array, "B NB"],
    inside: Bool[Array, "B T T"],
) -> Float[Array, "B T N D"]:
    """Attention of a verify step's ``T`` positions per slot (consecutive, from
    ``positions[:, 0]``, their K/V already in the pages): query ``t`` attends to every position
    before the step and to the step's positions ``u`` with ``inside[:, t, u]`` (its ancestors
    and itself) that are ``valid``. An idle slot (``valid[:, 0]`` false) reads no page; its
    output is the caller's to discard."""
    B, T, N, D = q.shape
    _, page_size, C, _ = kv.shape
    K = C // 2
    G = N // K
    prefix = jnp.where(valid[:, 0], positions[:, 0], 0).astype(jnp.int32)
    # The step's own K/V, from where they were written ([B, T, 2K, D]; invalid: the scratch
    # page, and masked).
    own = kv[write_slots(positions, valid, page_size, page_table=page_table)]
    Tp = -(-T // 8) * 8  # whole sublane tiles
    own = jnp.pad(own, ((0, 0), (0, Tp - T), (0, 0), (0, 0))).reshape(B, Tp * C, D)
    # Rows (t, g) of each KV head, padded to whole sublane tiles of the query's dtype.
    R = T * G
    Rp = -(-R // _sublanes(q.dtype)) * _sublanes(q.dtype)
    rows = q.reshape(B, T, K, G, D).transpose(0, 2, 1, 3, 4).reshape(B, K, R, D)
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, Rp - R), (0, 0)))
    sees = inside & valid[:, None, :] & jnp.tril(jnp.ones((T, T), bool))  # [B, t, u]
    sees = jnp.pad(jnp.repeat(sees, G, axis=1), ((0, 0), (0, Rp - R), (0, Tp - T)))
    sees = sees.astype(jnp.int32)  # [B, Rp, Tp]: rows (t, g), own positions u

    # The page table is a scalar-memory operand: slots go through in calls that each fit it.
    call = functools.partial(_call, kv)
    out = smem.in_row_chunks(call, page_table.shape[1], rows, own, sees, prefix, page_table)
    out = out[:, :, :R].reshape(B, K, T, G, D).transpose(0, 2, 1, 3, 4)
    return out.reshape(B, T, N, D)


def _sublanes(dtype) -> int:
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _call(kv, rows, own, sees, prefix, page_table):
    B, K, Rp, D = rows.shape
    _, page_size, C, _ = kv.shape
    per_block = min(KV_PAGES_PER_BLOCK, page_table.shape[1])
    kernel = functools.partial(_kernel, page_size=page_size, per_block=per_block, scale=D**-0.5)
    slot = lambda s, *_: (s, 0, 0, 0)  # noqa: E731
    slot3 = lambda s, *_: (s, 0, 0)  # noqa: E731
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(rows.shape, rows.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B,),
            in_specs=[
                pl.BlockSpec((1, K, Rp, D), slot),
                pl.BlockSpec((1, *own.shape[1:]), slot3),
                pl.BlockSpec((1, *sees.shape[1:]), slot3),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec((1, K, Rp, D), slot),
            scratch_shapes=[
                pltpu.VMEM((2, per_block, page_size, C, D), kv.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((1,), jnp.int32),
            ],
        ),
        # Sequential: a slot's last block starts the copy of the next slot's first.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        name="trie_attention",
    )(prefix, page_table, rows, own, sees, kv)


def _kernel(
    prefix_ref,  # SMEM [B]: positions before the step
    table_ref,  # SMEM [B, NB]
    q_ref,  # [1, K, Rp, D]
    own_ref,  # [1, Tp C, D]: the step's own K/V
    sees_ref,  # [1, Rp, Tp]: which own positions each query row sees
    kv_hbm,  # [P, page_size, C, D] in HBM
    o_ref,  # [1, K, Rp, D]
    buf,  # VMEM [2, per_block, page_size, C, D]
    sem,  # DMA [2]
    parity,  # SMEM [1]: the buffer the slot's first block is in
    *,
    page_size: int,
    per_block: int,
    scale: float,
):
    s, slots = pl.program_id(0), pl.num_programs(0)
    _, K, Rp, D = q_ref.shape
    C = 2 * K
    tokens = per_block * page_size
    blocks = _Blocks(prefix_ref, table_ref, kv_hbm, buf, sem, per_block, tokens)

    def start_next_slot(which):
        @pl.when((s + 1 < slots) & (blocks.count(jnp.minimum(s + 1, slots - 1)) > 0))
        def _():
            blocks.start(s + 1, 0, which)

    @pl.when(s == 0)
    def _():
        parity[0] = 0

        @pl.when(blocks.count(0) > 0)
        def _():
            blocks.start(0, 0, 0)

    first, n = parity[0], blocks.count(s)
    queries = [q_ref[0, h].astype(buf.dtype) for h in range(K)]
    init = [_no_keys_seen(Rp, D) for _ in range(K)]

    def block(b, state):
        which = (first + b) % 2
        blocks.wait(s, b, which)

        @pl.when(b + 1 < n)
        def _():
            blocks.start(s, b + 1, 1 - which)

        @pl.when(b + 1 == n)
        def _():
            start_next_slot(1 - which)

        flat = buf.at[which].reshape(tokens * C, D)
        col = jax.lax.broadcasted_iota(jnp.int32, (Rp, tokens), 1)
        seen = b * tokens + col < prefix_ref[s]
        return [
            _fold(st, queries[h], *_head(flat, h, C, tokens), seen, scale)
            for h, st in enumerate(state)
        ]

    state = jax.lax.fori_loop(0, n, block, init)

    @pl.when(n == 0)
    def _():
        start_next_slot(first)

    parity[0] = (first + n) % 2
    own = own_ref.at[0]
    Tp = own.shape[0] // C
    for h in range(K):
        keys, values = _head(own, h, C, Tp)
        _, total, acc = _fold(state[h], queries[h], keys, values, sees_ref[0] != 0, scale)
        o_ref[0, h] = (acc / jnp.where(total > 0, total, 1.0)).astype(o_ref.dtype)


def _no_keys_seen(rows: int, D: int):
    """One KV head's online-softmax state before any key: running max, sum and output."""
    return (
        jnp.full((rows, 1), _MASKED, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, D), jnp.float32),
    )


class _Blocks:
    """A slot's prefix in blocks of ``per_block`` pages (``tokens`` positions), copied from the
    pool in HBM into one of two VMEM buffers."""

    def __init__(self, prefix_ref, table_ref, kv_hbm, buf, sem, per_block: int, tokens: int):
        self.prefix, self.table, self.kv, self.buf, self.sem = (
            prefix_ref,
            table_ref,
            kv_hbm,
            buf,
            sem,
        )
        self.per_block, self.tokens = per_block, tokens

    def count(self, slot):
        return (self.prefix[slot] + self.tokens - 1) // self.tokens

    def _copies(self, slot, block, which):
        last = self.table.shape[1] - 1
        return [
            pltpu.make_async_copy(
                self.kv.at[self.table[slot, jnp.minimum(block * self.per_block + i, last)]],
                self.buf.at[which, i],
                self.sem.at[which],
            )
            for i in range(self.per_block)
        ]

    def start(self, slot, block, which):
        for c in self._copies(slot, block, which):
            c.start()

    def wait(self, slot, block, which):
        for c in self._copies(slot, block, which):
            c.wait()


def _head(flat, h: int, C: int, tokens: int):
    """KV head ``h``'s keys and values ``[tokens, D]`` from interleaved rows ``[tokens C, D]``."""
    if flat.dtype.itemsize == 4:
        return flat[pl.ds(2 * h, tokens, stride=C), :], flat[pl.ds(2 * h + 1, tokens, stride=C), :]
    # 16-bit: rows 2h and 2h + 1 of a token share one 32-bit word (the key in the low half);
    # each half shifted to the top of a word is that value as a float32, exactly.
    words = flat.bitcast(jnp.uint32)[pl.ds(h, tokens, stride=C // 2), :]
    keys = pltpu.bitcast(words << 16, jnp.float32).astype(flat.dtype)
    values = pltpu.bitcast(words & jnp.uint32(0xFFFF0000), jnp.float32).astype(flat.dtype)
    return keys, values


def _fold(state, q, keys, values, seen, scale: float):
    """One block of keys folded into a query block's running max, sum and output (matmuls in
    the pool's dtype, accumulated in float32, as the XLA path's)."""
    m, total, acc = state
    scores = jax.lax.dot_general(
        q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    scores = jnp.where(seen, scores * scale, _MASKED)
    new = jnp.maximum(m, jnp.max(scores, axis=1, keepdims=True))
    weights = jnp.where(seen, jnp.exp(scores - new), 0.0)
    alpha = jnp.exp(m - new)
    total = alpha * total + jnp.sum(weights, axis=1, keepdims=True)
    pv = jnp.dot(weights.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return new, total, alpha * acc + pv
