"""Speculative decoding on device: drafts read from the windows the host prepares, and which
drafted tokens a verify step keeps.

Once per decode chunk the host's drafter (:meth:`~delta_jax.sampling.drafts.Drafter.window`)
gives every slot a *window*: text its sequence may go on with (continuations from its own text,
its siblings', earlier steps' rollouts), each piece led by the ``m`` tokens it was matched on
and followed by a -1. Inside the chunk each slot keeps its *place* in its window, the index of
the token it expects next (-1: none):

* :func:`window_drafts`: the next ``k`` window tokens from the place (a draft ends at a -1);
* :func:`accepted_tokens`: a verify step emits the token drawn at the first position, and one
  more for each drafted token, in order, equal to the token drawn at its index;
* :func:`follow`: after the step the place moves on by the emitted tokens while they are the
  window's; otherwise it is found again where the window holds the sequence's last ``m``
  tokens (the first such place), or lost until the next chunk.

The tokens emitted do not depend on the drafts: the token drawn at index ``count + j`` uses
that index's key, as decoding without speculation does, and is kept only when every drafted
token before it was accepted (so its context is the one decoding without speculation had).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Int

__all__ = ["accepted_tokens", "follow", "window_drafts"]


def window_drafts(
    window: Int[Array, "S D"], place: Int[Array, " S"], k: int
) -> tuple[Int[Array, "S k"], Int[Array, " S"]]:
    """Each slot's next ``k`` window tokens from its place, and how many there are (up to the
    window's end or a -1; 0 without a place). Tokens past a draft's length are 0."""
    D = window.shape[1]
    at = place[:, None] + jnp.arange(k)
    tokens = jnp.take_along_axis(window, jnp.clip(at, 0, D - 1), axis=1)
    there = (place[:, None] >= 0) & (at < D) & (tokens >= 0)
    length = jnp.sum(jnp.cumprod(there, axis=1), axis=1)
    return jnp.where(jnp.arange(k) < length[:, None], tokens, 0), length


def accepted_tokens(
    drafts: Int[Array, "S k"], draft_len: Int[Array, " S"], drawn: Int[Array, "S k1"]
) -> Int[Array, " S"]:
    """Tokens a verify step emits per slot: 1, plus the drafted tokens that, in order, equal the
    token drawn at their index.

    ``drawn[:, j]`` is the token drawn at index ``count + j`` with that index's key, given the
    first ``j`` drafted tokens as context: the token decoding without speculation draws there
    whenever those are the tokens it drew. A drafted token ``d`` is therefore accepted with
    probability ``p(d)``, and on a rejection the emitted token is drawn from ``p`` without
    ``d``, renormalised: the speculative-sampling rule for a deterministic draft, realised with
    the same draws as decoding without speculation. ``draft_len`` (``<= k``): each slot's
    drafted tokens; the rest of its row is ignored.
    """
    k = drafts.shape[1]
    match = (drafts == drawn[:, :k]) & (jnp.arange(k) < draft_len[:, None])
    return 1 + jnp.sum(jnp.cumprod(match, axis=1), axis=1)


def follow(
    window: Int[Array, "S D"],
    place: Int[Array, " S"],
    tail: Int[Array, "S m"],
    emitted: Int[Array, "S k1"],
    taken: Int[Array, " S"],
) -> tuple[Int[Array, " S"], Int[Array, "S m"]]:
    """Each slot's place and last ``m`` tokens after it emitted ``emitted[:, :taken]``.

    ``tail``: the sequence's last ``m`` tokens before them (-1 where it has fewer). A slot
    that emitted nothing keeps both.
    """
    S, D = window.shape
    m, k1 = tail.shape[1], emitted.shape[1]
    joined = jnp.concatenate([tail, emitted], axis=1)
    new_tail = jnp.take_along_axis(joined, taken[:, None] + jnp.arange(m), axis=1)
    # Still on the window: every emitted token is the window's next one.
    j = jnp.arange(k1)
    at = place[:, None] + j
    ahead = jnp.take_along_axis(window, jnp.clip(at, 0, D - 1), axis=1)
    same = (j >= taken[:, None]) | ((at < D) & (ahead == emitted))
    on = (place >= 0) & jnp.all(same, axis=1)
    # Lost: the first place whose m tokens before it are the sequence's last m (the most
    # window after it).
    starts = max(D - m + 1, 0)  # a window shorter than m holds no place
    hits = jnp.ones((S, starts), bool)
    for r in range(m):
        hits &= window[:, r : r + starts] == new_tail[:, r : r + 1]
    hits &= jnp.all(new_tail >= 0, axis=1, keepdims=True)
    first = jnp.min(jnp.where(hits, jnp.arange(starts) + m, D + 1), axis=1, initial=D + 1)
    found = jnp.where(first <= D, first, -1)
    moved = taken > 0
    new_place = jnp.where(on, place + taken, found).astype(place.dtype)
    return jnp.where(moved, new_place, place), jnp.where(moved[:, None], new_tail, tail)
