"""What a sampler call returns (:class:`SamplerOutput`, the same from both engines) and the one
copy of device arrays to the host (:func:`to_host`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jaxtyping import Array, Bool, Float, Int

__all__ = ["SamplerOutput", "to_host"]


def to_host(array: jax.Array) -> np.ndarray:
    """A device array as NumPy; arrays spanning several processes are gathered first."""
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(array)


@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """Result of :meth:`Sampler.generate`; rows are prompt-major (row ``i * n + j``).

    Device arrays keep the bucket shapes (R = prompt batch bucket * n rows, G generation bucket);
    rows ``>= num_rows`` are padding with length 0. Positions at or after a row's length hold
    ``pad_token_id`` and log-prob 0. The list properties cover the real rows only and are built
    on first access (one device-to-host copy).

    Attributes:
      token_array: int32 [R, G] generated ids (stop token included).
      logprob_array: f32 [R, G] log-prob under the distribution each token was drawn from.
      untruncated_logprob_array: f32 [R, G] log-prob under ``log_softmax(logits / temperature)``
        (temperature 1 for greedy).
      length_array: int32 [R] generated tokens per row.
      hidden_array: [R, G, H] final hidden state that produced each token's logits (compute
        dtype), or None unless ``return_hidden``.
      prompt_array: int32 [R, P] left-padded prompt of each row.
      prompt_mask_array: bool [R, P] real prompt tokens.
      num_steps: int32 scalar, generated columns when the loop exited (the longest row).
      num_rows: real rows, ``len(prompts) * n``.
      engine_stats: what the continuous engine did (slot occupancy, pages), else None.
      action_mask_array: bool [R, G] for multi-turn requests (``turns``): True at the tokens the
        model sampled, False at observations (and after the length); None for one turn.
      drafted_array: int8 [R, G] for speculative requests (``draft_tokens > 0``): each token's
        draft outcome (:data:`~delta_jax.sampling.speculation.speculate.DRAFT_OUTCOMES`: 0 none
        drafted at its index, 1 a drafted token rejected there, 2 the drafted token accepted);
        else None.
    """

    token_array: Int[Array, "R G"]
    logprob_array: Float[Array, "R G"]
    untruncated_logprob_array: Float[Array, "R G"]
    length_array: Int[Array, " R"]
    hidden_array: Float[Array, "R G H"] | None
    prompt_array: Int[Array, "R P"]
    prompt_mask_array: Bool[Array, "R P"]
    num_steps: Int[Array, ""]
    num_rows: int
    engine_stats: Any = None
    action_mask_array: Bool[Array, "R G"] | None = None
    drafted_array: Int[Array, "R G"] | None = None

    @functools.cached_property
    def lengths(self) -> list[int]:
        """Generated tokens per real row."""
        return to_host(self.length_array)[: self.num_rows].tolist()

    def _ragged(self, array: jax.Array) -> list[list]:
        host = to_host(array)
        return [host[r, :length].tolist() for r, length in enumerate(self.lengths)]

    @functools.cached_property
    def tokens(self) -> list[list[int]]:
        """Generated ids per real row (without padding)."""
        return self._ragged(self.token_array)

    @functools.cached_property
    def logprobs(self) -> list[list[float]]:
        """Behaviour log-probs per real row."""
        return self._ragged(self.logprob_array)

    @functools.cached_property
    def untruncated_logprobs(self) -> list[list[float]]:
        """Untruncated temperature-scaled log-probs per real row."""
        return self._ragged(self.untruncated_logprob_array)
