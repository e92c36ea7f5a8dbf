"""How a request's decode chunks produce tokens, as one object the engine's host side calls
whatever the way: :class:`PlainDecoding` (decode steps, one token per slot and step: it drafts
nothing) or :class:`Drafting` (verify steps of drafted tokens, the drafts from a
:class:`~delta_jax.sampling.speculation.drafts.Drafter`), and :class:`AutoDrafting`, which
picks one of the two per request
(:class:`~delta_jax.sampling.speculation.auto_speculation.AutoSpeculation`).

The scheduler asks the object for the tokens a step may emit (the pages a chunk needs), tells it
about a request's start and end, a preempted sequence's restart and observations, and has it run
each decode chunk (:meth:`Speculation.decode`) and book what the chunk emitted
(:meth:`Speculation.record`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from delta_jax.sampling.speculation.auto_speculation import AutoSpeculation
from delta_jax.sampling.speculation.drafts import Drafter

__all__ = [
    "PLAIN",
    "AutoDrafting",
    "Chunk",
    "Drafting",
    "PlainDecoding",
    "Speculation",
    "speculation_for",
]


class Chunk(NamedTuple):
    """What a decode chunk returned: the slots' status and, for verify steps, the tokens each
    slot emitted ``[S, E]`` (-1 after them) and its counters ``[S, 1 + 2 * sources]``."""

    status: np.ndarray
    emitted: np.ndarray | None = None
    counts: np.ndarray | None = None


class Speculation:
    """The way a request's decode chunks run, as the engine's host side calls it; its methods
    here are plain decoding's (:class:`PlainDecoding`).

    Examples:
      >>> plain = PlainDecoding()
      >>> plain.drafting, plain.for_request() is plain
      (False, True)
    """

    drafting = False  # verify steps, whose drafts are fresh at every chunk

    def tokens_per_step(self, spec) -> int:
        """Most tokens a slot emits per step of a chunk of ``spec`` (an ``EngineSpec``)."""
        return 1

    def for_request(self) -> Speculation:
        """The way the next request decodes (this one)."""
        return self

    def record_request(self, way: Speculation, seconds: float, tokens: int) -> None:
        """A request decoded ``way`` took ``seconds`` for ``tokens`` generated tokens."""

    def begin(self, prompts: Sequence[np.ndarray], n: int) -> None:
        """A request starts: ``n`` samples of each of ``prompts``."""

    def finish(self) -> None:
        """The request ended."""

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        """Request row ``row``'s text goes on with ``tokens`` (an observation)."""

    def truncate(self, row: int, length: int) -> None:
        """Request row ``row`` restarts from its first ``length`` tokens (preempted)."""

    def decode(self, spec, programs, packed, pages, steps: int, rows: list, refill=0) -> Chunk:
        """Runs one decode chunk of ``programs`` (the engine's ``DevicePrograms``) on the packed
        slot matrix and page list; ``rows``: each chunk row's request row (None: idle);
        ``refill``: see ``DevicePrograms.decode``."""
        return Chunk(programs.decode(packed, pages, steps, refill))

    def record(self, chunk: Chunk, rows: list[int | None], new: np.ndarray, stats) -> None:
        """Books the chunk that emitted ``new[i]`` tokens for chunk row ``i`` into ``stats``
        (``EngineStats``): it ran as many steps as its busiest row."""
        stats.decode_steps += int(new.max(initial=0)) * len(new)


class PlainDecoding(Speculation):
    """Decode steps: every live slot draws one token per step; nothing is drafted."""


class Drafting(Speculation):
    """Verify steps: every live slot scores up to ``k`` drafted tokens per step, looked up on
    device in the window of the request's texts ``drafter`` gives it at each chunk's start (its
    history of earlier requests kept across them).

    Examples:
      >>> way = Drafting(Drafter(3))
      >>> way.drafting, way.window_size(4)
      (True, 512)
    """

    drafting = True

    def __init__(self, drafter: Drafter):
        self.drafter = drafter

    def window_size(self, steps: int) -> int:
        """Each slot's draft window for a chunk of ``steps`` verify steps."""
        return self.drafter.window_size(steps)

    def tokens_per_step(self, spec) -> int:
        return 1 + spec.draft_tokens

    def begin(self, prompts, n) -> None:
        self.drafter.begin(prompts, n)

    def finish(self) -> None:
        self.drafter.finish()  # the request's texts join its prompts' history

    def extend(self, row, tokens) -> None:
        self.drafter.extend(row, tokens)

    def truncate(self, row, length) -> None:
        self.drafter.truncate(row, length)

    def decode(self, spec, programs, packed, pages, steps, rows, refill=0) -> Chunk:
        drafts = self.drafter.drafts(rows, spec.draft_window)
        return Chunk(*programs.verify(packed, pages, steps, drafts, refill))

    def record(self, chunk, rows, new, stats) -> None:
        self.drafter.extend_rows(rows, chunk.emitted, new)
        stats.add_verify(chunk.counts)


class AutoDrafting(Drafting):
    """:class:`Drafting` or :class:`PlainDecoding` per request, whichever ``auto`` finds faster
    (:class:`~delta_jax.sampling.speculation.auto_speculation.AutoSpeculation`)."""

    def __init__(self, drafter: Drafter, auto: AutoSpeculation):
        super().__init__(drafter)
        self.auto = auto

    def for_request(self) -> Speculation:
        return self if self.auto.next() else PLAIN

    def record_request(self, way, seconds, tokens) -> None:
        self.auto.record(way.drafting, seconds, tokens)


PLAIN = PlainDecoding()


def speculation_for(speculate: Any, drafter: Drafter | None, platform: str) -> Speculation:
    """The way a sampler decodes for ``speculate`` (False, True or ``"auto"``, on
    ``platform``): with ``drafter``'s drafts unless False (then it is not used)."""
    if not speculate:
        return PLAIN
    if speculate == "auto":
        return AutoDrafting(drafter, AutoSpeculation(platform))
    return Drafting(drafter)
