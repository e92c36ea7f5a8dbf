"""The model a plan is for: its ``ModelConfig`` from a local or cached ``config.json``, the demo
model, or a known hub model's public shape (the planner never downloads weights)."""

from __future__ import annotations

from typing import Any

from delta_jax.models import ModelConfig
from delta_jax.models.hf import model_config_file

# Public hyper-parameters (config.json on the Hugging Face hub) of models the planner knows
# without a local copy; a local directory or cached hub id is read instead when present.
# name: (hidden H, mlp F, layers L, heads N, kv heads K, tied embeddings); all Qwen3 share the rest.
_QWEN3_SHAPES = {
    "Qwen3-0.6B": (1024, 3072, 28, 16, 8, True),
    "Qwen3-1.7B": (2048, 6144, 28, 16, 8, True),
    "Qwen3-4B": (2560, 9728, 36, 32, 8, True),
    "Qwen3-8B": (4096, 12288, 36, 32, 8, False),
    "Qwen3-14B": (5120, 17408, 40, 40, 8, False),
}

KNOWN_MODELS: dict[str, dict[str, Any]] = {
    name: dict(
        family="qwen3",
        vocab_size=151936,
        hidden_size=H,
        intermediate_size=F,
        num_layers=L,
        num_heads=N,
        num_kv_heads=K,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        qk_norm=True,
        max_position_embeddings=32768,
        tie_word_embeddings=tied,
        bos_token_id=151643,
        eos_token_id=151643,
    )
    for name, (H, F, L, N, K, tied) in _QWEN3_SHAPES.items()
}


def known_model_config(name: str, **runtime):
    """``ModelConfig`` of a known model by hub id (``Qwen/Qwen3-8B-Base``) or short name."""
    short = name.rstrip("/").split("/")[-1].removesuffix("-Base")
    if short not in KNOWN_MODELS:
        raise ValueError(
            f"model {name!r} is not a local directory or cached hub id, and not one "
            f"of the planner's known models {sorted(KNOWN_MODELS)}"
        )
    return ModelConfig(**KNOWN_MODELS[short], **runtime)


def resolve_model_config(config):
    """The run's ``ModelConfig``: local/cached ``config.json``, demo model, or a known model."""
    m = config.model
    runtime = dict(
        scan_layers=m.scan_layers,
        remat=m.remat,
        attention=m.attention,
        attention_block=m.attention_block,
    )
    if m.path == "demo:tiny":
        return ModelConfig.tiny("qwen3", **runtime)
    try:  # config.json only: the planner never downloads weights
        return ModelConfig.from_hf(model_config_file(m.path, revision=m.revision), **runtime)
    except FileNotFoundError:
        return known_model_config(m.path, **runtime)


def describe(path: str, mc) -> str:
    return (
        f"{path} (L={mc.num_layers} H={mc.hidden_size} F={mc.intermediate_size} "
        f"N={mc.num_heads} K={mc.num_kv_heads} V={mc.vocab_size})"
    )
