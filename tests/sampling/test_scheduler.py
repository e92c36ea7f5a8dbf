"""The engine's host scheduler alone (NumPy): requests, slots, pages and stats, with a stand-in
for the device programs; nothing is compiled."""

import dataclasses

import numpy as np
import pytest

from delta_jax.sampling.attention.pages import SCRATCH_PAGE, pages_for
from delta_jax.sampling.engine import EngineRows, run_engine
from delta_jax.sampling.engine.requests import SLOT_FIELDS, STATUS_FIELDS, EngineSpec

PAGE = 4


class FakeDevice:
    """Decodes by counting: every live slot draws token ``7`` until its budget is spent; records
    what the scheduler sent."""

    def __init__(self):
        self.prefills, self.decodes, self.compiled = [], [], set()
        self.runs = []  # per chunk: (refill, rows live at its start, steps run, tokens drawn)

    def prefill(self, ids, positions, valid, pages):
        assert ids.shape in self.compiled  # every prefill length compiled before the first
        self.prefills.append((ids.copy(), valid.copy(), pages.copy()))

    def write(self, rows, cols, ids, valid, logprobs, untruncated):
        raise AssertionError("single-turn requests write no observations")

    def compile_decode(self, packed, pages):
        self.compiled.add(packed.shape)

    def compile_prefill(self, ids, positions, valid, pages):
        self.compiled.add(ids.shape)

    def decode(self, packed, pages, steps, refill=0):
        assert packed.shape in self.compiled  # every chunk's shape compiled before the first
        st = {name: packed[:, i].copy() for i, name in enumerate(SLOT_FIELDS)}
        active = st["active"] > 0
        live = active.copy()
        self.decodes.append((active.sum(), packed.shape[0], pages.copy(), refill))
        last, pos, count = st["last"], st["pos"], st["count"]
        ran, start = 0, count.copy()
        for _ in range(steps):
            if not active.any() or (refill and (live & ~active).sum() >= refill):
                break
            last = np.where(active, 7, last)
            count, pos = count + active, pos + active
            active &= count < st["max_new"]
            ran += 1
        self.runs.append((refill, int(live.sum()), ran, int((count - start).sum())))
        status = dict(last=last, pos=pos, count=count, active=active.astype(np.int32))
        return np.stack([status[name] for name in STATUS_FIELDS], axis=1)


def _spec(slots: int, num_pages: int, attention: str = "xla") -> EngineSpec:
    return EngineSpec(
        slots=slots,
        steps=3,
        page_size=PAGE,
        num_pages=num_pages,
        seq_pages=8,
        max_table=8,
        prefill_len=16,
        min_len=4,
        prefill_rows=2,
        groups=1,
        attention=attention,
        return_hidden=False,
        pad_id=0,
    )


def _run(spec, n=2, budgets=(5, 9, 3, 12, 7, 1)):
    prompts = [np.arange(1, 1 + size, dtype=np.int32) for size in (6, 3, 9)]
    max_new = np.asarray(budgets[: len(prompts) * n], np.int64)
    stops = np.full((max_new.size, 1), -1, np.int32)
    device = FakeDevice()
    seqs, stats = run_engine(spec, EngineRows(prompts, n, max_new, stops), device)
    return seqs, stats, device, max_new


@pytest.mark.parametrize("attention", ["xla", "pallas", "dense"])
def test_every_sequence_runs_to_its_budget_and_every_page_is_freed(attention):
    seqs, stats, device, max_new = _run(_spec(slots=3, num_pages=40, attention=attention))
    assert [s.length for s in seqs] == max_new.tolist()
    assert [(s.prompt, s.sample) for s in seqs] == [(p, i) for p in range(3) for i in range(2)]
    assert stats.useful_steps == max_new.sum() and stats.preemptions == 0
    assert stats.free_pages_after == (stats.group_pages - 1,)
    # Each prompt is prefilled once (all but its last token), for its two samples.
    prefilled = sum(int(valid.sum()) for _, valid, _ in device.prefills)
    assert prefilled == 5 + 2 + 8
    assert max(active for active, _, _, _ in device.decodes) <= 3


def test_a_tight_pool_preempts_and_still_finishes_every_sequence():
    # One sequence's pages at most, plus a few: sequences must give way to each other.
    need = pages_for(9 - 1, PAGE) + pages_for(9 - 1 + 12, PAGE) - (9 - 1) // PAGE
    seqs, stats, _, max_new = _run(_spec(slots=3, num_pages=need + 2))
    assert [s.length for s in seqs] == max_new.tolist()
    assert stats.preemptions > 0
    assert stats.free_pages_after == (stats.group_pages - 1,)


@pytest.mark.parametrize("quota", [None, 2])
def test_a_partial_rollout_refills_a_slot_as_soon_as_it_frees(quota):
    """With a quota (every sequence waiting for a slot may be needed to meet it) a chunk ends
    as soon as a row ends while sequences wait (``refill`` 1): no slot-step of such a chunk is
    idle. Without one, or once nothing waits, chunks run their steps (``refill`` 0)."""
    spec = dataclasses.replace(_spec(slots=3, num_pages=40), steps=8)
    prompts = [np.arange(1, 1 + size, dtype=np.int32) for size in (6, 3, 9, 4, 5)]
    budgets = np.asarray([5, 9, 3, 12, 7, 1, 6, 2, 10, 4], np.int64)
    stops = np.full((budgets.size, 1), -1, np.int32)
    device = FakeDevice()
    run_engine(spec, EngineRows(prompts, 2, budgets, stops), device, quota=quota)
    refills = [r for r, *_ in device.runs]
    if quota is None:
        assert set(refills) == {0}
        return
    assert refills[0] == 1 and 1 in refills[1:]  # the queue empties only late
    for refill, live, ran, drawn in device.runs:
        if refill:
            assert drawn == live * ran  # the chunk stopped at its first row's end


def test_page_lists_are_packed_by_row_from_each_row_s_first_page():
    _, _, device, _ = _run(_spec(slots=3, num_pages=40))
    for _, rows, pages, _ in device.decodes:
        page, seq, index = pages.T
        real = seq < rows  # padding entries name row ``rows`` (out of range), the scratch page
        assert (page[~real] == SCRATCH_PAGE).all() and (page[real] != SCRATCH_PAGE).all()
        assert (np.diff(seq) >= 0).all()  # packed by row, padding last
        for row in set(seq[real].tolist()):  # a row's pages from position 0 on
            assert index[seq == row].tolist() == list(range((seq == row).sum()))


class PrefillRecorder:
    """The prefill program's stand-in: records each call's arrays."""

    def __init__(self):
        self.calls = []

    def prefill(self, ids, positions, valid, pages):
        self.calls.append((ids.copy(), positions.copy(), valid.copy(), pages.copy()))


def _prefill_host(spec, quota=None):
    from delta_jax.sampling.attention.backends import backend_for
    from delta_jax.sampling.engine.requests import EngineStats
    from delta_jax.sampling.engine.scheduler import Scheduler

    host = Scheduler.__new__(Scheduler)  # only what the prefill uses
    host.spec, host.backend = spec, backend_for(spec.attention)
    host.programs, host.stats, host.quota = PrefillRecorder(), EngineStats(), quota
    return host


def test_packed_prefill_writes_every_job_once_on_fewer_rows_and_tokens():
    """Continued sequences' prefill (``Scheduler._prefill_packed``): 2 data groups of 4 rows,
    jobs of 1-40 tokens from their own first positions (a carried row's prompt and tokens, an
    observation), 5 in one group and 1 in the other. Every job's every token is sent once, at
    its position, in its group's rows, with its own page table through the chunk's end; in a
    partial rollout (a quota) calls run on a power-of-two number of rows per group, else on
    all of them; both send fewer rows x tokens than the rounds of ``_prefill`` (one job per
    row, each round as long as its longest job)."""
    spec = dataclasses.replace(
        _spec(slots=8, num_pages=400, attention="pallas"), groups=2, prefill_rows=8, max_table=16
    )
    rng = np.random.default_rng(0)
    jobs, next_page = [[], []], 1
    for g, count in ((0, 5), (1, 1)):
        for size in rng.integers(1, 41, count):
            first = int(rng.integers(0, 20))
            n = pages_for(first + size + spec.prefill_len, PAGE)  # room for the last chunk
            table = list(range(next_page, next_page + n))
            next_page += n
            jobs[g].append((rng.integers(1, 99, size).astype(np.int32), first, table))
    sent = {}
    host = _prefill_host(spec, quota=1)
    host._prefill_packed(jobs)
    assert {ids.shape[0] // spec.groups for ids, *_ in host.programs.calls} == {4, 1}
    for ids, positions, valid, table in host.programs.calls:
        rows = ids.shape[0] // spec.groups
        assert table.shape == (ids.shape[0], spec.max_table)
        for row in np.flatnonzero(valid.any(1)):
            g, first_page = row // rows, int(table[row, 0])
            for t in np.flatnonzero(valid[row]):
                key = (g, first_page, int(positions[row, t]))
                assert key not in sent
                sent[key] = int(ids[row, t])
            last = int(positions[row, -1])
            assert (table[row, : pages_for(last + 1, PAGE)] != SCRATCH_PAGE).all()
    want = {
        (g, table[0], first + i): int(tok)
        for g, group in enumerate(jobs)
        for ids, first, table in group
        for i, tok in enumerate(ids)
    }
    assert sent == want
    full, rounds = _prefill_host(spec), _prefill_host(spec)
    full._prefill_packed(jobs)
    rounds._prefill(jobs)
    assert {ids.shape[0] for ids, *_ in full.programs.calls} == {spec.prefill_rows}
    assert host.stats.prefill_calls == len(host.programs.calls)
    cost = lambda host: sum(ids.size for ids, *_ in host.programs.calls)  # noqa: E731
    assert cost(host) < cost(full) < cost(rounds)
