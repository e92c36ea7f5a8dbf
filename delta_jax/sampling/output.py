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

__all__ = ["Carry", "SamplerOutput", "to_host"]


def to_host(array: jax.Array) -> np.ndarray:
    """A device array as NumPy; arrays spanning several processes are gathered first."""
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(array)


@dataclasses.dataclass(frozen=True)
class Carry:
    """One row of a partial rollout, to be continued by a later ``Sampler.generate`` call
    (``carried=``) or passed through it when it has ended (``finished``).

    Every sequence draws its token ``t`` with ``fold_in(fold_in(fold_in(key(seed), prompt),
    sample), t)``: ``seed``, ``prompt`` and ``sample`` are the identity the row was drawn with
    (the call and row that started it), kept wherever it is continued, so that the continued
    row draws the tokens an uninterrupted call would have.

    Attributes:
      tokens: the ids drawn so far.
      logprobs: their behaviour log-probs.
      untruncated: their untruncated log-probs.
      seed: the uint32 seed of the call that started the row.
      prompt, sample: the row's prompt and sample index in that call.
      finished: the row has ended (a stop id or its budget).
      observed: multi-turn rows: the columns ``[start, end)`` of ``tokens`` that are
        observations (written by the host, not sampled; their log-probs 0), in order.
      turns: multi-turn rows: the turns handed to the host so far.
    """

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    untruncated: tuple[float, ...]
    seed: int
    prompt: int
    sample: int
    finished: bool = False
    observed: tuple[tuple[int, int], ...] = ()
    turns: int = 0


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
      finished_array: bool [num_rows] (continuous engine): the row has ended; False for rows
        a ``quota`` stopped (partial rollouts), which hold their tokens so far. None from the
        static sampler.
      key_array: int [num_rows, 3] (continuous engine): the RNG identity each row was drawn
        with (seed, prompt, sample; see :class:`Carry`). None from the static sampler.
      turns_array: int [num_rows] for multi-turn requests: the turns each row handed to the
        host; else None.
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
    finished_array: np.ndarray | None = None
    key_array: np.ndarray | None = None
    turns_array: np.ndarray | None = None

    def carry(self, row: int) -> Carry:
        """Row ``row`` as a :class:`Carry`, for a later call to continue (or pass through when
        it has ended). Continuous engine only."""
        if self.finished_array is None or self.key_array is None:
            raise ValueError("carry() needs the output of Sampler(engine='continuous')")
        if not 0 <= row < self.num_rows:
            raise ValueError(f"row {row} is outside the output's {self.num_rows} rows")
        seed, prompt, sample = (int(x) for x in self.key_array[row])
        observed, turns = (), 0
        if self.action_mask_array is not None:  # multi-turn: its observations and turns
            sampled = self._action_mask[row, : self.lengths[row]]
            edges = np.flatnonzero(np.diff(np.concatenate([[1], sampled, [1]]).astype(np.int8)))
            observed = tuple((int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True))
            turns = int(self.turns_array[row])
        return Carry(
            tokens=tuple(self.tokens[row]),
            logprobs=tuple(self.logprobs[row]),
            untruncated=tuple(self.untruncated_logprobs[row]),
            seed=seed,
            prompt=prompt,
            sample=sample,
            finished=bool(self.finished_array[row]),
            observed=observed,
            turns=turns,
        )

    @functools.cached_property
    def _action_mask(self) -> np.ndarray:
        """The action mask on the host, copied once for every row's :meth:`carry`."""
        return to_host(self.action_mask_array)

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
