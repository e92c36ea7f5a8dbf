"""Prompt text -> token ids: user template, chat template (or a plain fallback), length policy.

For each record the user message is ``record.prompt``, or ``template`` with its literal
``{prompt}`` replaced by it (other braces are kept, so ``\\boxed{}`` needs no escaping). The
system message is ``record.system``, else ``system_prompt``, else none. Then:

* tokenizer with a chat template: ``apply_chat_template(messages, add_generation_prompt=True,
  tokenize=False)``, tokenised with ``add_special_tokens=False`` (the template already writes
  any BOS, so adding one would double it);
* tokenizer without one (base models): the plain text ``PLAIN_FORMAT`` (``system + "\\n\\n" +
  user``, or the user message alone), tokenised with ``add_special_tokens=True``.

Prompts longer than ``max_prompt_length`` tokens are dropped and counted (``"drop"``), or cut
from the left (``"left"``) so the end of the prompt, next to the generation, is kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from delta_jax.data.sources import PromptRecord

PLAIN_FORMAT = "{system}\n\n{prompt}"
DEMO_TEMPLATE = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclasses.dataclass(frozen=True)
class EncodedPrompts:
    """Token ids of the prompts kept, aligned with their records.

    Attributes:
      ids: one list of token ids per kept prompt, each at most ``max_prompt_length`` long.
      records: the kept records, ``records[i]`` is the source of ``ids[i]``.
      dropped: prompts dropped for length (``truncation="drop"``).
      truncated: prompts cut from the left (``truncation="left"``).
    """

    ids: list[list[int]]
    records: list[PromptRecord]
    dropped: int
    truncated: int = 0


def render_prompt(
    record: PromptRecord,
    tokenizer: Any,
    *,
    system_prompt: str | None = None,
    template: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt text for ``record``, chat-templated when the tokenizer has a chat template.

    Args:
      record: the prompt.
      tokenizer: a ``transformers`` tokenizer.
      system_prompt: system message for records that carry none.
      template: user-message format containing ``{prompt}``.
      tools: tool schemas the chat template declares (an environment's ``tools``); ignored
        without a chat template.

    Returns:
      The text to tokenise (ending with the assistant header when chat-templated).
    """
    user = record.prompt if template is None else template.replace("{prompt}", record.prompt)
    system = record.system if record.system is not None else system_prompt
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": user})
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False
        )
    return PLAIN_FORMAT.format(system=system, prompt=user) if system else user


def encode_prompts(
    records: Sequence[PromptRecord],
    tokenizer: Any,
    *,
    max_prompt_length: int,
    truncation: str = "drop",
    system_prompt: str | None = None,
    template: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> EncodedPrompts:
    """Tokenises prompts and applies the max-prompt-length policy.

    Let ``x`` be the ids of a rendered prompt and ``P = max_prompt_length``. If ``len(x) <= P``
    it is kept as is; otherwise ``"drop"`` removes it (counted in ``dropped``) and ``"left"``
    keeps ``x[-P:]`` (counted in ``truncated``).

    Args:
      records: the prompts, length B.
      tokenizer: a ``transformers`` tokenizer (fast or slow).
      max_prompt_length: P, positive.
      truncation: ``"drop"`` or ``"left"``.
      system_prompt: system message for records that carry none.
      template: user-message format containing the literal ``{prompt}``.
      tools: tool schemas for the chat template (see :func:`render_prompt`).

    Returns:
      :class:`EncodedPrompts` with at most B prompts, order preserved.

    Example::

      enc = encode_prompts(records, tok, max_prompt_length=512, template=DEMO_TEMPLATE)
      sampler.generate(enc.ids, max_new_tokens=1024)
    """
    if not isinstance(max_prompt_length, int) or max_prompt_length <= 0:
        raise ValueError(f"max_prompt_length must be a positive int, got {max_prompt_length!r}")
    if truncation not in ("drop", "left"):
        raise ValueError(f"truncation must be 'drop' or 'left', got {truncation!r}")
    if template is not None and "{prompt}" not in template:
        raise ValueError(f"template must contain the literal '{{prompt}}', got {template!r}")
    records = list(records)
    if not records:
        return EncodedPrompts(ids=[], records=[], dropped=0)
    texts = [
        render_prompt(r, tokenizer, system_prompt=system_prompt, template=template, tools=tools)
        for r in records
    ]
    chat = bool(getattr(tokenizer, "chat_template", None))
    all_ids = tokenizer(texts, add_special_tokens=not chat)["input_ids"]
    ids, kept, dropped, truncated = [], [], 0, 0
    for record, x in zip(records, all_ids, strict=True):
        x = list(x)
        if len(x) > max_prompt_length:
            if truncation == "drop":
                dropped += 1
                continue
            x = x[-max_prompt_length:]
            truncated += 1
        ids.append(x)
        kept.append(record)
    return EncodedPrompts(ids=ids, records=kept, dropped=dropped, truncated=truncated)
