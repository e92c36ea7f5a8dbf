"""The model a plan is for: its ``ModelConfig`` from a local or cached ``config.json``, the demo
model, or a known hub model's published shape (the planner never downloads weights).

A hub id resolves without the network when it can: the local Hugging Face cache first, then the
bundled shapes below for the models the shipped configs name (Qwen3-0.6B ... 14B, base or not).
Only another id is fetched (``config.json`` alone), after a short check that the hub answers:
offline, that is one line, not a minute of retries.
"""

from __future__ import annotations

import os
import socket
import urllib.parse
from collections.abc import Callable
from typing import Any

import huggingface_hub.constants
from huggingface_hub import try_to_load_from_cache

from delta_jax import hub
from delta_jax.models import ModelConfig, gguf, pypi
from delta_jax.models.hf import model_config_file, resolve_model_dir

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
    short = known_model(name)
    if short is None:
        raise ValueError(
            f"model {name!r} is not a local directory or cached hub id, and not one "
            f"of the planner's known models {sorted(KNOWN_MODELS)}"
        )
    return ModelConfig(**KNOWN_MODELS[short], **runtime)


def known_model(name: str) -> str | None:
    """The bundled shape's key for a hub id or short name (``Qwen/Qwen3-8B-Base``), or None."""
    short = name.rstrip("/").split("/")[-1].removesuffix("-Base")
    return short if short in KNOWN_MODELS else None


def _cached_config(repo_id: str, revision: str | None) -> str | None:
    """``config.json`` of ``repo_id`` in the local Hugging Face cache (no network), or None."""
    found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    return found if isinstance(found, str) else None


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub endpoint (``HF_ENDPOINT``) accepts a connection within ``timeout``."""
    url = urllib.parse.urlsplit(huggingface_hub.constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def resolve_model_config(config, log: Callable[[str], None] | None = None):
    """The run's ``ModelConfig``: the demo model, a local directory's or the cache's
    ``config.json``, a bundled shape (one ``log`` line says so), or ``config.json`` from the hub.

    Raises:
      FileNotFoundError: (one line) an id neither cached nor bundled while the hub is
        unreachable or ``HF_HUB_OFFLINE`` is set; a path that is no model directory.
    """
    m = config.model
    runtime = dict(
        scan_layers=m.scan_layers,
        remat=m.remat,
        attention=m.attention,
        attention_block=m.attention_block,
    )
    if m.path == "demo:tiny":
        return ModelConfig.tiny("qwen3", **runtime)
    if pypi.is_package_model(m.path) or gguf.is_gguf(m.path):  # shapes from the file's metadata
        path = resolve_model_dir(m.path)
        return ModelConfig.from_hf(gguf.read_config(gguf.open_gguf(path), path), **runtime)
    if os.path.isdir(m.path) or not hub.looks_like_hub_id(m.path):
        return ModelConfig.from_hf(model_config_file(m.path, revision=m.revision), **runtime)
    cached = _cached_config(m.path, m.revision)
    if cached is not None:
        return ModelConfig.from_hf(cached, **runtime)
    if known_model(m.path):
        (log or print)(
            f"model: {m.path} config.json is not in the local Hugging Face cache; planning with "
            "its published shape bundled in delta_jax.plan.models (no download)"
        )
        return known_model_config(m.path, **runtime)
    if not hub.offline() and not hub_reachable():
        raise hub.HubError(
            f"model {m.path!r}: config.json is not in the local cache and the hub "
            f"({huggingface_hub.constants.ENDPOINT}) does not answer: check the network (or "
            "HF_ENDPOINT), or give model.path a local model directory"
        )
    return ModelConfig.from_hf(model_config_file(m.path, revision=m.revision), **runtime)


def describe(path: str, mc) -> str:
    return (
        f"{path} (L={mc.num_layers} H={mc.hidden_size} F={mc.intermediate_size} "
        f"N={mc.num_heads} K={mc.num_kv_heads} V={mc.vocab_size})"
    )
