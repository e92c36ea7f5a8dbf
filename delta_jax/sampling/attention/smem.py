"""The TPU scalar memory (SMEM) the ragged paged attention kernel's page table needs, and how many
decode slots one kernel call can take.

JAX's ``ragged_paged_attention`` kernel scalar-prefetches five operands into the TPU core's SMEM
(``pltpu.PrefetchScalarGridSpec``): ``kv_lens [B]``, the page table ``page_indices [B, W]``,
``cu_q_lens [B + 1]``, ``seq_buf_idx [2]`` and ``num_seqs [1]``, all int32. The TPU compiler lays
a 2-D int32 SMEM operand out in (8, 128) tiles and a 1-D one in 128-word tiles, and SMEM holds
1 MiB on v4, v5e, v5p and v6e, of which the kernel's register-allocator spill slots and the
compiler take 1,168 bytes. So a call over ``B`` slots with a page table ``W`` pages wide needs::

    4 * (ceil8(B) * ceil128(W) + ceil128(B) + ceil128(B + 1) + 128 + 128) + 1168  <=  2**20

Measured with libtpu 0.0.42.1, compile-only (``tests/sampling/test_smem.py`` checks the
boundary on the compiler itself: the largest ``B`` this allows compiles, one more is refused).
Qwen3-8B's paper recipe (22,528-token sequences in 16-token pages: a 2,048-page table) fits 120
slots per call; its 214 slots per data group did not (1,769,472 bytes of page table alone).
:func:`row_chunks` splits a group's slots into calls that each fit, so any ``decode_slots``
compiles; only a page table too wide for even 8 slots cannot (the engine refuses it first:
``PallasBackend.refusal``).
"""

from __future__ import annotations

import jax.numpy as jnp

SMEM_BYTES = 1 << 20  # per TensorCore, v4 / v5e / v5p / v6e (the compiler's "size=1048576")
SMEM_RESERVED = 1168  # spill slots (1,024) + the compiler's own (144): measured, see above
SUBLANES, LANES, WORD = 8, 128, 4


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def page_table_smem_bytes(rows: int, width: int) -> int:
    """SMEM bytes of one kernel call's scalar-prefetch operands (``rows`` slots, ``width`` pages
    per slot), the compiler's reserve included."""
    table = _up(rows, SUBLANES) * _up(width, LANES)
    vectors = _up(rows, LANES) + _up(rows + 1, LANES) + LANES + LANES  # lens, cu_q_lens, 2 + 1
    return WORD * (table + vectors) + SMEM_RESERVED


def max_rows_per_call(width: int, budget: int = SMEM_BYTES) -> int:
    """Most slots one kernel call can take with a ``width``-page table (a multiple of 8; 0: not
    even 8 fit)."""
    per_tile = WORD * SUBLANES * _up(width, LANES)  # 8 more slots: one more row of tiles
    rows = max(0, (budget - page_table_smem_bytes(0, width)) // per_tile * SUBLANES)
    while rows and page_table_smem_bytes(rows, width) > budget:  # the 1-D operands grow too
        rows -= SUBLANES
    return rows


def row_chunks(rows: int, width: int, budget: int = SMEM_BYTES) -> list[tuple[int, int]]:
    """``(start, size)`` slot ranges, one kernel call each, every one within the SMEM budget.

    Sizes are multiples of 8 (the table's tile rows) except the last, and as even as that allows,
    so the calls do about the same work.
    """
    most = max_rows_per_call(width, budget)
    if most == 0:
        raise ValueError(page_table_error(width))
    if rows <= most:
        return [(0, rows)]
    calls = -(-rows // most)
    size = _up(-(-rows // calls), SUBLANES)
    return [(start, min(size, rows - start)) for start in range(0, rows, size)]


def in_row_chunks(call, width: int, *per_row):
    """``call`` on each range of :func:`row_chunks` of the arrays ``per_row`` (one leading entry
    per slot, a ``width``-page table among them), its results joined along the slots."""
    chunks = row_chunks(per_row[0].shape[0], width)
    outs = [call(*(x[s : s + n] for x in per_row)) for s, n in chunks]
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)


def page_table_error(width: int) -> str:
    need = page_table_smem_bytes(SUBLANES, width)
    return (
        f"a page table {width} pages wide needs {need:,} bytes of TPU scalar memory for even 8 "
        f"decode slots (ragged paged attention kernel; {SMEM_BYTES:,} per core): raise "
        "rollout.page_size or shorten the sequences"
    )
