"""The XLA paged attention path against a NumPy float64 oracle, over several page-list blocks."""

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax.sampling import paged


def _oracle(q, kv, positions, tables, page_size):
    """Each query over its sequence's keys at positions <= its own (GQA), in float64."""
    B, T, N, D = q.shape
    K = kv.shape[2] // 2
    out = np.zeros((B, T, N, D))
    for b, table in enumerate(tables):
        keys = np.concatenate([kv[p] for p in table]) if table else np.zeros((0, 2 * K, D))
        for t in range(T):
            seen = keys[: positions[b, t] + 1]
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
    got = jax.jit(paged._xla_attention)(
        jnp.asarray(q, jnp.float32), jnp.asarray(kv, jnp.float32), jnp.asarray(positions), arrays
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
