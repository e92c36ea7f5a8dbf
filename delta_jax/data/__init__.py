"""Prompt data: Hugging Face ``datasets`` loading, schema adapters, templates, grain batches.

Typical use::

  res = load_records("deepmath/train.parquet", adapter="deepmath", on_bad_row="skip")
  enc = encode_prompts(res.records, tokenizer, max_prompt_length=512)
  pipe = PromptPipeline(len(enc.ids), batch_size=64, seed=0,
                        process_index=jax.process_index(), process_count=jax.process_count())
  batch = [enc.ids[i] for i in next(pipe)]

A run's prompt sets (the training batches and the held-out prompts, from the ``data`` config
section) are built by ``delta_jax.data.prompt_sets``, imported on its own: it brings the demo's
problem generators, and with them Flax and Optax.
"""

from delta_jax.data.adapters import ADAPTERS, Adapter, BadRowError, generic_adapter
from delta_jax.data.pipeline import PromptPipeline
from delta_jax.data.sources import LoadResult, PromptRecord, load_records
from delta_jax.data.templates import (
    DEMO_TEMPLATE,
    PLAIN_FORMAT,
    EncodedPrompts,
    encode_prompts,
    render_prompt,
)

__all__ = [
    "ADAPTERS",
    "DEMO_TEMPLATE",
    "PLAIN_FORMAT",
    "Adapter",
    "BadRowError",
    "EncodedPrompts",
    "LoadResult",
    "PromptPipeline",
    "PromptRecord",
    "encode_prompts",
    "generic_adapter",
    "load_records",
    "render_prompt",
]
