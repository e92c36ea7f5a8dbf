"""The environment protocol, and the text helpers every environment shares.

An episode alternates model turns and observations::

    text = env.reset(row)                      # the first user turn
    context = chat_template([user(text)]) ...  # rendered by the caller
    while True:
        turn = generate(context, stop=env.stop_strings)
        result = env.step(turn)
        if result.done: break
        context += turn + render_observation(result.observation, tokenizer, messages=...)

The caller owns the context and the turn limit; the environment only reads turns and answers
them. Observations are context, not actions: the caller masks their tokens out of the loss.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

# The cut inside a truncated observation; the sandbox joins the ends of a long output with it.
from delta_jax.rewards.code import OUTPUT_CUT

# Observations of environments whose caller has no chat template (base models).
PLAIN_OBSERVATION = "\n```output\n{}\n```\n"

# Hugging Face fast tokenizers are Rust objects behind a RefCell: a call that changes their
# truncation or padding settings while another thread encodes raises "Already borrowed". One
# lock around our (short) tokenizer calls keeps concurrent episodes from meeting there.
_TOKENIZER_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What an environment answers to one model turn.

    Attributes:
      observation: the text that goes back to the model (a tool's output), or None when the
        episode is over.
      done: the episode is over; the turn was the final answer.
      reward: the episode's reward when the environment scores it itself; None leaves the
        scoring to the trainer's reward functions, which see the whole episode.
      info: what the turn did, for metrics: ``tool_call`` (bool), ``error`` (a short reason
        or None), ``exec`` (the sandbox's :class:`~delta_jax.rewards.ExecResult` or None).
    """

    observation: str | None
    done: bool
    reward: float | None = None
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """A multi-turn environment: one object per episode.

    Attributes:
      stop_strings: strings that end a model turn (the engine stops decoding at the first one
        and hands the turn, the stop string included, to :meth:`step`).
      tools: tool schemas (OpenAI / Hugging Face function format) the caller passes to the
        chat template as ``tools=`` so that the system prompt declares them; ``()`` for none.
    """

    stop_strings: tuple[str, ...]
    tools: tuple[Mapping[str, Any], ...]

    def reset(self, row: Mapping[str, Any]) -> str:
        """Starts an episode on a data row; the first user turn's text (no template applied)."""
        ...

    def step(self, turn: str) -> StepResult:
        """Answers one model turn (its text, ending at a stop string, EOS or the token limit)."""
        ...


def render_observation(
    observation: str,
    tokenizer: Any = None,
    *,
    messages: Sequence[Mapping[str, Any]] = (),
    tools: Sequence[Mapping[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """The text that follows a model turn in the context: the end of the turn, the observation
    as a ``tool`` message, and the next assistant header.

    With a chat template this is exactly what ``apply_chat_template`` renders after the
    assistant's content for ``[*messages, assistant turn, tool message]`` with
    ``add_generation_prompt=True``. The assistant's content is stood in by a random marker: the
    context already holds the turn as the model wrote it, and a template may re-render a turn's
    content (Qwen3 moves ``<think>`` into ``reasoning_content``, drops empty ones); only what
    comes after it is new. Without a chat template: :data:`PLAIN_OBSERVATION`.

    Args:
      observation: the environment's observation.
      tokenizer: a Hugging Face tokenizer, or None.
      messages: the conversation before this turn (system, user, then earlier assistant / tool
        pairs); some templates need it (Qwen3's refuses a conversation without a user query).
      tools: the tool schemas the prompt was rendered with (``Environment.tools``).
      **template_kwargs: passed to the template (``enable_thinking=False`` for Qwen3).

    Returns:
      The text to append to the context after the turn (tokenise it without special tokens).

    Example:
      >>> render_observation("42")
      '\\n```output\\n42\\n```\\n'
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return PLAIN_OBSERVATION.format(observation)
    marker = f"<<turn-{secrets.token_hex(8)}>>"
    conversation = [
        *messages,
        {"role": "assistant", "content": marker},
        {"role": "tool", "content": observation},
    ]
    text = tokenizer.apply_chat_template(
        conversation, tools=tools, tokenize=False, add_generation_prompt=True, **template_kwargs
    )
    at = text.find(marker)
    if at < 0:
        raise ValueError("render_observation: the chat template drops the assistant's content")
    return text[at + len(marker) :]


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """``text``'s ids, without special tokens (one tokenizer call at a time)."""
    with _TOKENIZER_LOCK:
        return list(tokenizer.encode(text, add_special_tokens=False))


def decode_ids(tokenizer: Any, ids: list[int]) -> str:
    """The text of ``ids``, special tokens kept, spaces as they are (one call at a time)."""
    with _TOKENIZER_LOCK:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def observation_length(text: str, tokenizer: Any = None) -> int:
    """Tokens of `text` (without special tokens) with a tokenizer, else its characters."""
    return len(text) if tokenizer is None else len(encode_text(tokenizer, text))


def truncate_middle(text: str, max_length: int, tokenizer: Any = None) -> str:
    """`text` cut to `max_length` tokens (characters without a tokenizer), middle out.

    When `text` is longer, the result is its first ``h`` and last ``t`` tokens joined by
    :data:`~delta_jax.rewards.code.OUTPUT_CUT`, with ``h + t = max_length - len(cut)``,
    ``h = (h + t) // 2``: a program's first lines and its last ones (where a traceback ends)
    both survive. Tokens are counted on the text alone; in context a token may merge across a
    boundary, so the rendered observation is within a token or two of the limit.

    Raises:
      ValueError: `max_length` leaves no room for both ends beside the cut.
    """
    cut = observation_length(OUTPUT_CUT, tokenizer)
    keep = max_length - cut
    if keep < 2:
        raise ValueError(
            f"max_observation_tokens must be >= {cut + 2} (the truncation marker takes {cut}), "
            f"got {max_length}"
        )
    if tokenizer is None:
        if len(text) <= max_length:
            return text
        head = keep // 2
        return text[:head] + OUTPUT_CUT + text[len(text) - (keep - head) :]
    ids = encode_text(tokenizer, text)
    if len(ids) <= max_length:
        return text
    head = keep // 2
    first = decode_ids(tokenizer, ids[:head])
    last = decode_ids(tokenizer, ids[len(ids) - (keep - head) :])
    return first + OUTPUT_CUT + last
