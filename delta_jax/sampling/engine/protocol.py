"""What the continuous engine's host side asks of the device: the :class:`DevicePrograms`
protocol, three programs over the page pool and the output buffers (prefill, decode or verify,
token writes: observations, carried rows) and the compiling ahead of them.
:class:`~delta_jax.sampling.engine.programs.EnginePrograms` implements it on a device; the
:class:`~delta_jax.sampling.engine.scheduler.Scheduler` calls nothing else, so it runs, and is
tested, with a stand-in that compiles nothing.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["DevicePrograms"]


class DevicePrograms(Protocol):
    """What the scheduler asks of the device: three programs over the pool and the output
    buffers the implementation owns; every argument is a NumPy array."""

    def prefill(self, ids, positions, valid, pages) -> None:
        """Writes the K/V of ``ids [B, T]`` at ``positions`` (where ``valid``) into the pages:
        a flat page list ``[U, 3]`` (page, seq, index), or page tables ``[B, NB]`` on the
        ``dense`` path."""

    def write(self, rows, cols, ids, valid, logprobs, untruncated) -> None:
        """Writes ``ids [S, T]`` with their ``logprobs`` and ``untruncated`` log-probs
        ``[S, T]`` into output row ``rows[s]`` (-1: none) from column ``cols[s]`` on
        (observations, log-probs zero; or a carried row's tokens)."""

    def decode(self, packed, pages, steps: int, refill: int = 0):
        """Runs up to ``steps`` decode steps of the packed ``[S, F]`` slot matrix
        (``SLOT_FIELDS``, stop ids, stop-sequence window, page table) over the page list
        ``[U, 3]``, ending early once ``refill`` >= 1 of the rows live at its start have ended
        (sequences wait for their slots); returns the slots' ``[S, 4 + L]`` status
        (``STATUS_FIELDS``, then the stop-sequence window of multi-turn requests with stop
        sequences of up to ``L`` ids)."""

    def compile_decode(self, packed, pages) -> None:
        """Compiles the :meth:`decode` program of these shapes without running it."""

    def compile_prefill(self, ids, positions, valid, pages) -> None:
        """Compiles the :meth:`prefill` program of these shapes without running it."""

    def verify(self, packed, pages, steps: int, drafts, refill: int = 0):
        """As :meth:`decode`, in speculative verify steps with each slot's ``drafts``
        (:class:`~delta_jax.sampling.speculation.drafts.Drafts`); returns the status, the tokens
        each slot emitted ``[S, E]`` (-1 after them) and its counters ``[S, 1 + 2 * sources]``
        (verify steps, drafted and accepted tokens by draft source)."""
