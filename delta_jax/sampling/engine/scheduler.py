"""The continuous engine's host side: requests, slots, pages, turns and stats (NumPy only).

:class:`Scheduler` runs one engine call: a :class:`~delta_jax.sampling.engine.groups.DataGroup`
per data group (its queue, slots and pages), admission, the prefill jobs, the decode chunks'
slot matrices and page lists, multi-turn hand-overs. The device programs are an object with
three named methods (:class:`~delta_jax.sampling.engine.protocol.DevicePrograms`;
:class:`~delta_jax.sampling.engine.programs.EnginePrograms` on a device), so the scheduler runs,
and is tested, without compiling anything.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time

import numpy as np

from delta_jax.sampling.attention.backends import PagedBackend
from delta_jax.sampling.attention.pages import SCRATCH_PAGE, pages_for, pow2
from delta_jax.sampling.engine.groups import DataGroup
from delta_jax.sampling.engine.protocol import DevicePrograms
from delta_jax.sampling.engine.requests import (
    EngineSpec,
    EngineStats,
    HostSlots,
    Seq,
    Turns,
    turn_stops,
)
from delta_jax.sampling.speculation.decoding import PLAIN, Speculation

__all__ = ["Scheduler"]


class Scheduler:
    """Host side of one engine call: a :class:`DataGroup` (queue, slots, pages) per data group;
    one device call (prefill or decode) serves every group at once. The device programs are
    ``programs``; the page layout they read is the attention ``backend``'s (its host half); how
    a decode chunk runs (plain decode steps, or verify steps of drafts) is ``speculation``'s.

    ``quota`` (partial rollouts): once that many prompts have all their samples
    ended, the call stops after the chunk in which it happened; the sequences still running or
    queued are returned unfinished (their pages freed)."""

    def __init__(
        self,
        spec: EngineSpec,
        prompts,
        groups: list[list[Seq]],
        programs: DevicePrograms,
        backend: PagedBackend,
        on_done=None,
        turns: Turns | None = None,
        read=None,
        speculation: Speculation = PLAIN,
        quota: int | None = None,
    ):
        self.spec, self.backend = spec, backend
        self.prompts = prompts
        stats = EngineStats(group_pages=spec.group_pages)
        self.groups = [
            DataGroup(g, spec, prompts, seqs, speculation, stats) for g, seqs in enumerate(groups)
        ]
        self.programs = programs
        self.stats = stats
        self.on_done = on_done  # on_done(sequences) with those that ended in a host round
        self.turns = turns
        self.turn_ids, self.stop_sequences = turn_stops(turns)
        self.read = read  # read(seqs) -> their tokens [:length] (multi-turn hand-overs)
        # How the chunks decode (its rows are the sequences' indices); the groups grow pages for
        # the tokens a step may emit (``draft_tokens + 1`` for a verify step).
        self.speculation = speculation
        self.admitted = 0
        self.quota = quota
        self.done: list[Seq] = []
        self.ended: list[Seq] = []  # ended since the last report (on_done)

    # ---- admission and prefill ---------------------------------------------------------------

    def _admit(self, group: DataGroup, state: HostSlots) -> list[int]:
        """Fills the group's free slots from its queue while its pages allow; returns the
        prompts to prefill."""
        ps = self.spec.page_size
        new_prompts: list[int] = []
        free_slots = [i for i, s in enumerate(group.slots) if s is None]
        joined = False
        while free_slots and group.queue:
            seq = group.queue[0]
            prompt = self.prompts[seq.prompt]
            full = prompt.prefix // ps
            kept = bool(seq.table)  # re-joins after an observation, its pages its own
            fresh = not kept and prompt.pages is None and seq.prompt not in new_prompts
            need = pages_for(prompt.prefix, ps) if fresh else 0
            need += group.chunk_pages(seq, group.pos(seq)) - (len(seq.table) if kept else full)
            if need > group.alloc.num_free and group.free_idle_prompts(seq.prompt):
                continue
            if need > group.alloc.num_free:
                if any(s is not None for s in group.slots) or joined:
                    break  # wait for running sequences to end
                if not group.preempt_youngest(keep=seq if kept else None):
                    break
                continue
            group.queue.popleft()
            if kept:
                got = group.alloc.alloc(need) if need > 0 else []
                seq.pages += got
                seq.table += got
            else:
                if fresh:
                    prompt.pages = group.alloc.alloc(pages_for(prompt.prefix, ps))
                    new_prompts.append(seq.prompt)
                own = group.alloc.alloc(group.chunk_pages(seq, group.pos(seq)) - full)
                seq.pages = own
                seq.table = prompt.pages[:full] + own
                prompt.running += 1
                if seq.history:
                    # Preempted after a hand-over: its context is prefilled again into its own
                    # pages, from the prompt's partial last page on (not copied from it).
                    ids = np.concatenate([prompt.ids[full * ps :], seq.history[:-1]])
                    seq.resume = (full * ps, ids.astype(np.int32), True)
            if not seq.turns:  # a new admission (else it re-joins after a hand-over)
                seq.order = self.admitted
                self.admitted += 1
            slot = free_slots.pop(0)
            group.slots[slot] = seq
            joined = True
            self._join(group.base + slot, seq, group.pos(seq), state)
        return new_prompts

    def _join(self, slot: int, seq: Seq, pos: int, state: HostSlots) -> None:
        prompt, ps = self.prompts[seq.prompt], self.spec.page_size
        full = prompt.prefix // ps
        state.last[slot] = seq.history[-1] if seq.history else prompt.ids[-1]
        state.pos[slot] = pos
        state.count[slot] = seq.length
        state.active[slot] = True
        state.max_new[slot] = seq.max_new
        state.seed[slot], state.prompt[slot], state.sample[slot] = seq.rng
        state.row[slot] = seq.row
        state.stops[slot] = seq.stops
        # A sequence joins at the start of a turn (its prompt's end, an observation's end, or
        # its last hand-over when preempted: it restarts from there), where no id of it counts
        # yet, or inside one (a carried row): the turn's ids so far count.
        state.recent[slot] = -1
        window = state.recent.shape[1]
        if window and seq.history:
            turn = seq.history[seq.observed[-1][1] if seq.observed else 0 :][-window:]
            if turn:
                state.recent[slot, window - len(turn) :] = turn
        if not seq.history and prompt.prefix % ps:
            # The partial last prompt page becomes the sample's own copy.
            state.copy_src[slot] = prompt.pages[full]
            state.copy_dst[slot] = seq.table[full]

    def _prefill(self, per_group: list[list[tuple[np.ndarray, int, list[int]]]]) -> None:
        """Runs every group's prefill jobs ``(ids, first position, page table from position
        0)``, ``prefill_rows / groups`` rows per group per call (group ``g``'s jobs in its block
        of rows, with its own page list), in rounds of one job per row, each round's calls
        as long as its longest job (the prompts: about one length)."""
        rows = self.spec.prefill_rows // self.spec.groups
        per_group = [[job for job in jobs if job[0].size] for jobs in per_group]
        rounds = max(-(-len(jobs) // rows) for jobs in per_group)
        for start in range(0, rounds * rows, rows):
            batch = [jobs[start : start + rows] for jobs in per_group]
            longest = max(ids.size for jobs in batch for ids, _, _ in jobs)
            T = self.spec.prefill_length(longest)
            for offset in range(0, longest, T):
                parts = [
                    [(ids, first, table, offset) for ids, first, table in jobs] for jobs in batch
                ]
                self._prefill_call(parts, T, idle=offset)

    def _prefill_packed(self, per_group: list[list[tuple[np.ndarray, int, list[int]]]]) -> None:
        """Runs prefill jobs of mixed lengths (continued sequences: a carried row's prompt and
        tokens, an observation) packed into rows: each group's jobs, longest first, each to
        the row with the fewest tokens so far; a row runs its jobs one after another, every
        call takes each row's next part of its job, as long as the longest part left (the
        rows of a round of :meth:`_prefill` would wait for the round's longest job). In a
        partial rollout (a ``quota``), on as many rows per group as the busiest group has jobs
        running (a power of two: its sequences join one by one as carried rows end, each
        prefilled on one row, not ``prefill_rows / groups``)."""
        rows = self.spec.prefill_rows // self.spec.groups
        lanes = [[collections.deque() for _ in range(rows)] for _ in per_group]
        for g, jobs in enumerate(per_group):
            load = [0] * rows
            for job in sorted((j for j in jobs if j[0].size), key=lambda j: -j[0].size):
                r = load.index(min(load))
                lanes[g][r].append([*job, 0])  # ids, first position, table, offset done
                load[r] += job[0].size
        while any(lane for group in lanes for lane in group):
            left = max(lane[0][0].size - lane[0][3] for group in lanes for lane in group if lane)
            T = self.spec.prefill_length(left)
            parts = [[tuple(lane[0]) for lane in group if lane] for group in lanes]
            used = pow2(max(map(len, parts))) if self.quota is not None else rows
            self._prefill_call(parts, T, rows=min(rows, used))
            for lane in (lane for group in lanes for lane in group if lane):
                lane[0][3] += T
                if lane[0][3] >= lane[0][0].size:
                    lane.popleft()

    def _prefill_call(self, parts: list[list[tuple]], T: int, idle=0, rows=None) -> None:
        """One prefill call of ``rows`` rows per group (default ``prefill_rows / groups``):
        group ``g``'s row ``r`` takes ``T`` tokens of its job from ``offset`` on, ``parts[g][r]
        = (ids, first position, page table, offset)`` (no entry: an empty row, at positions
        from ``idle``, written nowhere)."""
        spec, ps = self.spec, self.spec.page_size
        rows = spec.prefill_rows // spec.groups if rows is None else rows
        ids = np.zeros((spec.groups * rows, T), np.int32)
        valid = np.zeros((spec.groups * rows, T), bool)
        positions = np.zeros((spec.groups * rows, T), np.int32)
        positions[:] = np.arange(idle, idle + T, dtype=np.int32)
        tables: list[list[list[int]]] = [[] for _ in parts]
        for g, group in enumerate(parts):
            for r, (job, first, table, offset) in enumerate(group):
                chunk = job[offset : offset + T]
                ids[g * rows + r, : chunk.size] = chunk
                valid[g * rows + r, : chunk.size] = True
                positions[g * rows + r] = np.arange(first + offset, first + offset + T)
                # Pages up to this chunk's end (the earlier chunks' ones and the context's).
                tables[g].append(table[: pages_for(first + offset + T, ps)])
        pages = self.backend.prefill_pages(spec, tables, rows, T)
        self.programs.prefill(ids, positions, valid, pages)
        self.stats.prefill_calls += 1

    def _prefill_prompts(self, per_group: list[list[int]]) -> None:
        """Prefills the new prompts (all but their last token) into their pages: in rounds, or
        packed in a partial rollout (a ``quota``), whose prompts mostly join one by one as the
        carried rows end."""
        jobs = [
            [(self.prompts[i].ids[: self.prompts[i].prefix], 0, self.prompts[i].pages) for i in new]
            for new in per_group
        ]
        (self._prefill if self.quota is None else self._prefill_packed)(jobs)

    def _resume(self) -> None:
        """Before a decode: the running sequences' pending context (prefilled into their own
        pages) and observations (written into their output rows)."""
        jobs: list[list] = [[] for _ in self.groups]
        writes = []
        for g, group in enumerate(self.groups):
            for _, seq in group.running:
                if seq.resume is not None:
                    first, ids, replay = seq.resume
                    jobs[g].append((ids, first, seq.table))
                    self.stats.resumed_tokens += ids.size
                    self.stats.replayed_tokens += ids.size if replay else 0
                    seq.resume = None
                if seq.write is not None:
                    writes.append((seq, *seq.write))
        if any(jobs):
            self._prefill_packed(jobs)
        self._write_rows(writes)  # observations

    def _write_carried(self) -> None:
        """Before the first chunk: every carried row's tokens and log-probs into its output
        row."""
        self._write_rows(
            [
                (s, 0, *s.carried)
                for s in (*self.done, *(s for g in self.groups for s in g.queue))
                if s.carried is not None and s.carried[0].size
            ]
        )

    def _write_rows(self, writes: list[tuple]) -> None:
        """Writes ``(seq, column, ids[, logprobs, untruncated])`` into the sequences' output rows
        from that column on (without log-probs: observations, not sampled, log-prob 0),
        ``spec.group_slots`` rows of each group per call (in its block of slots)."""
        spec, Sg = self.spec, self.spec.group_slots
        for seq, *_ in writes:
            seq.write = None
        writes = [w for w in writes if w[2].size]
        if not writes:
            return
        per_group = [
            [w for w in writes if self.prompts[w[0].prompt].group == g] for g in range(spec.groups)
        ]
        width = pow2(max(max(w[2].size for w in writes), spec.min_len))
        for start in range(0, max(map(len, per_group)), Sg):
            rows = np.full(spec.slots, -1, np.int32)  # -1: nothing to write
            cols = np.zeros(spec.slots, np.int32)
            ids = np.zeros((spec.slots, width), np.int32)
            valid = np.zeros((spec.slots, width), bool)
            floats = np.zeros((2, spec.slots, width), np.float64)
            for g, group_writes in enumerate(per_group):
                for i, (seq, col, tokens, *logprobs) in enumerate(group_writes[start : start + Sg]):
                    slot = g * Sg + i
                    rows[slot], cols[slot] = seq.row, col
                    ids[slot, : tokens.size] = tokens
                    valid[slot, : tokens.size] = True
                    if logprobs:
                        floats[:, slot, : tokens.size] = logprobs
            self.programs.write(rows, cols, ids, valid, floats[0], floats[1])

    # ---- the loop ----------------------------------------------------------------------------

    def run(self, ended: list[Seq] = ()) -> list[Seq]:
        """Runs the call; returns every sequence, ``ended`` (those that ended before it: carried
        rows that had ended, partial rollouts) included."""
        spec = self.spec
        self.done = list(ended)
        S = spec.slots
        width = next(g.queue[0] for g in self.groups if g.queue).stops.size
        window = 0 if self.stop_sequences is None else self.stop_sequences.shape[1]
        state = HostSlots.empty(S, width, window)
        if not self.speculation.drafting:  # verify chunks compile as they come
            self._compile_chunks(state)
        self._write_carried()
        while any(g.queue or g.running or g.waiting for g in self.groups):
            if self._quota_met():
                self._stop()
                break
            self._collect(block=False)
            state.copy_src[:] = SCRATCH_PAGE
            state.copy_dst[:] = SCRATCH_PAGE
            new = [self._admit(g, state) for g in self.groups]
            if any(new):
                self._prefill_prompts(new)
            steps = self._tail_steps(state)
            for group in self.groups:
                for slot, seq in group.running:
                    if group.slots[slot - group.base] is not seq:
                        continue  # preempted while an older sequence grew
                    if not group.grow(seq, int(state.pos[slot]), steps):
                        raise RuntimeError("page pool exhausted by a single sequence")
                for i, s in enumerate(group.slots):
                    if s is None:  # idle, or joined then preempted: no copy, no step
                        state.active[group.base + i] = False
                        state.copy_src[group.base + i] = SCRATCH_PAGE
                        state.copy_dst[group.base + i] = SCRATCH_PAGE
            if not any(g.running for g in self.groups):
                if any(g.waiting for g in self.groups):
                    self._collect(block=True)  # every sequence left waits on the host
                    continue
                if not any(g.queue for g in self.groups):
                    break  # the last episodes ended on the host (no observation came back)
                raise RuntimeError(  # validated up front: a bug if it happens
                    "no sequence fits the page pool: "
                    + "; ".join(
                        f"group {i}: {g.alloc.num_free} free pages, queue "
                        + str([(s.index, len(s.table), s.length, s.turns) for s in g.queue])
                        for i, g in enumerate(self.groups)
                    )
                )
            self._resume()
            self._decode(state, steps)
        self.stats.high_water_pages = tuple(g.alloc.high_water for g in self.groups)
        self.stats.free_pages_after = tuple(g.alloc.num_free for g in self.groups)
        self.stats.waiting_pages_peak = tuple(g.waiting_pages_peak for g in self.groups)
        return self.done

    def _quota_met(self) -> bool:
        """Partial rollouts: ``quota`` prompts have all their samples ended."""
        return self.quota is not None and sum(p.left == 0 for p in self.prompts) >= self.quota

    def _stop(self) -> None:
        """The quota is met: the sequences still running or queued end unfinished, with the
        tokens they have so far; every page is freed. Multi-turn sequences waiting on the host
        get their observation first (it is written into their rows: they continue after it)
        or end there."""
        while any(g.waiting for g in self.groups):
            self._collect(block=True)
        self._write_rows(
            [(s, *s.write) for g in self.groups for s in g.queue if s.write is not None]
        )
        for group in self.groups:
            seqs = [seq for _, seq in group.running] + list(group.queue)
            group.slots = [None] * len(group.slots)
            group.queue.clear()
            for seq in seqs:
                if seq.table:
                    group.release(seq)
                seq.unfinished = True
                self.done.append(seq)
            self.stats.unfinished += len(seqs)
            for prompt in self.prompts:
                if prompt.group == group.index and prompt.pages:
                    group.alloc.free(prompt.pages)
                    prompt.pages = None

    def _compile_chunks(self, state: HostSlots) -> None:
        """Compiles the decode chunk at every slot bucket (:meth:`_bucket`) and the prefill
        chunk at every length up to the longest sequence before the first chunk runs (nothing
        when the request's programs are compiled already): a request may reach a bucket the
        earlier ones did not, and would compile it then, mid-run. A partial rollout (a
        ``quota``) also prefills on fewer rows (:meth:`_prefill_packed`): those programs too."""
        spec, idle = self.spec, np.zeros(0, np.int32)
        for B in sorted({self._bucket(n) for n in range(1, spec.group_slots + 1)}):
            rows = np.concatenate([g.base + np.arange(B) for g in self.groups])
            tables = [[[] for _ in range(B)] for _ in self.groups]
            _, table, pages = self.backend.decode_pages(spec, tables, B, idle, idle, spec.steps)
            self.programs.compile_decode(state.pack(rows, table), pages)
        full, longest = spec.prefill_rows // spec.groups, spec.seq_pages * spec.page_size
        partial = self.quota is not None
        buckets = {min(full, pow2(n)) for n in range(1, full + 1)} if partial else {full}
        for rows in sorted(buckets):
            for T in sorted({spec.prefill_length(n) for n in range(1, longest + 1)}):
                ids = np.zeros((spec.groups * rows, T), np.int32)
                pages = self.backend.prefill_pages(spec, [[[]] * rows] * spec.groups, rows, T)
                self.programs.compile_prefill(ids, ids, ids.astype(bool), pages)

    def _tail_steps(self, state: HostSlots) -> int:
        """Steps of the next chunk: ``spec.steps``, or, once every queue is empty (no slot can
        be refilled), all that the running sequences have left in one chunk, when their pages
        for it are free now (no host round trip that could not change anything). When sequences
        are handed over as they end (``on_done``), a chunk does not run past the next one's
        end: up to its budget without stop ids, ``spec.steps`` with them. Multi-turn requests
        run ``spec.steps``: any step may end a turn that the host should start answering. A
        tail chunk also ends where its sequences' budgets leave at most half its rows busy
        (:meth:`_bucket`)."""
        drafting = self.speculation.drafting  # speculative chunks: fresh drafts every chunk
        # A quota (partial rollouts) is checked between chunks: no chunk runs to the end.
        if self.turns is not None or drafting or self.quota is not None:
            return self.spec.steps
        if any(g.queue for g in self.groups):
            return self.spec.steps
        left, rests = 0, []
        for group in self.groups:
            need = 0
            rests.append([])
            for slot, seq in group.running:
                if self.on_done is not None and (seq.stops >= 0).any():
                    # Streaming: any step may end this sequence, whose reward should start then.
                    return self.spec.steps
                pos, rest = int(state.pos[slot]), seq.max_new - int(state.count[slot])
                left = max(left, rest)
                rests[-1].append(rest)
                need += group.chunk_pages(seq, pos, seq.max_new) - len(seq.table)
            if need > group.alloc.num_free:
                return self.spec.steps
        if self.on_done is not None:  # no stop ids: end the chunk where the next one ends
            left = min(min(r, default=left) for r in rests)
        # ... and where every group is down to half the chunk's rows (``_bucket``): the next
        # chunk runs on half the slots.
        B = self._bucket(max(map(len, rests)))
        if B > self._bucket(1):  # steps until each group has at most B // 2 budgets left
            until_half = [sorted(r, reverse=True)[B // 2] for r in rests if len(r) > B // 2]
            left = min(left, max(until_half, default=left))
        return max(left, self.spec.steps)

    def _bucket(self, occupied: int) -> int:
        """Slots per group a decode chunk runs for ``occupied`` sequences in the fullest group:
        the next power of two, from an eighth of the group's slots up to all of them (at most
        five decode programs). Sequences are packed into the chunk's first rows, so a group
        whose sequences are ending (the ragged tail of a rollout) stops paying for its idle
        slots; a slot's row is host state (its page table, its RNG stream is the sequence's),
        so which row a sequence decodes in changes nothing it draws."""
        return self.spec.chunk_slots(occupied)

    def _decode(self, state: HostSlots, steps: int) -> None:
        spec = self.spec
        occupied = [[i for i, s in enumerate(g.slots) if s is not None] for g in self.groups]
        B = self._bucket(max(map(len, occupied)))
        rows, tables = [], []  # the chunk's rows: each group's sequences, then idle slots
        for group, used in zip(self.groups, occupied, strict=True):
            idle = [i for i in range(spec.group_slots) if group.slots[i] is None]
            local = (used + idle)[:B]
            rows += [group.base + i for i in local]
            tables.append([[] if group.slots[i] is None else group.slots[i].table for i in local])
        rows = np.asarray(rows)
        live = state.active[rows].astype(bool)
        pos, left = state.pos[rows][live], (state.max_new - state.count)[rows][live]
        steps, table, pages = self.backend.decode_pages(spec, tables, B, pos, left, steps)
        before = state.count.copy()
        seqs = {slot: seq for g in self.groups for slot, seq in g.running}
        index = [seqs[slot].index if slot in seqs else None for slot in rows]
        packed = state.pack(rows, table)
        # A partial rollout refills slots while sequences wait for them: the chunk ends once an
        # eighth of its rows have ended (a refill costs a host round trip and a prefill call).
        waiting = self.quota is not None and any(g.queue for g in self.groups)
        refill = max(1, len(rows) // 8) if waiting else 0
        chunk = self.speculation.decode(spec, self.programs, packed, pages, steps, index, refill)
        state.read_status(rows, chunk.status)
        self.speculation.record(chunk, index, (state.count - before)[rows], self.stats)
        self.stats.chunks += 1
        new = state.count - before
        turn_ends = []
        for group in self.groups:
            for slot, seq in group.running:
                seq.length += int(new[slot])
                self.stats.useful_steps += int(new[slot])
                if state.active[slot]:
                    continue
                group.slots[slot - group.base] = None
                if self._turn_ended(seq, int(state.last[slot]), state.recent[slot]):
                    turn_ends.append((group, seq))
                else:
                    self._finish(group, seq)
        if turn_ends:
            self._hand_over(turn_ends)
        self._report()

    # ---- turns -------------------------------------------------------------------------------

    def _turn_ended(self, seq: Seq, last: int, recent: np.ndarray) -> bool:
        """The sequence stopped at a turn's end (its last id, or the window of its turn's last
        ids that the decode program returned) with turns and budget left."""
        t, patterns = self.turns, self.stop_sequences
        if t is None or seq.length >= seq.max_new or seq.turns + 1 >= t.max_turns:
            return False
        if last in self.turn_ids:
            return True
        return patterns is not None and bool(((patterns < 0) | (recent == patterns)).all(1).any())

    def _hand_over(self, ended: list[tuple[DataGroup, Seq]]) -> None:
        """Sends the turns that just ended to the host (one read of their rows); the sequences
        wait, holding their pages."""
        tokens = self.read([seq for _, seq in ended])
        for (group, seq), ids in zip(ended, tokens, strict=True):
            start = seq.observed[-1][1] if seq.observed else 0
            seq.history = list(ids)
            seq.turns += 1
            seq.future = self.turns.submit(seq.index, seq.history[start:])
            seq.due = self.stats.chunks + 1
            group.waiting.append(seq)
            self.stats.handovers += 1
        for group in self.groups:
            held = sum(len(s.pages) for s in group.waiting)
            group.waiting_pages_peak = max(group.waiting_pages_peak, held)

    def _collect(self, block: bool) -> None:
        """Takes in the observations that are ready (``block``: waits for one first): each
        sequence goes back to its queue's front with its observation to write and prefill, or
        ends.

        A partial rollout (a ``quota``) takes them in on a fixed schedule instead, so that where
        the call stops does not depend on how fast the host answers: a turn handed over after
        decode chunk ``k`` is answered before chunk ``k + 2`` (the host has chunk ``k + 1`` to
        answer it; the engine waits for it there if needed), and while no sequence can run,
        the turns handed over earliest are waited for together."""
        waiting = [s for g in self.groups for s in g.waiting]
        if not waiting:
            return
        if self.quota is None:
            ready = [s.future for s in waiting] if block else []
            how = concurrent.futures.FIRST_COMPLETED
        else:
            first = min(s.due for s in waiting) if block else self.stats.chunks
            ready = [s.future for s in waiting if s.due <= max(first, self.stats.chunks)]
            how = concurrent.futures.ALL_COMPLETED
        if ready:
            start = time.perf_counter()
            concurrent.futures.wait(ready, return_when=how)
            self.stats.wait_s += time.perf_counter() - start
        for group in self.groups:
            for seq in [s for s in group.waiting if s.future.done()]:
                if self.quota is not None and seq.future not in ready:
                    continue
                group.waiting.remove(seq)
                obs = seq.future.result()
                seq.future = None
                if obs is None or len(obs) >= seq.max_new - seq.length:
                    self._finish(group, seq)  # the episode is over, or its budget is
                    continue
                obs = np.asarray(obs, np.int32).reshape(-1)
                col = seq.length
                if obs.size:
                    if seq.table:  # its pages hold the context: only the new ids are prefilled
                        first = self.prompts[seq.prompt].prefix + col
                        ids = np.concatenate([seq.history[-1:], obs[:-1]]).astype(np.int32)
                        seq.resume = (first, ids, False)
                    seq.write = (col, obs)
                    self.speculation.extend(seq.index, obs)
                    seq.observed.append((col, col + obs.size))
                    seq.history += obs.tolist()
                    seq.length += obs.size
                    self.stats.observation_tokens += obs.size
                group.queue.appendleft(seq)
        self._report()

    def _finish(self, group: DataGroup, seq: Seq) -> None:
        group.finish(seq)
        self.done.append(seq)
        self.ended.append(seq)

    def _report(self) -> None:
        """Hands the sequences that ended in this host round over (one ``on_done`` call)."""
        if self.on_done is not None and self.ended:
            self.on_done(self.ended)
        self.ended = []
