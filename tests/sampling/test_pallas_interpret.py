"""The TPU decode path run on CPU: JAX's Pallas ragged paged attention kernel, the decode slots
split into kernel calls that fit the TPU's scalar memory (``smem.row_chunks``), executed in
Pallas' interpret mode and compared with the XLA path (one decode step's attention, and the
engine's whole generations).

Interpret mode: ``pltpu.force_tpu_interpret_mode(True)`` runs every Pallas call traced under it
with ``interpret=True``, the kernel's body lowered to plain XLA:CPU ops (its DMAs, semaphores
and scalar-prefetched page table included), so no engine switch is needed. ``True`` rather than
``InterpretParams()``: JAX 0.10's TPU simulator cannot read the reshaped VMEM buffer this kernel
loads its pages through (``ReshapeTransform`` has no ``indices``).

The real SMEM budget splits a call only past ~2,000 slots for tables this narrow (compile-only
boundary tests in test_smem.py); here the budget is what 8 slots of the table need, so that 12
or 20 slots go through the kernel in 2 or 3 calls.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from delta_jax.models import ModelConfig, Transformer
from delta_jax.sampling import Sampler
from delta_jax.sampling.attention import paged, smem
from tests.sampling.test_paged import _flat, _oracle

pltpu = pytest.importorskip("jax.experimental.pallas.tpu")

# float32 end to end; the kernel's online softmax and the XLA path's page-block merge differ
# only in summation order (measured: 5e-7 against the float64 oracle, 2e-6 on log-probs).
ATOL = 1e-5


@pytest.fixture(scope="module")
def interpret():
    """Interpret mode, and the slot split at 8 slots a call (records each traced split)."""
    from jax._src import literals

    calls = []

    def row_chunks(rows, width, real=smem.row_chunks):
        chunks = real(rows, width, smem.page_table_smem_bytes(8, width))
        calls.append(chunks)
        return chunks

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(smem, "row_chunks", row_chunks)
        # JAX 0.10's interpreter discharges a store at a literal int index (the kernel's
        # ``seq_buf_idx_ref[0] = ...``) by reading the index's ``shape``, which its literal ints
        # (``TypedInt``) lack: give them the shape of the scalar they are.
        if not hasattr(literals.TypedInt, "shape"):
            mp.setattr(literals.TypedInt, "shape", (), raising=False)
        with pltpu.force_tpu_interpret_mode(True):
            yield calls


@pytest.mark.parametrize("T", [1, 3])
def test_kernel_in_slot_chunks_matches_the_xla_path_and_the_oracle(interpret, T):
    """20 slots in 3 kernel calls (8, 8, 4), 4-page tables of 16-token pages, GQA (4 query
    heads on 2 KV heads, head dim 128: the kernel's lane width): ragged lengths from T to 64
    positions, and an idle slot (its output is discarded by the engine). T queries per slot
    at its last T positions: a decode step (1), a speculative verify step (3)."""
    rng = np.random.default_rng(0)
    B, N, K, D, page_size, num_pages, width = 20, 4, 2, 128, 16, 90, 4
    kv = rng.standard_normal((num_pages, page_size, 2 * K, D)).astype(np.float32)
    q = rng.standard_normal((B, T, N, D)).astype(np.float32)
    lengths = np.concatenate([[T, 16, 17, 64], rng.integers(T, width * page_size + 1, B - 4)])
    pages = rng.permutation(np.arange(1, num_pages))  # page 0 is the scratch page
    tables, at = [], 0
    for n in -(-lengths // page_size):
        tables.append(pages[at : at + n].tolist())
        at += n
    table = np.zeros((B, width), np.int32)  # unused entries: the scratch page
    for b, t in enumerate(tables):
        table[b, : len(t)] = t
    positions = (lengths[:, None] - T + np.arange(T)).astype(np.int32)  # the queries' own
    valid = np.ones((B, T), bool)
    valid[7] = False  # idle: the kernel reads its scratch page only

    got = jax.jit(paged.pallas_attention)(q, kv, positions, valid, table)
    assert interpret[-1] == [(0, 8), (8, 8), (16, 4)]
    got = np.asarray(got)
    live = valid[:, 0]
    flat = paged.PageList(**{k: jnp.asarray(v) for k, v in _flat(tables, B, size=64).items()})
    xla = np.asarray(jax.jit(paged.xla_attention)(q, kv, positions, valid, flat))
    np.testing.assert_allclose(got[live], xla[live], atol=ATOL, rtol=ATOL)
    want = _oracle(q, kv, positions, tables, page_size)
    np.testing.assert_allclose(got[live], want[live], atol=ATOL, rtol=ATOL)
    assert np.isfinite(got[~live]).all()


@pytest.mark.parametrize("block", [8, 128])
def test_kernel_prefills_chunks_as_the_xla_path_and_the_oracle(interpret, block):
    """A prefill call on the kernel: 12 rows (2 kernel calls) of a 24-token chunk each, at
    consecutive positions from each row's own first position (0: a prompt's first chunk; past a
    page boundary: a continuation over pages already written), the chunk's tail invalid where
    the row's job ends in it, and an empty row. Query blocks of 8 (a row's chunk in 3 blocks)
    and of 128 (blocks spanning rows, the engine's prefill block)."""
    rng = np.random.default_rng(5)
    B, T, N, K, D, page_size, num_pages, width = 12, 24, 4, 2, 128, 16, 120, 6
    kv = rng.standard_normal((num_pages, page_size, 2 * K, D)).astype(np.float32)
    q = rng.standard_normal((B, T, N, D)).astype(np.float32)
    first = np.concatenate([[0, 0, 16, 17, 40], rng.integers(0, width * page_size - T, B - 5)])
    real = np.concatenate([[T, 5, T, 1, 19], rng.integers(1, T + 1, B - 5)])
    positions = (first[:, None] + np.arange(T)).astype(np.int32)
    valid = np.arange(T) < real[:, None]
    valid[9] = False  # no job in this row
    pages = rng.permutation(np.arange(1, num_pages))
    tables, at = [], 0
    for n in -(-(first + T) // page_size):  # through the chunk's last position, as the engine
        tables.append(pages[at : at + n].tolist())
        at += n
    table = np.zeros((B, width), np.int32)
    for b, t in enumerate(tables):
        table[b, : len(t)] = t
    attend = functools.partial(paged.pallas_attention, queries_per_block=block)

    got = np.asarray(jax.jit(attend)(q, kv, positions, valid, table))
    assert interpret[-1] == [(0, 8), (8, 4)]
    flat = paged.PageList(**{k: jnp.asarray(v) for k, v in _flat(tables, B, size=64).items()})
    xla = np.asarray(jax.jit(paged.xla_attention)(q, kv, positions, valid, flat))
    np.testing.assert_allclose(got[valid], xla[valid], atol=ATOL, rtol=ATOL)
    want = _oracle(q, kv, positions, tables, page_size)
    np.testing.assert_allclose(got[valid], want[valid], atol=ATOL, rtol=ATOL)
    assert np.isfinite(got).all()


def _trie_masks(rng, B, T):
    """``[B, T, T]``: each position and its ancestors in a random trie (a parent before its
    children, position 0 the root)."""
    inside = np.zeros((B, T, T), bool)
    for b in range(B):
        parent = [0] + [int(rng.integers(0, t)) for t in range(1, T)]
        for t in range(T):
            u = t
            inside[b, t, u] = True
            while u:
                u = parent[u]
                inside[b, t, u] = True
    return inside


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trie_kernel_matches_the_xla_path_and_the_oracle(interpret, monkeypatch, dtype):
    """The trie kernel (``trie_kernel.trie_attention``), blocks of 2 pages so that slots span
    several blocks and hand the next slot's first block over: 12 slots in 2 calls, 6 positions
    of a random trie per slot at the end of ragged lengths (an empty prefix, a page boundary,
    several blocks), a slot with only some nodes real and an idle one. Against the XLA path
    with the same mask and a float64 oracle; the 16-bit pool packs each key with its value (the
    kernel splits the words)."""
    from delta_jax.sampling.attention import trie_kernel

    monkeypatch.setattr(trie_kernel, "KV_PAGES_PER_BLOCK", 2)
    rng = np.random.default_rng(3)
    B, T, N, K, D, page_size, num_pages, width = 12, 6, 4, 2, 128, 16, 80, 6
    kv = jnp.asarray(rng.standard_normal((num_pages, page_size, 2 * K, D)), dtype)
    q = jnp.asarray(rng.standard_normal((B, T, N, D)), dtype)
    lengths = np.concatenate([[T, 16 + T, 17, 96, 32], rng.integers(T, 97, B - 5)])
    pages = rng.permutation(np.arange(1, num_pages))
    tables, at = [], 0
    for n in -(-lengths // page_size):
        tables.append(pages[at : at + n].tolist())
        at += n
    table = np.zeros((B, width), np.int32)
    for b, t in enumerate(tables):
        table[b, : len(t)] = t
    positions = (lengths[:, None] - T + np.arange(T)).astype(np.int32)
    valid = np.ones((B, T), bool)
    valid[2, 3:] = False  # a trie of 2 real nodes: the rest write to the scratch page
    valid[7] = False  # idle
    inside = _trie_masks(rng, B, T)
    args = (q, kv, positions, valid)

    got = np.asarray(jax.jit(trie_kernel.trie_attention)(*args, table, inside), np.float64)
    assert interpret[-1] == [(0, 8), (8, 4)]
    flat = paged.PageList(**{k: jnp.asarray(v) for k, v in _flat(tables, B, size=64).items()})
    xla = np.asarray(jax.jit(paged.xla_attention)(*args, flat, inside), np.float64)
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    want = _oracle(f64(q), f64(kv), positions, tables, page_size, inside, valid)
    # float32: summation order only; bfloat16: the weights and outputs rounded to bfloat16 (2**-8
    # relative), in both paths (measured: 7.5e-3 from float64, 1.6e-2 from the XLA path).
    tol = ATOL if dtype == "float32" else 2e-2
    np.testing.assert_allclose(got[valid], want[valid], atol=tol, rtol=tol)
    np.testing.assert_allclose(got[valid], xla[valid], atol=tol, rtol=tol)
    assert np.isfinite(got).all()
    # The mask matters: the causal mask's outputs differ at nodes off the first branch.
    causal = _oracle(f64(q), f64(kv), positions, tables, page_size)
    assert np.abs(causal - want)[valid].max() > 0.1


def test_engine_decodes_on_the_kernel_as_on_the_xla_path(interpret):
    """The continuous engine with ``attention="pallas"`` (every prefill chunk and decode step
    through the kernel) draws the XLA engine's tokens with its log-probs: 9 prompts of
    1-13 tokens x 2 samples with budgets of 4-12 tokens at temperature 1, 18 rows on 12 slots
    (2 kernel calls a step), refilled as rows end: the tail runs on 8 slots, some idle (every
    slot bucket's program compiled at the request's start)."""
    cfg = ModelConfig.tiny("qwen3", vocab_size=96, head_dim=128, num_layers=1)
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    _, params = nnx.split(model, nnx.Param)  # peaked: x4 as the other sampling tests' model
    nnx.update(model, jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, params))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 96, int(rng.integers(1, 14))).tolist() for _ in range(9)]
    budgets = rng.integers(4, 13, 9).tolist()
    kw = dict(max_new_tokens=budgets, n=2, temperature=1.0, seed=4)
    engine = functools.partial(
        Sampler, model, stop_token_ids=(), engine="continuous", decode_slots=12, page_size=4
    )
    want = engine(attention="xla").generate(prompts, **kw)
    before = len(interpret)
    got = engine(attention="pallas").generate(prompts, **kw)
    # The decode programs traced, each once, before the first chunk: every slot bucket (2, 4
    # and 8 slots in one kernel call, 12 in two); the tail's chunks on 8 slots trace nothing.
    # Then the prompts' prefill, at its two chunk lengths (8 rows, one kernel call each).
    assert interpret[before:] == [[(0, 2)], [(0, 4)], [(0, 8)], [(0, 8), (8, 4)]] + [[(0, 8)]] * 2
    assert got.tokens == want.tokens and got.lengths == [b for b in budgets for _ in range(2)]
    np.testing.assert_allclose(
        np.asarray(got.logprob_array), np.asarray(want.logprob_array), atol=ATOL
    )
    np.testing.assert_allclose(
        np.asarray(got.untruncated_logprob_array),
        np.asarray(want.untruncated_logprob_array),
        atol=ATOL,
    )
    assert len({t for row in got.tokens for t in row}) > 20  # the draws are not degenerate


def test_trie_speculation_on_the_kernels_draws_the_xla_engines_tokens(interpret):
    """The continuous engine with ``attention="pallas"`` and tries of 6 drafts 3 deep (verify
    steps on the trie kernel): sampled at temperature 1, 5 prompts x 3 samples on 4 slots
    refilled as rows end, a pool small enough to preempt, the repeated samples drafting from
    each other: the XLA engine's tokens and log-probs without speculation, in fewer verify
    steps than tokens. (Near a sequence's end a trie's node may sit past the last position its
    page table holds: such nodes are not scored, else their K/V land in another position's.)"""
    cfg = ModelConfig.tiny("qwen3", vocab_size=24, head_dim=128, num_layers=1)
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    _, params = nnx.split(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, params))
    prompts = [[5, 9, 2, 17], [7, 1, 4, 4, 8, 3], [20], [3, 3, 6, 2, 9], [11, 12, 13]]
    kw = dict(max_new_tokens=[14, 9, 17, 12, 15], n=3, temperature=1.0, seed=5)
    engine = functools.partial(
        Sampler, model, stop_token_ids=(), engine="continuous", decode_slots=4, page_size=4,
        decode_chunk=2,
    )  # fmt: skip
    want = engine(attention="xla").generate(prompts, **kw)
    got = engine(attention="pallas", num_pages=16, speculate=True, draft_tokens=6, draft_depth=3)
    got = got.generate(prompts, **kw)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(
        np.asarray(got.logprob_array), np.asarray(want.logprob_array), atol=ATOL
    )
    stats = got.engine_stats
    assert stats.preemptions > 0
    assert 0 < stats.verify_steps < stats.useful_steps and sum(stats.accepted.values()) > 0


def test_several_queries_per_slot_compile_for_v5p():
    """The kernel call with 3 queries per slot (a speculative verify step), compiled by the TPU
    compiler for v5p (compile-only): 64 slots, 128-page tables, Qwen3-8B's heads."""
    pytest.importorskip("libtpu")
    from jax.experimental import topologies
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    topo = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu")
    mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
    whole = NamedSharding(mesh, P())
    B, T, N, K, D, page_size, pages, width = 64, 3, 32, 8, 128, 16, 4096, 128
    shapes = [
        ((B, T, N, D), jnp.bfloat16),
        ((pages, page_size, 2 * K, D), jnp.bfloat16),
        ((B, T), jnp.int32),
        ((B, T), bool),
        ((B, width), jnp.int32),
    ]
    args = [jax.ShapeDtypeStruct(s, d, sharding=whole) for s, d in shapes]
    fn = jax.shard_map(
        paged.pallas_attention, mesh=mesh, in_specs=(P(),) * 5, out_specs=P(), check_vma=False
    )
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn).lower(*args).compile()
    assert compiled.as_text().count("ragged_paged_attention") >= 1


def test_speculative_steps_on_the_kernel_emit_the_xla_paths_plain_tokens(interpret):
    """Verify steps (3 drafts a step, from windows of the plain run's text, partly corrupted)
    through the kernel, 4 queries per slot: the tokens and log-probs of plain decode steps on
    the XLA path, in fewer steps."""
    from delta_jax.sampling.attention.backends import PallasBackend, XlaBackend
    from delta_jax.sampling.strategies import make_strategy
    from tests.sampling.test_verify import _decode_all

    cfg = ModelConfig.tiny("qwen3", vocab_size=24, head_dim=128, num_layers=1)
    model = Transformer(cfg, rngs=nnx.Rngs(2))
    prompts = [np.array([3, 4, 5]), np.array([7, 1, 2, 9, 9]), np.array([5, 6])]
    budgets, stops, strategy = [12, 16, 9], [-1, -1, 11], make_strategy(1.0)
    plain, plain_steps = _decode_all(model, XlaBackend(), strategy, prompts, budgets, stops)
    rng = np.random.default_rng(1)
    windows = np.full((3, 24), -1, np.int32)
    for b, p in enumerate(prompts):
        text = np.array(plain[b]["tokens"], np.int32)
        noisy = np.where(rng.random(text.size) < 0.15, rng.integers(0, 24, text.size), text)
        piece = np.concatenate([p[-2:], noisy])[:23]
        windows[b, : piece.size] = piece
    spec, spec_steps = _decode_all(
        model, PallasBackend(), strategy, prompts, budgets, stops, windows, k=3
    )
    for b in range(3):
        assert spec[b]["tokens"] == plain[b]["tokens"], b
        np.testing.assert_allclose(spec[b]["logprobs"], plain[b]["logprobs"], atol=ATOL)
    assert spec_steps < plain_steps


def test_trie_verify_steps_on_the_kernel_emit_the_xla_paths_plain_tokens(interpret):
    """Verify steps of tries of 6 drafts 3 deep through the trie kernel (from windows where the
    kept path often leaves the first branch: its K/V move along the page tables): the tokens,
    log-probs and hidden states of plain decode steps on the XLA path, in fewer steps."""
    from delta_jax.sampling.attention.backends import PallasBackend, XlaBackend
    from delta_jax.sampling.strategies import make_strategy
    from tests.sampling.test_verify import _decode_all, trie_windows

    cfg = ModelConfig.tiny("qwen3", vocab_size=24, head_dim=128, num_layers=1)
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    prompts = [np.array([3, 4, 5]), np.array([7, 1, 2, 9, 9]), np.array([5, 6])]
    budgets, stops, strategy = [20, 25, 9], [-1, -1, 11], make_strategy(1.0)
    plain, plain_steps = _decode_all(model, XlaBackend(), strategy, prompts, budgets, stops)
    windows = trie_windows(plain, prompts, np.random.default_rng(2), vocab=24, m=2)
    stats = {}
    spec, spec_steps = _decode_all(
        model, PallasBackend(), strategy, prompts, budgets, stops, windows, k=6, m=2, depth=3,
        stats=stats,
    )  # fmt: skip
    for b in range(3):
        assert spec[b]["tokens"] == plain[b]["tokens"], b
        np.testing.assert_allclose(spec[b]["logprobs"], plain[b]["logprobs"], atol=ATOL)
        np.testing.assert_allclose(spec[b]["hidden"], plain[b]["hidden"], atol=ATOL)
    assert stats["off_branch"] >= 3, stats
    assert spec_steps < plain_steps
