"""The ragged paged attention kernel's scalar memory (SMEM): the budget against a hand count of
its operands, the slot chunks, and the boundary on the real TPU compiler (compile-only)."""

import dataclasses

import jax
import numpy as np
import pytest

from delta_jax.models import ModelConfig
from delta_jax.sampling.attention import smem


def test_smem_bytes_by_hand():
    # The refusal: 214 slots x a 2,048-page table = (8, 128) tiles of int32 -> 216 rows.
    assert 216 * 2048 * 4 == 1769472
    assert smem.page_table_smem_bytes(214, 2048) == 1769472 + 4 * (256 + 256 + 128 + 128) + 1168
    # kv_lens [120] and cu_q_lens [121] take one 128-word tile each, seq_buf_idx and num_seqs too.
    assert smem.page_table_smem_bytes(120, 2048) == 4 * (120 * 2048 + 4 * 128) + 1168
    # The compiler's boundaries, measured on libtpu 0.0.42.1 (kernel alone and the engine's decode
    # program agree): largest slot count per call for a table width.
    measured = {1: 2008, 128: 2008, 256: 1008, 1024: 248, 1408: 184, 1920: 128, 2048: 120}
    for width, rows in measured.items():
        assert smem.max_rows_per_call(width) == rows, width
        assert smem.page_table_smem_bytes(rows, width) <= smem.SMEM_BYTES
        assert smem.page_table_smem_bytes(rows + 1, width) > smem.SMEM_BYTES


@pytest.mark.parametrize(("rows", "width"), [(214, 2048), (512, 2048), (64, 2048), (5, 4096)])
def test_row_chunks_cover_the_slots_and_each_fits(rows, width):
    chunks = smem.row_chunks(rows, width)
    assert [s for s, _ in chunks] == list(np.cumsum([0] + [n for _, n in chunks])[:-1])
    assert sum(n for _, n in chunks) == rows
    assert all(smem.page_table_smem_bytes(n, width) <= smem.SMEM_BYTES for _, n in chunks)
    assert len(chunks) == -(-rows // smem.max_rows_per_call(width))  # no more calls than needed


def _spec(attention: str, max_table: int):
    from delta_jax.sampling.engine.requests import EngineSpec

    # 64 slots in 2 data groups, every sequence at most ``max_table`` pages of 16 tokens.
    fields = dict(slots=64, steps=8, page_size=16, num_pages=4096, seq_pages=max_table)
    fields.update(max_table=max_table, prefill_len=64, min_len=16, prefill_rows=8, groups=2)
    return EngineSpec(**fields, attention=attention, return_hidden=False, pad_id=0)


def test_only_the_tpu_kernel_refuses_too_wide_a_table_in_one_line():
    from delta_jax.sampling.attention.backends import backend_for

    refusal = backend_for("pallas").refusal(_spec("pallas", 40000))
    assert refusal == smem.page_table_error(40000)
    assert "page table 40000 pages wide" in refusal and "\n" not in refusal
    assert backend_for("pallas").refusal(_spec("pallas", 2048)) is None
    for path in ("xla", "dense"):  # no scalar memory: a flat list, or gathered views
        assert backend_for(path).refusal(_spec(path, 40000)) is None


def test_the_attention_path_is_named_once():
    from delta_jax.models import Transformer
    from delta_jax.sampling import Sampler
    from delta_jax.sampling.attention.backends import backend_for, resolve_attention

    auto = {p: resolve_attention("auto", p) for p in ("tpu", "cpu", "gpu")}
    assert auto == {"tpu": "pallas", "cpu": "dense", "gpu": "xla"}
    assert [resolve_attention(n, "tpu") for n in ("xla", "dense")] == ["xla", "dense"]
    # A head size JAX's kernel does not tile (the demo model's): auto is the XLA path on TPU.
    assert resolve_attention("auto", "tpu", head_dim=64) == "xla"
    with pytest.raises(ValueError, match="attention='pallas': .* multiple of 128 .*: 64"):
        resolve_attention("pallas", "tpu", head_dim=64)
    # A flat page list for every slot at the longest sequence, or none for the table paths.
    lists = {p: backend_for(p).decode_list_pages(_spec(p, 12)) for p in ("xla", "pallas", "dense")}
    assert lists == {"xla": 32 * 12, "pallas": 1, "dense": 1}
    with pytest.raises(ValueError, match="'auto', 'xla', 'pallas', 'dense', got 'splash'"):
        Sampler(Transformer(ModelConfig.tiny("llama")), attention="splash")


def _decode(slots_per_group: int, width: int):
    from jax.experimental import topologies

    from delta_jax.plan.lowering import lower_decode
    from delta_jax.sampling import SAMPLING_RULES

    topo = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu")
    mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(2, 2), ("data", "tensor"))
    cfg = ModelConfig.tiny(
        "qwen3", num_heads=8, num_kv_heads=4, head_dim=128, hidden_size=256,
        intermediate_size=512, num_layers=1,
    )  # fmt: skip
    spec = dataclasses.replace(
        _spec("pallas", width), slots=2 * slots_per_group, steps=2, num_pages=64
    )
    return lower_decode(cfg, mesh, SAMPLING_RULES, spec).compile()


@pytest.mark.slow  # three TPU compiles of a one-layer decode program
def test_the_compiler_refuses_where_the_budget_says(monkeypatch):
    """The engine's decode program for a v5p (two data groups): one kernel call per group fits at
    the computed limit and is refused one slot above it; split into calls, it compiles."""
    pytest.importorskip("libtpu")
    width = 2048
    limit = smem.max_rows_per_call(width)
    _decode(limit + 1, width)  # split: 121 slots per group in two calls
    monkeypatch.setattr(smem, "row_chunks", lambda rows, width, budget=0: [(0, rows)])
    _decode(limit, width)
    with pytest.raises(jax.errors.JaxRuntimeError, match="memory space smem"):
        _decode(limit + 1, width)
