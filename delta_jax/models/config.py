"""Model configuration for the Qwen3 / Qwen2.5 / Llama-3 decoder family, read from HF config.json.

One frozen dataclass covers the three families; they differ only in flags:

* ``qwen3``: per-head RMSNorm on queries and keys (``qk_norm``), no projection bias, explicit
  ``head_dim`` (which need not equal ``hidden_size / num_heads``).
* ``qwen2`` (Qwen2 / Qwen2.5): bias on the q, k and v projections (``qkv_bias``).
* ``llama`` (Llama 3 / 3.1 / 3.2): plain attention; RoPE usually with ``llama3`` frequency scaling.

All three use grouped-query attention, SwiGLU MLP, pre-norm RMSNorm and rotate-half RoPE.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Literal

from delta_jax.models.attention import IMPLS, Impl, check_block

Family = Literal["qwen3", "qwen2", "llama"]
Remat = Literal["none", "block", "matmuls", "full"]
REMAT_POLICIES = ("none", "block", "matmuls", "full")

# Hugging Face `architectures` entry -> our family.
SUPPORTED_ARCHITECTURES: dict[str, Family] = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}
_MODEL_TYPES: dict[str, Family] = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama"}
_ARCH_OF_FAMILY = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder plus runtime options (layer scan, rematerialisation).

    Attributes:
      family: "qwen3", "qwen2" or "llama".
      vocab_size: V.  hidden_size: H.  intermediate_size: F.  num_layers: L.
      num_heads: N query heads.  num_kv_heads: K key/value heads (N % K == 0).  head_dim: D.
      rms_norm_eps: epsilon inside every RMSNorm.
      rope_theta: RoPE base.  rope_scaling: None or a HF rope dict with "rope_type" in
        ("default", "linear", "llama3") and its parameters.
      tie_word_embeddings: LM head is the embedding transposed.
      qkv_bias: bias on q/k/v projections.  qk_norm: per-head RMSNorm on q and k.
      max_position_embeddings: context length recorded in the HF config.
      bos_token_id, eos_token_id, pad_token_id: copied through to the exported config.
      scan_layers: run the blocks with ``lax.scan`` (one compiled block) instead of unrolled.
      remat: "none"; "block" = each block recomputed in the backward pass except the outputs
        of its dots without batch dimensions (XLA's classification: the weight matmuls);
        "matmuls" = each block recomputed except the outputs of its weight matmuls and of its
        attention (tagged by name), so nothing of size ``T x T`` is kept and the attention is
        not run again; "full" = each block recomputed from its input only.
      attention: attention implementation, one of
        :data:`delta_jax.models.attention.IMPLS` (see that module).
      attention_block: query / key block length of the ``chunked`` and ``splash`` attention.
      lora_rank, lora_alpha: LoRA adapters' rank (0: none) and scale numerator (the adapted
        projection adds ``lora_alpha / lora_rank · B A x``); set by
        :func:`delta_jax.models.lora.add_adapters`, never written to ``config.json``.
    """

    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    scan_layers: bool = False
    remat: Remat = "none"
    attention: Impl = "auto"
    attention_block: int = 512
    lora_rank: int = 0
    lora_alpha: float = 0.0

    def __post_init__(self):
        if self.family not in _ARCH_OF_FAMILY:
            raise ValueError(f"family={self.family!r}; supported: {sorted(_ARCH_OF_FAMILY)}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={self.remat!r}; expected one of {REMAT_POLICIES}")
        if self.attention not in IMPLS:
            raise ValueError(f"model.attention={self.attention!r}; expected one of {IMPLS}")
        if self.attention == "splash":
            check_block(self.attention_block)
        elif self.attention_block <= 0:
            raise ValueError(f"model.attention_block={self.attention_block} must be positive")
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"rope_scaling type {kind!r}; supported: {SUPPORTED_ROPE_TYPES}")

    def __hash__(self):
        # rope_scaling is a dict; hash it as sorted items so the config can be a static jit arg
        # (it sits in the model's nnx GraphDef).
        return hash(tuple(_hashable(getattr(self, f.name)) for f in dataclasses.fields(self)))

    def replace(self, **changes) -> ModelConfig:
        """Returns a copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | os.PathLike, **runtime) -> ModelConfig:
        """Parses a Hugging Face ``config.json`` (a dict, the file, or its directory).

        Args:
          config: the parsed dict, a path to config.json, or a model directory holding one.
          **runtime: runtime options (``scan_layers``, ``remat``, ``attention``,
            ``attention_block``).

        Returns:
          The ``ModelConfig``.

        Raises:
          ValueError: unsupported architecture (the message lists the supported ones), or a
            feature of the checkpoint this decoder does not implement.
        """
        source = "config dict"
        if not isinstance(config, dict):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no config.json at {path}")
            source = path
            with open(path) as f:
                config = json.load(f)
        family = _family_of(config, source)
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
        kind = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if kind == "default" else rope
        if family != "llama" and config.get("use_sliding_window", False):
            raise ValueError(f"{source}: use_sliding_window=True is not supported")
        if family == "llama" and (config.get("attention_bias") or config.get("mlp_bias")):
            raise ValueError(f"{source}: llama attention_bias/mlp_bias are not supported")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act={config['hidden_act']!r}; only 'silu'")
        heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim") or int(config["hidden_size"]) // heads
        return cls(
            family=family,
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=config.get("eos_token_id"),
            pad_token_id=config.get("pad_token_id"),
            **runtime,
        )

    def to_hf(self) -> dict[str, Any]:
        """Returns a Hugging Face ``config.json`` dict that ``transformers`` loads."""
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        out: dict[str, Any] = {
            "architectures": [_ARCH_OF_FAMILY[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "use_cache": True,
        }
        if self.family == "qwen3":
            out["attention_bias"] = self.qkv_bias
        if self.family == "llama":
            out.update(attention_bias=False, mlp_bias=False)
        if self.family != "llama":
            out.update(use_sliding_window=False, sliding_window=None)
        return out

    @classmethod
    def tiny(cls, family: Family = "qwen3", **overrides) -> ModelConfig:
        """A small config of ``family`` for tests and demos (random init, runs on a laptop CPU).

        Examples:
          >>> ModelConfig.tiny("llama", num_layers=3).num_layers
          3
        """
        base: dict[str, Any] = dict(
            family=family,
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            tie_word_embeddings=family != "llama",
        )
        if family == "llama":
            base.update(
                rope_theta=500000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            )
        base.update(overrides)
        return cls(**base)


def _hashable(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return tuple(value) if isinstance(value, list) else value


def _family_of(config: dict[str, Any], source: str) -> Family:
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    if not archs and config.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[config["model_type"]]
    raise ValueError(
        f"{source}: unsupported architecture {archs or config.get('model_type')!r}; supported: "
        f"{sorted(SUPPORTED_ARCHITECTURES)}"
    )
