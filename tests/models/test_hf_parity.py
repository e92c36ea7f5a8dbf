"""Parity with PyTorch ``transformers`` on tiny random checkpoints of each family.

Tolerance policy (float32 on CPU): whole-model logits / hidden states 1e-4 against torch;
export -> transformers reload 1e-5 (the weights must come back bit-exact, so the only difference
would be a wrong layout). Only valid (non-pad) positions are compared when padding is present.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import AxisType

from delta_jax.models import ModelConfig, from_pretrained, save_pretrained
from tests.models.hf_helpers import (
    FAMILIES,
    build_hf_model,
    forward,
    hf_logits,
    padded_batch,
    save_hf_model,
)

WHOLE_MODEL_TOL = 1e-4
ROUNDTRIP_TOL = 1e-5
T = 40  # beyond the llama3 original context (32) of the tiny configs


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    """(kind, torch model, its directory, our model loaded from it)."""
    kind = request.param
    hf = build_hf_model(kind)
    path = save_hf_model(hf, str(tmp_path_factory.mktemp(kind)))
    return kind, hf, path, from_pretrained(path)


def test_config_parsed(pair):
    kind, hf, path, ours = pair
    cfg = ours.config
    expected_family = {
        "qwen3_tied": "qwen3",
        "qwen2_untied": "qwen2",
        "llama31_untied": "llama",
        "llama32_tied": "llama",
    }[kind]
    assert cfg.family == expected_family
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    hf_head_dim = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // 4
    assert cfg.head_dim == hf_head_dim
    assert cfg.qkv_bias == (expected_family == "qwen2")
    assert cfg.qk_norm == (expected_family == "qwen3")


def test_logits_and_hidden_no_padding(pair):
    _, hf, _, ours = pair
    ids = np.random.RandomState(1).randint(0, hf.config.vocab_size, (3, T))
    ref_logits, ref_hidden, ref_hidden_states_last = hf_logits(hf, ids)
    logits, hidden = forward(ours, ids)
    np.testing.assert_allclose(logits, ref_logits, atol=WHOLE_MODEL_TOL, rtol=0)
    np.testing.assert_allclose(hidden, ref_hidden, atol=WHOLE_MODEL_TOL, rtol=0)
    # transformers' output_hidden_states[-1] is the post-norm state too in these families.
    np.testing.assert_allclose(ref_hidden_states_last, ref_hidden, atol=1e-6, rtol=0)


@pytest.mark.parametrize("side", ["left", "right"])
def test_logits_with_padding(pair, side):
    _, hf, _, ours = pair
    rng = np.random.RandomState(2)
    ids, mask, positions = padded_batch(rng, hf.config.vocab_size, [T, T - 5, 9], T, side)
    ref_logits, ref_hidden, _ = hf_logits(hf, ids, mask, positions)
    logits, hidden = forward(ours, ids, mask)  # default positions
    valid = mask.astype(bool)
    assert np.isfinite(logits).all()
    np.testing.assert_allclose(logits[valid], ref_logits[valid], atol=WHOLE_MODEL_TOL, rtol=0)
    np.testing.assert_allclose(hidden[valid], ref_hidden[valid], atol=WHOLE_MODEL_TOL, rtol=0)


def test_export_roundtrip(pair, tmp_path):
    _, hf, _, ours = pair
    out_dir = str(tmp_path / "export")
    save_pretrained(ours, out_dir)
    assert sorted(os.listdir(out_dir)) == ["config.json", "model.safetensors"]
    reloaded = type(hf).from_pretrained(out_dir).eval()
    ids = np.random.RandomState(3).randint(0, hf.config.vocab_size, (2, T))
    np.testing.assert_allclose(
        hf_logits(reloaded, ids)[0], hf_logits(hf, ids)[0], atol=ROUNDTRIP_TOL, rtol=0
    )
    # The exported config parses back to the same model config.
    assert ModelConfig.from_hf(out_dir) == ours.config


def test_sharded_export_with_index(pair, tmp_path):
    _, hf, _, ours = pair
    out_dir = str(tmp_path / "sharded")
    save_pretrained(ours, out_dir, max_shard_size=40_000)
    files = sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    with open(os.path.join(out_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["weight_map"].values()) == set(files)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(ours, nnx.Param)))
    assert index["metadata"]["total_size"] == 4 * n_params
    ids = np.random.RandomState(4).randint(0, hf.config.vocab_size, (3, T))
    reloaded = type(hf).from_pretrained(out_dir).eval()
    np.testing.assert_allclose(
        hf_logits(reloaded, ids)[0], hf_logits(hf, ids)[0], atol=ROUNDTRIP_TOL, rtol=0
    )
    ours2 = from_pretrained(out_dir)
    np.testing.assert_array_equal(forward(ours2, ids)[0], forward(ours, ids)[0])


def test_bf16_dtype_preserved_on_export(tmp_path):
    hf = build_hf_model("qwen2_untied")
    src = save_hf_model(hf, str(tmp_path / "src"))
    ours = from_pretrained(src, dtype=jnp.bfloat16)
    assert ours.embed[...].dtype == jnp.bfloat16
    save_pretrained(ours, str(tmp_path / "out"))
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    reloaded = transformers.Qwen2ForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert reloaded.dtype == torch.bfloat16
    # bf16 rounding of the float32 originals is the only change.
    w_ref = hf.model.layers[1].mlp.down_proj.weight.detach()
    w_got = reloaded.model.layers[1].mlp.down_proj.weight.detach()
    assert (w_ref.to(w_got.dtype) == w_got).all()


def test_sharded_placement_on_mesh(tmp_path):
    hf = build_hf_model("qwen3_tied")
    path = save_hf_model(hf, str(tmp_path / "src"))
    ours = from_pretrained(path)
    # The model shards through GSPMD propagation plus constraints: an Auto-axes mesh.
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    sharded = from_pretrained(path, mesh=mesh)
    spec = sharded.blocks.wq[...].sharding.spec
    # wq [L, H, N, D] with logical (layers, embed, heads, head_dim) -> (None, fsdp, tensor, None).
    assert tuple(spec) == (None, "fsdp", "tensor", None)
    assert tuple(sharded.embed[...].sharding.spec) == ("tensor", "fsdp")  # (vocab, embed)
    ids = np.random.RandomState(5).randint(0, hf.config.vocab_size, (3, T))
    with jax.set_mesh(mesh):
        got = forward(sharded, ids)[0]
    np.testing.assert_allclose(got, forward(ours, ids)[0], atol=1e-5, rtol=0)
