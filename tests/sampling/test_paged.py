"""The XLA and dense (CPU) paged attention paths against a NumPy float64 oracle."""

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax.sampling.attention import dense_cpu, paged


def _oracle(q, kv, positions, tables, page_size, inside=None, valid=None):
    """Each query over its sequence's keys at positions <= its own (GQA), in float64; with
    ``inside [B, T, T]`` (a trie: the call's positions consecutive from ``positions[:, 0]``),
    over the positions before the call and the call's ``valid`` ones it marks."""
    B, T, N, D = q.shape
    K = kv.shape[2] // 2
    out = np.zeros((B, T, N, D))
    for b, table in enumerate(tables):
        keys = np.concatenate([kv[p] for p in table]) if table else np.zeros((0, 2 * K, D))
        keys = np.asarray(keys, np.float64)
        for t in range(T):
            keep = np.arange(len(keys)) <= positions[b, t]
            if inside is not None:
                rel = np.arange(len(keys)) - positions[b, 0]
                own = (rel >= 0) & (rel < T)
                u = np.clip(rel, 0, T - 1)
                keep = (rel < 0) | (own & inside[b, t, u] & valid[b, u])
            seen = keys[keep]
            for n in range(N):
                k, v = seen[:, 2 * (n // (N // K))], seen[:, 2 * (n // (N // K)) + 1]
                if len(k) == 0:
                    continue
                s = k @ q[b, t, n] * D**-0.5
                w = np.exp(s - s.max())
                out[b, t, n] = w @ v / w.sum()
    return out


def test_xla_paged_attention_matches_oracle_across_blocks(monkeypatch):
    # Blocks of 4 entries: sequences straddle block boundaries, the list ends in padding that
    # is never read, and row 2 has no page (its output is 0).
    monkeypatch.setattr(paged, "XLA_PAGES_PER_BLOCK", 4)
    rng = np.random.default_rng(0)
    B, T, N, K, D, page_size, num_pages = 4, 2, 4, 2, 8, 4, 24
    kv = rng.standard_normal((num_pages, page_size, 2 * K, D))
    q = rng.standard_normal((B, T, N, D))
    tables = [[5, 9, 1], [3, 7, 11, 2, 8, 4], [], [13, 6, 20]]
    positions = np.array([[9, 10], [20, 23], [0, 0], [2, 11]])
    arrays = paged.PageList(**{k: jnp.asarray(v) for k, v in _flat(tables, B, size=20).items()})
    got = jax.jit(paged.xla_attention)(
        jnp.asarray(q, jnp.float32),
        jnp.asarray(kv, jnp.float32),
        jnp.asarray(positions),
        None,  # valid: the XLA path reads the page list only
        arrays,
    )
    want = _oracle(q, kv, positions, tables, page_size)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def _flat(tables, rows, size):
    page = np.full(size, paged.SCRATCH_PAGE, np.int32)
    seq = np.full(size, rows, np.int32)
    index = np.zeros(size, np.int32)
    at = 0
    for row, table in enumerate(tables):
        page[at : at + len(table)], seq[at : at + len(table)] = table, row
        index[at : at + len(table)] = np.arange(len(table))
        at += len(table)
    return dict(page=page, seq=seq, index=index)


def test_dense_cpu_path_matches_oracle_after_writes():
    """The dense CPU path: views gathered from the page tables, one decode step's K/V written
    into the views, attention over the views == the oracle over the pages with the new K/V, and
    the chunk's write-back puts exactly the written positions into the pages."""
    rng = np.random.default_rng(1)
    B, N, K, D, page_size, num_pages = 3, 4, 2, 8, 4, 24
    kv = rng.standard_normal((num_pages, page_size, 2 * K, D))
    kv[paged.SCRATCH_PAGE] = 0.0
    q = rng.standard_normal((B, 1, N, D))
    new = rng.standard_normal((B, 1, 2 * K, D))
    tables = [[5, 9, 1], [3, 7, 11, 2], [13]]
    positions = np.array([[9], [14], [0]])
    width = 4  # page-table width: unused entries point at the scratch page
    table = np.zeros((B, width), np.int32)
    for b, t in enumerate(tables):
        table[b, : len(t)] = t

    # Right-aligned views: every row's position at column 14, the longest context.
    shift = positions.max() - positions[:, 0]

    @jax.jit
    def step(kv, q, new, positions, table):
        pool = paged.PagePool(kv=(kv,))
        views = dense_cpu.dense_views(pool, table, shift, paged.Groups())
        k, v = new[:, :, 0::2], new[:, :, 1::2]  # the pool's layout: keys even, values odd
        columns = positions[:, 0] + shift
        keys, values = dense_cpu.write_views(*views[0], k, v, columns[0])
        visible = dense_cpu.view_mask(shift, columns, keys.shape[-1])
        out = dense_cpu.view_attention(q, keys, values, visible)
        views = ((keys, values),)
        start = positions[:, 0]
        where = jnp.arange(table.shape[1] * page_size)[None, :] + shift[:, None]  # p + shift
        pages = dense_cpu.views_to_pages(
            pool, views, table, start, start + 1, where, paged.Groups()
        )
        return out, pages.kv[0]

    got, pages = step(*(jnp.asarray(x, jnp.float32) for x in (kv, q, new)), positions, table)
    want_kv = kv.copy()
    for b, t in enumerate(tables):
        want_kv[t[positions[b, 0] // page_size], positions[b, 0] % page_size] = new[b, 0]
    np.testing.assert_allclose(np.asarray(pages), want_kv, atol=1e-6)
    want = _oracle(q, want_kv, positions, tables, page_size)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_dense_write_back_writes_only_the_chunk_positions():
    """``views_to_pages`` copies positions [start, end) of each row's views (position ``p`` from
    the column the map gives it, here ``p + shift``) into its pages; every other position of
    every page (the scratch page included) keeps its contents."""
    K, D, page_size, num_pages = 2, 4, 4, 10
    kv = np.arange(num_pages * page_size * 2 * K * D, dtype=np.float32)
    kv = kv.reshape(num_pages, page_size, 2 * K, D)
    table = np.array([[3, 5, 0], [7, 2, 8], [9, 0, 0]], np.int32)
    L = table.shape[1] * page_size
    # What the rows' steps wrote, everywhere: minus the view column (keys), minus 100 more
    # (values), so the test sees which column went where (position p is column p + shift).
    column = np.arange(L, dtype=np.float32)
    keys = np.broadcast_to(-column, (3, K, D, L)).copy()
    values = np.broadcast_to(-100.0 - column[:, None], (3, K, L, D)).copy()
    start, end = np.array([3, 0, 2]), np.array([6, 0, 3])  # row 1 wrote nothing
    shift = np.array([2, 5, 0])
    pool = paged.PagePool(kv=(jnp.asarray(kv),))
    views = ((jnp.asarray(keys), jnp.asarray(values)),)
    where = np.arange(L)[None, :] + shift[:, None]  # position p in column p + shift
    got = np.asarray(
        dense_cpu.views_to_pages(pool, views, table, start, end, where, paged.Groups()).kv[0]
    )
    want = kv.copy()
    for b in range(3):
        for pos in range(start[b], end[b]):
            page, offset = table[b, pos // page_size], pos % page_size
            col = pos + shift[b]
            want[page, offset, 0::2], want[page, offset, 1::2] = -col, -100.0 - col
    np.testing.assert_array_equal(got, want)
    assert (got != kv).sum() == 4 * 2 * K * D  # positions 3, 4, 5 of row 0 and 2 of row 2
