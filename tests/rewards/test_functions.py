"""Batched reward callables (TRL / Tunix convention), in the pool and in this process; RewardSet."""

import logging
import time

import numpy as np
import pytest

from delta_jax.rewards import RewardScorer, RewardSet, reward_name
from tests.rewards.custom_fns import batched_by_answer, batched_misbehaving

TIMEOUT_S = 1.5


def _items(**columns):
    n = len(next(iter(columns.values())))
    return [{k: v[i] for k, v in columns.items()} for i in range(n)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batched_callable_gets_columns_as_lists_and_none_means_does_not_apply(num_workers):
    completions = ["4", "5", "n/a", "7"]
    items = _items(answer=["4", "4", "4", "7"], extra=["a", "b", "c", "d"])
    with RewardScorer(batched_by_answer, num_workers=num_workers, batched=True) as scorer:
        assert scorer.in_process == (num_workers == 0)
        batch = scorer.score(["p"] * 4, completions, items, group_size=2)
    np.testing.assert_array_equal(batch.rewards, [1, 0, 0, 1])
    assert batch.reasons == ["ok", "ok", "none", "ok"]
    assert batch.counts == {"ok": 3, "none": 1}


@pytest.mark.parametrize("in_process", [False, True])
def test_batched_misbehaviour_costs_only_its_group(in_process):
    fn = batched_misbehaving
    if in_process:  # a closure: cannot reach a worker, runs here with the same deadline
        fn = lambda prompts, completions, **cols: batched_misbehaving(prompts, completions, **cols)
    modes = ["ok", "ok", "sleep", "sleep", "raise", "raise", "short", "short", "nan", "nan"]
    with RewardScorer(fn, num_workers=2, timeout_s=TIMEOUT_S, batched=True) as scorer:
        assert scorer.in_process == in_process
        t0 = time.monotonic()
        batch = scorer.score(["p"] * 10, ["c"] * 10, _items(mode=modes), group_size=2)
        assert time.monotonic() - t0 < 30
    np.testing.assert_array_equal(batch.rewards, [2, 2, 0, 0, 0, 0, 0, 0, 0, 1])
    assert batch.reasons == [
        "ok", "ok", "timeout", "timeout", "error:RuntimeError", "error:RuntimeError",
        "error:wrong_length", "error:wrong_length", "error:ValueError", "ok",
    ]  # fmt: skip


def test_in_process_callable_is_announced_once(caplog):
    with caplog.at_level(logging.WARNING, logger="delta_jax.rewards.batch"):
        scorer = RewardScorer(lambda p, c, **k: [1.0] * len(c), num_workers=2, batched=True)
        for _ in range(3):
            assert scorer.score(["p"], ["c"], [{}]).rewards.tolist() == [1.0]
    assert sum("runs in the trainer's process" in r.message for r in caplog.records) == 1
    scorer.close()


def test_reward_set_sums_weighted_functions_and_keeps_each_by_name():
    def brevity(prompts, completions, **columns):
        return [1.0 / len(c) for c in completions]

    completions = [r"\boxed{4}", r"\boxed{5}"]
    items = [{"answer": "4"}, {"answer": "4"}]
    with RewardSet(["math", brevity, brevity], weights=[1.0, 0.5, 2.0], num_workers=0) as rs:
        assert rs.names == ["math", "brevity", "brevity_2"]
        batch = rs.score(["p", "p"], completions, items, group_size=2)
    short = np.array([1 / len(c) for c in completions], np.float32)
    np.testing.assert_allclose(batch.components["math"], [1, 0])
    np.testing.assert_allclose(batch.components["brevity_2"], short)
    np.testing.assert_allclose(batch.rewards, np.array([1, 0]) + 2.5 * short, rtol=1e-6)
    assert batch.counts["math:correct"] == 1 and batch.counts["brevity:ok"] == 2


def test_reward_names_and_bad_arguments():
    assert reward_name("math") == "math"
    assert reward_name("tests.rl.reward_fns:graded_length") == "graded_length"
    assert reward_name(lambda p, c: c) == "lambda"
    with pytest.raises(ValueError, match="2 reward_weights for 1"):
        RewardSet([batched_by_answer], weights=[1, 2], num_workers=0)
    with pytest.raises(ValueError, match="at least one"):
        RewardSet([], num_workers=0)
    with pytest.raises(ValueError, match="a kind, a 'module:function' path or a callable"):
        RewardSet([3], num_workers=0)
    with pytest.raises(ValueError, match="group_size"):
        RewardScorer(batched_by_answer, num_workers=0, batched=True).score(
            ["p"] * 3, ["c"] * 3, [{"answer": "c"}] * 3, group_size=2
        )


@pytest.mark.parametrize("fn", ["math", "batched"])
def test_submissions_score_in_the_background_as_score_does(fn):
    batched = fn == "batched"
    kind = batched_by_answer if batched else "math"
    responses = [r"\boxed{4}", "4", r"\boxed{5}", "5", "n/a", r"\boxed{7}"]
    answers = ["4", "4", "4", "5", "1", "7"]
    if batched:
        responses = [r.replace(r"\boxed{", "").rstrip("}") for r in responses]
    items = [{"answer": a} for a in answers]
    with RewardScorer(kind, num_workers=2, batched=batched) as scorer:
        whole = scorer.score(["p"] * 6, responses, items, group_size=2)
        futures = [
            scorer.submit(["p"] * 2, responses[g : g + 2], items[g : g + 2], group_size=2)
            for g in (0, 2, 4)
        ]
        parts = [f.result(timeout=60) for f in futures]
    np.testing.assert_array_equal(np.concatenate([b.rewards for b in parts]), whole.rewards)
    assert [r for b in parts for r in b.reasons] == whole.reasons
    with pytest.raises(RuntimeError, match="closed"):
        scorer.submit(["p"], ["4"], [{"answer": "4"}])
