"""Partial rollouts' request checks: a ``quota`` of prompts whose samples have all ended, and
rows ``carried`` from an earlier call (:class:`~delta_jax.sampling.output.Carry`), refused with
one ``ValueError`` before any compilation when the request cannot run them.

The continuous engine stops a call once ``quota`` prompts have all their ``n`` samples ended
(after the decode chunk in which that happens) and returns the other rows unfinished, with
their tokens so far; a later call continues them from there (their prompt and tokens prefilled
under the current weights, drawing on with the key of each column, so the tokens are those an
uninterrupted call would have drawn under the same weights). See
:mod:`~delta_jax.sampling.engine.scheduler` for when a call stops.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from delta_jax.sampling.output import Carry

__all__ = ["PartialRequest", "validate_partial"]


@dataclasses.dataclass(frozen=True)
class PartialRequest:
    """What a partial-rollout check reads of a request: its engine, its rows (``prompts`` x
    ``n``) and their budgets ``max_new [R]``, the vocabulary size, and whether it is multi-turn
    (``turns``) or returns hidden states."""

    engine: str
    prompts: int
    n: int
    max_new: np.ndarray
    vocab_size: int
    multi_turn: bool = False
    return_hidden: bool = False


def validate_partial(
    request: PartialRequest, quota: int | None, carried: list[Carry | None] | None
) -> tuple[Carry | None, ...] | None:
    """Checks ``quota`` and ``carried`` for ``request``; returns the carried rows as a tuple
    (None when no row is carried).

    Raises:
      ValueError: the static engine, a quota out of ``[1, prompts]``, a carried list of the
        wrong length or with a row that is not a :class:`Carry`, hidden states with carried
        rows, a carried row whose lists differ in length, hold ids outside the vocabulary,
        leave no room in its budget, or has ended without a token, or whose observations or
        turns do not fit its tokens or the request (single-turn rows have none).
    """
    if quota is None and carried is None:
        return None
    if request.engine != "continuous":
        raise ValueError("quota and carried (partial rollouts) need Sampler(engine='continuous')")
    if quota is not None:
        if isinstance(quota, bool) or not isinstance(quota, int):
            raise ValueError(f"quota must be an int or None, got {quota!r}")
        if not 1 <= quota <= request.prompts:
            raise ValueError(f"quota must be in [1, {request.prompts}] (the prompts), got {quota}")
    if carried is None:
        return None
    rows = request.prompts * request.n
    if len(carried) != rows:
        raise ValueError(f"carried has {len(carried)} entries; the request has {rows} rows")
    for r, carry in enumerate(carried):
        _check_carry(request, r, carry)
    if all(c is None for c in carried):
        return None
    if request.return_hidden:
        raise ValueError("return_hidden is not supported with carried rows")
    return tuple(carried)


def _check_carry(request: PartialRequest, r: int, carry: Carry | None) -> None:
    if carry is None:
        return
    where = f"carried[{r}]"
    if not isinstance(carry, Carry):
        raise ValueError(f"{where} must be a Carry or None, got {type(carry).__name__}")
    size = len(carry.tokens)
    if len(carry.logprobs) != size or len(carry.untruncated) != size:
        raise ValueError(f"{where}: tokens, logprobs and untruncated differ in length")
    if any(not 0 <= int(t) < request.vocab_size for t in carry.tokens):
        raise ValueError(f"{where}: a token is outside the vocabulary ({request.vocab_size})")
    if not 0 <= int(carry.seed) < 2**32 or min(carry.prompt, carry.sample) < 0:
        raise ValueError(f"{where}: seed must be a uint32 and prompt, sample >= 0")
    _check_turns(request, where, carry)
    budget = int(request.max_new[r])
    if carry.finished and not 1 <= size <= budget:
        raise ValueError(
            f"{where} has ended with {size} tokens; its max_new_tokens is {budget} (1 to it)"
        )
    if not carry.finished and size >= budget:
        raise ValueError(
            f"{where} has {size} tokens, no room left in its max_new_tokens {budget} to continue"
        )


def _check_turns(request: PartialRequest, where: str, carry: Carry) -> None:
    """A carried row's observations: ordered, disjoint column ranges inside its tokens, each
    after a turn handed over; none in a single-turn request."""
    if not request.multi_turn:
        if carry.observed or carry.turns:
            raise ValueError(f"{where} has turns or observations; the request is single-turn")
        return
    if isinstance(carry.turns, bool) or not isinstance(carry.turns, int) or carry.turns < 0:
        raise ValueError(f"{where}: turns must be an int >= 0, got {carry.turns!r}")
    end = 0
    for span in carry.observed:
        if len(span) != 2 or not end < span[0] < span[1] <= len(carry.tokens):
            raise ValueError(
                f"{where}: observed must be ordered column ranges [start, end) inside its "
                f"{len(carry.tokens)} tokens, each after a sampled token, got {carry.observed!r}"
            )
        end = span[1]
    if len(carry.observed) > carry.turns:
        raise ValueError(f"{where}: {len(carry.observed)} observations after {carry.turns} turns")
