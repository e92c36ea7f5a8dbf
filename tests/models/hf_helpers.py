"""Builders for tiny random Hugging Face checkpoints used by the model tests (no downloads)."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

# Tiny configs of each family: (name, transformers config class name, model class name, kwargs).
_COMMON = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
FAMILIES = {
    # Qwen3: q/k norm, head_dim (32) != hidden / heads (16), tied embeddings.
    "qwen3_tied": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=32, tie_word_embeddings=True, rope_theta=1e6),
    ),
    # Qwen2.5: q/k/v bias, untied.
    "qwen2_untied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    # Llama 3.1: llama3 RoPE scaling, untied; the original context (32) is below the test lengths
    # so every frequency band (scaled, interpolated, kept) matters.
    "llama31_untied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    ),
    # Llama 3.2 style: llama3 scaling with tied embeddings.
    "llama32_tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    ),
}


def build_hf_model(kind: str, seed: int = 0, **overrides):
    """A random-initialised ``transformers`` model of ``kind`` (float32, eval mode).

    ``overrides`` replace config values. Norm weights and biases are perturbed away from their
    1 / 0 init so that a misplaced norm or bias changes the logits.
    """
    import transformers

    cfg_name, model_name, extra = FAMILIES[kind]
    kwargs = dict(_COMMON, **extra) | overrides
    if "rope_theta" in kwargs and "rope_scaling" not in kwargs:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta")}
    config = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def save_hf_model(model, path: str) -> str:
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


def hf_logits(model, ids, attention_mask=None, position_ids=None):
    """float32 logits and last hidden state (post final norm) from the torch model."""
    kwargs = {}
    if attention_mask is not None:
        kwargs["attention_mask"] = torch.tensor(np.asarray(attention_mask), dtype=torch.long)
    if position_ids is not None:
        kwargs["position_ids"] = torch.tensor(np.asarray(position_ids), dtype=torch.long)
    with torch.no_grad():
        out = model(
            torch.tensor(np.asarray(ids), dtype=torch.long), output_hidden_states=True, **kwargs
        )
        base = model.model(torch.tensor(np.asarray(ids), dtype=torch.long), **kwargs)
    return (
        out.logits.float().numpy(),
        base.last_hidden_state.float().numpy(),
        out.hidden_states[-1].float().numpy(),
    )


def padded_batch(rng: np.random.RandomState, vocab: int, lengths, T: int, side: str):
    """ids [B, T] with pad id 0, mask [B, T], HF-style positions max(cumsum(mask) - 1, 0)."""
    B = len(lengths)
    ids = np.zeros((B, T), np.int32)
    mask = np.zeros((B, T), np.int32)
    for b, n in enumerate(lengths):
        sl = slice(T - n, T) if side == "left" else slice(0, n)
        ids[b, sl] = rng.randint(1, vocab, n)
        mask[b, sl] = 1
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    return ids, mask, positions


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, ids, mask):
    out = nnx.merge(graphdef, state)(ids, attention_mask=mask)
    return out.logits, out.hidden


def forward(model, ids, mask=None):
    """Jitted ``model(ids, attention_mask=mask)`` -> (logits, hidden) as NumPy arrays."""
    ids = jnp.asarray(ids)
    mask = jnp.ones(ids.shape, bool) if mask is None else jnp.asarray(mask).astype(bool)
    graphdef, state = nnx.split(model)
    logits, hidden = _forward(graphdef, state, ids, mask)
    return np.asarray(logits), np.asarray(hidden)


def random_model(cfg, seed: int = 0, dtype=jnp.float32):
    """A ``Transformer`` with NumPy-random parameters (no per-shape jitted RNG compiles).

    Weights ~ N(0, 0.1^2); norm weights 1 + N(0, 0.2^2); biases N(0, 0.2^2), so that every
    parameter matters for the output.
    """
    from delta_jax.models import Transformer

    model = nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, param_dtype=dtype))
    rng = np.random.RandomState(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = var.get_value().shape
        if "norm" in path[-1]:
            value = 1 + 0.2 * rng.randn(*shape)
        elif path[-1] in ("bq", "bk", "bv"):
            value = 0.2 * rng.randn(*shape)
        else:
            value = 0.1 * rng.randn(*shape)
        var.set_value(jnp.asarray(value, dtype))
    return model
