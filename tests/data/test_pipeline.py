"""PromptPipeline: exact resume, process shards, seeded per-epoch shuffle, epochs."""

from __future__ import annotations

import itertools
import json

import grain
import pytest
from etils import epath

from delta_jax.data import PromptPipeline, PromptRecord


def take(it, n):
    return list(itertools.islice(it, n))


def epochs(batches, per_epoch):
    """Flattened elements of each epoch."""
    starts = range(0, len(batches), per_epoch)
    return [[x for b in batches[e : e + per_epoch] for x in b] for e in starts]


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("process_index", [0, 1])
def test_resume_equals_uninterrupted(k, process_index):
    # 26 records over 2 processes: 13 each, 3 batches of 4 per epoch (one record dropped).
    kw = dict(batch_size=4, seed=7, process_index=process_index, process_count=2)
    reference = take(PromptPipeline(26, **kw), 10)
    pipe = PromptPipeline(26, **kw)
    assert pipe.batches_per_epoch == 3
    assert take(pipe, k) == reference[:k]
    state = json.loads(json.dumps(pipe.get_state()))
    assert (state["next_index"], state["epoch"]) == (k, k // 3)
    fresh = PromptPipeline(26, **kw)
    fresh.set_state(state)
    assert (fresh.step, fresh.epoch) == (k, k // 3)
    # Every k resumes before at least one epoch boundary; k = 3 resumes exactly on one.
    assert take(fresh, 10 - k) == reference[k:]


def test_resume_with_records_and_grain_orbax_handler(tmp_path):
    records = [PromptRecord(prompt=f"p{i}", answer=str(i), row=i) for i in range(10)]
    kw = dict(batch_size=3, seed=1, num_epochs=3)
    reference = list(PromptPipeline(records, **kw))
    assert len(reference) == 9
    assert all(isinstance(r, PromptRecord) for b in reference for r in b)
    pipe = PromptPipeline(records, **kw)
    take(pipe, 4)
    # What the trainer does: grain's own Orbax handler writes the state as JSON.
    handler = grain.checkpoint.CheckpointHandler()
    handler.save(epath.Path(tmp_path), args=grain.checkpoint.CheckpointSave(pipe))
    fresh = handler.restore(
        epath.Path(tmp_path), args=grain.checkpoint.CheckpointRestore(PromptPipeline(records, **kw))
    )
    assert list(fresh) == reference[4:]


def test_state_from_other_settings_is_rejected():
    pipe = PromptPipeline(20, batch_size=4, seed=0)
    next(pipe)
    state = pipe.get_state()
    with pytest.raises(ValueError, match=r"seed=\(0, 1\)"):
        PromptPipeline(20, batch_size=4, seed=1).set_state(state)
    with pytest.raises(ValueError, match=r"num_records=\(20, 21\)"):
        PromptPipeline(21, batch_size=4, seed=0).set_state(state)
    with pytest.raises(ValueError, match="state must be a dict"):
        pipe.set_state({"step": 3})


@pytest.mark.parametrize("n", [24, 25])
def test_two_processes_disjoint_and_covering(n):
    per_epoch = 3  # 12 (n=24) or 12 of 12.5 (n=25) per process, batch 4
    kw = dict(batch_size=4, seed=3, process_count=2)
    shards = [take(PromptPipeline(n, process_index=p, **kw), 4 * per_epoch) for p in (0, 1)]
    for e in range(4):
        a, b = (epochs(s, per_epoch)[e] for s in shards)
        assert len(a) == len(b) == 12
        assert not set(a) & set(b)
        assert len(set(a) | set(b)) == 24
        if n == 24:
            assert sorted(a + b) == list(range(24))
    # With one record left over per epoch, which one rotates with the shuffle.
    if n == 25:
        pairs = zip(epochs(shards[0], 3), epochs(shards[1], 3), strict=True)
        left_out = [(set(range(25)) - set(x + y)).pop() for x, y in pairs]
        assert len(set(left_out)) > 1


def test_seeded_shuffle_deterministic_and_new_each_epoch():
    a = take(PromptPipeline(32, batch_size=8, seed=11), 12)
    b = take(PromptPipeline(32, batch_size=8, seed=11), 12)
    c = take(PromptPipeline(32, batch_size=8, seed=12), 12)
    assert a == b
    assert a != c
    per_epoch = epochs(a, 4)
    for order in per_epoch:
        assert sorted(order) == list(range(32))
    assert per_epoch[0] != list(range(32))
    assert len({tuple(o) for o in per_epoch}) == 3
    unshuffled = take(PromptPipeline(32, batch_size=8, seed=11, shuffle=False), 8)
    assert epochs(unshuffled, 4) == [list(range(32))] * 2


def test_epochs_and_remainder():
    pipe = PromptPipeline(10, batch_size=4, seed=0, num_epochs=2)
    assert (pipe.step, pipe.epoch) == (0, 0)
    batches = list(pipe)
    assert [len(b) for b in batches] == [4, 4, 4, 4]
    assert (pipe.step, pipe.epoch) == (4, 2)
    with pytest.raises(StopIteration):
        next(pipe)
    keep = list(PromptPipeline(10, batch_size=4, seed=0, num_epochs=2, drop_remainder=False))
    assert [len(b) for b in keep] == [4, 4, 2, 4, 4, 2]
    assert [sorted(x) for x in epochs(keep, 3)] == [list(range(10))] * 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="non-empty"):
        PromptPipeline([], batch_size=1, seed=0)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        PromptPipeline(8, batch_size=0, seed=0)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*32\)"):
        PromptPipeline(8, batch_size=2, seed=-1)
    with pytest.raises(ValueError, match=r"process_index must be in \[0, 2\), got 2"):
        PromptPipeline(8, batch_size=2, seed=0, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="fewer than batch_size=5"):
        PromptPipeline(8, batch_size=5, seed=0, process_count=2)
    with pytest.raises(ValueError, match="num_epochs"):
        PromptPipeline(8, batch_size=2, seed=0, num_epochs=0)


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_processes_get_equal_batch_counts(drop_remainder):
    # 25 records, 2 processes, batch 3: an uneven split would give one host 13 records (5 batches
    # without drop_remainder) and the other 12 (4), and the lock-stepped hosts would hang.
    kw = dict(batch_size=3, seed=5, num_epochs=2, process_count=2, drop_remainder=drop_remainder)
    runs = [list(PromptPipeline(25, process_index=p, **kw)) for p in (0, 1)]
    assert [len(r) for r in runs] == [8, 8]
    for e in range(2):
        a, b = (epochs(r, 4)[e] for r in runs)
        assert len(a) == len(b) == 12 and not set(a) & set(b)
