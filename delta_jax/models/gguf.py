"""GGUF files (llama.cpp's format) as a model source: weights, config and tokenizer.

A GGUF file holds everything a Hugging Face directory does, under other names: the
hyper-parameters and the tokenizer as metadata (``llama.block_count``, ``tokenizer.ggml.tokens``,
``tokenizer.chat_template``, ...) and the weights as tensors, most of them quantised in blocks.
This module turns one into what :func:`delta_jax.models.from_pretrained` reads from a directory:

* :func:`read_config` -> a ``config.json`` dict (Llama, Qwen2 and Qwen3 conventions);
* :class:`GGUFTensors` -> tensors under their Hugging Face names, dequantised one at a time
  with the ``gguf`` package's NumPy kernels (no PyTorch) and laid out as ``transformers``
  stores them. llama.cpp's converter permutes the query and key rows of Llama models (its RoPE
  rotates adjacent pairs, Hugging Face's rotates halves); they are permuted back here. Qwen2 /
  Qwen3 files use the rotate-half order already.
* :func:`load_gguf_tokenizer` -> a ``transformers`` fast tokenizer built from the vocabulary,
  merges, special tokens and chat template stored in the file (byte-level BPE, the kind every
  supported family uses), split as llama.cpp splits text for that vocabulary.

Every problem with a file is one :class:`GGUFError` line naming the file and what is wrong: not
a GGUF or truncated, an architecture or a quantisation type this package does not read, a
tokenizer kind it cannot build.
"""

from __future__ import annotations

import os
from typing import Any

import gguf
import numpy as np
from gguf import quants

from delta_jax.models.config import ModelConfig
from delta_jax.models.layers import rope_inv_freq

GGUF_SUFFIX = ".gguf"
# general.architecture -> the Hugging Face architecture the weights are mapped to.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Tensor types read (dequantised to float32, then cast to the model's dtype).
QUANT_TYPES = (
    *("F32", "F16", "BF16"),  # plain floats
    *("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"),  # blocks of 32 weights
    *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),  # k-quants: super-blocks of 256 weights
)

# GGUF tensor name (``{i}``: layer) -> Hugging Face name.
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
# Llama 3's RoPE frequency factors: folded into the config's rope_scaling (:func:`read_config`).
_ROPE_FREQS = "rope_freqs.weight"


class GGUFError(ValueError):
    """A GGUF file this package cannot read; the message names the file and the reason."""


def is_gguf(path: str | os.PathLike) -> bool:
    return os.fspath(path).lower().endswith(GGUF_SUFFIX)


def open_gguf(path: str | os.PathLike):
    """The file's ``gguf.GGUFReader`` (memory-mapped; nothing is dequantised yet)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # truncated header, bad magic, offsets past the end, ...
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GGUFError(
            f"{path}: not a readable GGUF file (truncated or corrupt: {detail})"
        ) from None


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value.item() if isinstance(value, np.generic) else value


def read_config(reader, path: str) -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict from the file's metadata.

    Raises:
      GGUFError: an architecture other than :data:`ARCHITECTURES`, per-layer head counts, a RoPE
        scaling this decoder does not implement.
    """
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {sorted(ARCHITECTURES)}"
        )

    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if isinstance(value, list):  # per-layer values (e.g. head counts of hybrid models)
            if len(set(value)) != 1:
                raise GGUFError(f"{path}: {arch}.{key} differs between layers ({value[:8]}...)")
            value = value[0]
        return value

    names = {t.name for t in reader.tensors}
    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    vocab = meta("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []) or [])
    if not vocab:
        vocab = int(next(t.shape[-1] for t in reader.tensors if t.name == "token_embd.weight"))
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 32768)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    if meta("expert_count"):
        raise GGUFError(f"{path}: mixture-of-experts GGUF files are not supported")
    scaling = meta("rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(meta("rope.scaling.factor")),
        }
    elif scaling not in ("none", None):
        raise GGUFError(f"{path}: RoPE scaling {scaling!r} is not supported (only linear)")
    if _ROPE_FREQS in names:
        config["rope_scaling"] = _llama3_rope(reader, path, config)
    return config


def _llama3_rope(reader, path: str, config: dict[str, Any]) -> dict[str, Any]:
    """Llama 3.1+'s rope_scaling, recovered from the frequency factors llama.cpp stores.

    The converter computes ``rope_freqs`` from ``factor``, ``low_freq_factor``,
    ``high_freq_factor`` and ``original_max_position_embeddings`` and drops them; ``factor`` is
    the largest of the factors, and the other three are looked for among the values Meta's
    releases use (the original context first from ``rope.scaling.original_context_length``
    when the file states it), accepted only if they reproduce every stored factor.
    """
    tensor = next(t for t in reader.tensors if t.name == _ROPE_FREQS)
    stored = np.asarray(tensor.data, np.float64).reshape(-1)
    base = ModelConfig.from_hf(config)
    plain = rope_inv_freq(base)
    stated = _field(reader, f"{config['model_type']}.rope.scaling.original_context_length")
    for original in ([int(stated)] if stated else []) + [8192, 4096, 16384, 32768, 131072]:
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            candidate = {
                "rope_type": "llama3",
                "factor": float(stored.max()),
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
            scaled = rope_inv_freq(base.replace(rope_scaling=candidate))
            if np.allclose(plain / scaled, stored, rtol=1e-4):
                return candidate
    raise GGUFError(f"{path}: its RoPE frequency factors ({_ROPE_FREQS}) match no llama3 scaling")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head, rows (pairs interleaved) -> (halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFTensors:
    """A GGUF file's tensors under Hugging Face names, in ``transformers``' layout.

    Same interface as the safetensors reader of :mod:`delta_jax.models.hf` (``names``,
    ``shape``, ``get``, ``path``): ``get`` dequantises one tensor to float32 when asked.
    """

    def __init__(self, reader, path: str, config: dict[str, Any]):
        self.path = path
        self._tensors: dict[str, Any] = {}
        self._permute: dict[str, int] = {}
        llama = config["model_type"] == "llama"
        unknown = []
        for t in reader.tensors:
            if t.name == _ROPE_FREQS:
                continue
            hf = _hf_name(t.name)
            if hf is None:
                unknown.append(t.name)
                continue
            kind = gguf.GGMLQuantizationType(t.tensor_type).name
            if kind not in QUANT_TYPES:
                raise GGUFError(
                    f"{path}: tensor {t.name!r} has quantisation type {kind}, which this package "
                    f"does not read; supported: {', '.join(QUANT_TYPES)}"
                )
            self._tensors[hf] = t
            if llama and t.name.endswith(("attn_q.weight", "attn_q.bias")):
                self._permute[hf] = config["num_attention_heads"]
            elif llama and t.name.endswith(("attn_k.weight", "attn_k.bias")):
                self._permute[hf] = config["num_key_value_heads"]
        if unknown:
            raise GGUFError(
                f"{path}: tensors this package does not map: {unknown[:8]}"
                f"{' ...' if len(unknown) > 8 else ''}"
            )
        self.names = set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        # GGUF lists dimensions fastest-first (ggml's ne); NumPy's order is the reverse.
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def get(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        w = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
        w = w.reshape(self.shape(name))
        return _unpermute(w, self._permute[name]) if name in self._permute else w


def _hf_name(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        template = _NAMES.get(".".join(["blk", "{i}", *parts[2:]]))
        return None if template is None else template.format(i=int(parts[1]))
    return _NAMES.get(name)


def load_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], GGUFTensors]:
    """``(config.json dict, tensors)`` of a GGUF file; raises :class:`GGUFError`."""
    path = os.fspath(path)
    reader = open_gguf(path)
    config = read_config(reader, path)
    return config, GGUFTensors(reader, path, config)


# Text splits before byte-level BPE, by ``tokenizer.ggml.pre`` (llama.cpp's pre-tokenizer
# names): each vocabulary's merges were learned on text split this way.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# (digits split one by one first?, then this regex)
_PRE_TOKENIZERS = {
    "default": (False, _GPT2_SPLIT),
    "gpt-2": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT),
    "deepseek-r1-qwen": (False, _QWEN2_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


def load_gguf_tokenizer(path: str | os.PathLike):
    """A ``transformers.PreTrainedTokenizerFast`` from the file's tokenizer metadata.

    Byte-level BPE (``tokenizer.ggml.model == "gpt2"``: Llama 3, Qwen2/3, SmolLM2): the
    vocabulary and merges as stored, control tokens as special tokens, user-defined tokens as
    added tokens, BOS / EOS / padding / unknown from their ids, ``tokenizer.chat_template``, and
    BOS prepended when ``tokenizer.ggml.add_bos_token`` says so.

    Raises:
      GGUFError: another tokenizer kind (SentencePiece ``llama``, ...) or pre-tokenizer.
    """
    # Lazy: transformers takes seconds to import; only a GGUF file's tokenizer needs it.
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    path = os.fspath(path)
    reader = open_gguf(path)
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"{path}: tokenizer kind {kind!r} is not supported (byte-level BPE, 'gpt2', only); "
            "pass a tokenizer= of your own"
        )
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(
            f"{path}: pre-tokenizer {pre!r} is not supported; supported: {sorted(_PRE_TOKENIZERS)}"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    bpe = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    digits, split = _PRE_TOKENIZERS[pre]
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        ([pre_tokenizers.Digits(individual_digits=True)] if digits else [])
        + [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, types, strict=True))
    bpe.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL]
    )
    bpe.add_tokens([AddedToken(t, normalized=False) for t, k in typed if k == _USER_DEFINED])

    def token(key: str) -> str | None:
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos = token("bos")
    if bos is not None and _field(reader, "tokenizer.ggml.add_bos_token", False):
        bos_id = tokens.index(bos)
        bpe.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=bos,
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=_field(reader, "tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
