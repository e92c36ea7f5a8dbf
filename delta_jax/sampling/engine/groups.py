"""One data group of the continuous engine's host side (NumPy only): its slots, its page
allocator and its queue, and the page accounting of its sequences.

A :class:`DataGroup` knows where a sequence's next chunk writes and how many pages that takes
(:meth:`~DataGroup.chunk_pages`), grows a running sequence by them (:meth:`~DataGroup.grow`),
and, when its pool is short, frees the pages of prompts no sample reads or preempts its youngest
sequence (:meth:`~DataGroup.preempt_youngest`); it frees a sequence's pages, and its prompt's
after the last sample, when the sequence ends (:meth:`~DataGroup.finish`). The
:class:`~delta_jax.sampling.engine.scheduler.Scheduler` keeps one per data group and decides
when each of these happens.
"""

from __future__ import annotations

import collections

from delta_jax.sampling.attention.pages import PageAllocator
from delta_jax.sampling.engine.requests import EngineSpec, Prompt, Seq
from delta_jax.sampling.speculation.decoding import Speculation

__all__ = ["DataGroup"]


class DataGroup:
    """Data group ``index``'s host state: its slots (global slots ``base + i``), its page
    allocator (group-local page indices), its queue of sequences and the sequences waiting on
    the host. ``prompts`` are the request's (each names its group); ``speculation`` sets the
    tokens a step may emit (the pages a chunk needs) and learns of preempted restarts;
    preemptions are counted in ``stats``."""

    def __init__(
        self,
        index: int,
        spec: EngineSpec,
        prompts: list[Prompt],
        seqs: list[Seq],
        speculation: Speculation,
        stats,
    ):
        self.index = index
        self.base = index * spec.group_slots
        self.spec, self.prompts = spec, prompts
        self.speculation, self.stats = speculation, stats
        self.per_step = speculation.tokens_per_step(spec)
        self.slots: list[Seq | None] = [None] * spec.group_slots
        self.alloc = PageAllocator(spec.group_pages)
        self.queue = collections.deque(seqs)
        self.waiting: list[Seq] = []  # multi-turn: sequences whose observation is pending
        self.waiting_pages_peak = 0

    @property
    def running(self) -> list[tuple[int, Seq]]:
        """``(global slot, sequence)`` of the occupied slots, oldest admission first."""
        pairs = [(self.base + i, s) for i, s in enumerate(self.slots) if s is not None]
        return sorted(pairs, key=lambda p: p[1].order)

    def pos(self, seq: Seq) -> int:
        """Position of the token the sequence feeds next (its column ``length - 1``'s token,
        or the prompt's last one)."""
        return self.prompts[seq.prompt].prefix + seq.length

    def end_pos(self, seq: Seq) -> int:
        """Last position the sequence writes K/V at (its last token is never fed back)."""
        return self.prompts[seq.prompt].prefix + seq.max_new - 1

    def chunk_pages(self, seq: Seq, pos: int, steps: int | None = None) -> int:
        """Pages of the sequence's table from position 0 through the last one a chunk of
        ``steps`` (``spec.steps``) from ``pos`` writes."""
        tokens = (self.spec.steps if steps is None else steps) * self.per_step
        return min(pos + tokens - 1, self.end_pos(seq)) // self.spec.page_size + 1

    def release(self, seq: Seq) -> None:
        """Frees the sequence's own pages and its hold on its prompt."""
        self.alloc.free(seq.pages)
        seq.pages, seq.table = [], []
        self.prompts[seq.prompt].running -= 1

    def finish(self, seq: Seq) -> None:
        """The sequence ended: frees what it holds, and its prompt's pages after its last
        sample."""
        if seq.table:  # else preempted while it waited: its pages and prompt hold are gone
            self.release(seq)
        prompt = self.prompts[seq.prompt]
        prompt.left -= 1
        if prompt.left == 0:
            self.alloc.free(prompt.pages or [])
            prompt.pages = None

    def free_idle_prompts(self, keep: int = -1) -> bool:
        """Frees the pages of the group's resident prompts with no running sample (but prompt
        ``keep``): cheaper to prefill again than preempting a running sequence."""
        idle = [
            p
            for i, p in enumerate(self.prompts)
            if p.group == self.index and p.pages and p.running == 0 and i != keep
        ]
        for p in idle:
            self.alloc.free(p.pages)
            p.pages = None
        return bool(idle)

    def preempt_youngest(self, keep: Seq | None) -> bool:
        """Frees idle prompt pages, or else the pages of the group's youngest running sequence
        (back to its queue front), or else those of its youngest sequence holding pages without
        a slot (waiting on the host, or queued after its observation).

        A preempted sequence restarts from its last hand-over: its context up to there is on
        the host and is prefilled again when it re-joins (from the start when it has none).
        """
        if self.free_idle_prompts():
            return True
        running = [(s.order, i) for i, s in enumerate(self.slots) if s not in (None, keep)]
        if running:
            if keep in self.slots:  # a running sequence that grows: it may be the youngest
                running.append((keep.order, self.slots.index(keep)))
            _, i = max(running)
            seq = self.slots[i]
            self.slots[i] = None
            self.queue.appendleft(seq)
        else:
            # Sequences holding pages without a slot: waiting on the host, or answered and
            # queued to re-join (their observation is kept and written when they do).
            held = [s for s in (*self.waiting, *self.queue) if s.table and s is not keep]
            if not held:
                return False
            seq = max(held, key=lambda s: s.order)
        self.release(seq)
        # Its rows of the output buffers are written again from there on.
        seq.length = len(seq.history or ())
        self.speculation.truncate(seq.index, seq.length)
        seq.resume = None
        self.stats.preemptions += 1
        return True

    def grow(self, seq: Seq, pos: int, steps: int | None = None) -> bool:
        """Pages for the next chunk of ``seq``, preempting younger sequences if needed (``seq``
        itself when it is the youngest running one: an older sequence is never preempted for a
        younger one, so the oldest always runs and the call ends)."""
        need = self.chunk_pages(seq, pos, steps) - len(seq.table)
        while need > 0:
            got = self.alloc.alloc(need)
            if got is not None:
                seq.pages += got
                seq.table += got
                return True
            if not self.preempt_youngest(keep=seq):
                return False
            if seq not in self.slots:
                return True  # preempted itself: back to its queue
        return True
