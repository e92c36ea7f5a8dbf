"""The engine's host scheduler alone (NumPy): requests, slots, pages and stats, with a stand-in
for the device programs; nothing is compiled."""

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

    def prefill(self, ids, positions, valid, pages):
        assert ids.shape in self.compiled  # every prefill length compiled before the first
        self.prefills.append((ids.copy(), valid.copy(), pages.copy()))

    def write(self, rows, cols, ids, valid, logprobs, untruncated):
        raise AssertionError("single-turn requests write no observations")

    def compile_decode(self, packed, pages):
        self.compiled.add(packed.shape)

    def compile_prefill(self, ids, positions, valid, pages):
        self.compiled.add(ids.shape)

    def decode(self, packed, pages, steps):
        assert packed.shape in self.compiled  # every chunk's shape compiled before the first
        st = {name: packed[:, i].copy() for i, name in enumerate(SLOT_FIELDS)}
        active = st["active"] > 0
        self.decodes.append((active.sum(), packed.shape[0], pages.copy()))
        last, pos, count = st["last"], st["pos"], st["count"]
        for _ in range(steps):
            if not active.any():
                break
            last = np.where(active, 7, last)
            count, pos = count + active, pos + active
            active &= count < st["max_new"]
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
    assert max(active for active, _, _ in device.decodes) <= 3


def test_a_tight_pool_preempts_and_still_finishes_every_sequence():
    # One sequence's pages at most, plus a few: sequences must give way to each other.
    need = pages_for(9 - 1, PAGE) + pages_for(9 - 1 + 12, PAGE) - (9 - 1) // PAGE
    seqs, stats, _, max_new = _run(_spec(slots=3, num_pages=need + 2))
    assert [s.length for s in seqs] == max_new.tolist()
    assert stats.preemptions > 0
    assert stats.free_pages_after == (stats.group_pages - 1,)


def test_page_lists_are_packed_by_row_from_each_row_s_first_page():
    _, _, device, _ = _run(_spec(slots=3, num_pages=40))
    for _, rows, pages in device.decodes:
        page, seq, index = pages.T
        real = seq < rows  # padding entries name row ``rows`` (out of range), the scratch page
        assert (page[~real] == SCRATCH_PAGE).all() and (page[real] != SCRATCH_PAGE).all()
        assert (np.diff(seq) >= 0).all()  # packed by row, padding last
        for row in set(seq[real].tolist()):  # a row's pages from position 0 on
            assert index[seq == row].tolist() == list(range((seq == row).sum()))
