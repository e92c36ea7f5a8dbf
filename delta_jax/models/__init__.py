"""Qwen3 / Qwen2.5 / Llama-3 decoders in Flax NNX with Hugging Face import/export.

Examples:
  >>> from delta_jax.models import from_pretrained, token_logprobs
  >>> model = from_pretrained("/models/Qwen3-0.6B")  # doctest: +SKIP
  >>> out = model(input_ids, attention_mask=mask)  # doctest: +SKIP
  >>> out.logits.shape, out.hidden.shape  # doctest: +SKIP
  ((B, T, V), (B, T, H))
"""

from delta_jax.models.axes import DEFAULT_RULES, constrain, logical_to_mesh
from delta_jax.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from delta_jax.models.hf import from_pretrained, resolve_model_dir, save_pretrained
from delta_jax.models.logprobs import LogprobOutput, chunked_logprobs, token_logprobs
from delta_jax.models.tokenizer import apply_chat_template, load_tokenizer
from delta_jax.models.transformer import KVCache, ModelOutput, Transformer, lm_head_weight

__all__ = [
    "DEFAULT_RULES",
    "KVCache",
    "LogprobOutput",
    "ModelConfig",
    "ModelOutput",
    "SUPPORTED_ARCHITECTURES",
    "Transformer",
    "apply_chat_template",
    "chunked_logprobs",
    "constrain",
    "from_pretrained",
    "lm_head_weight",
    "load_tokenizer",
    "logical_to_mesh",
    "resolve_model_dir",
    "save_pretrained",
    "token_logprobs",
]
