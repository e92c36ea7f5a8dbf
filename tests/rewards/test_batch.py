"""RewardScorer: parallel batches, per-item deadlines, crash isolation, reason counts."""

import glob
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from delta_jax.rewards import RewardBatch, RewardScorer
from tests.rewards.custom_fns import length_reward
from tests.rewards.helpers import sandbox_processes

TIMEOUT_S = 2.0
HANG = r"the answer is \boxed{9^{9^{9^{9}}}}"  # math-verify computes this in C: never returns.
CUSTOM = "tests.rewards.custom_fns:by_mode"


@pytest.fixture(scope="module")
def math_scorer():
    with RewardScorer("math", num_workers=2, timeout_s=TIMEOUT_S) as scorer:
        yield scorer


@pytest.fixture(scope="module")
def custom_scorer():
    with RewardScorer(CUSTOM, num_workers=2, timeout_s=TIMEOUT_S) as scorer:
        yield scorer


def _score(scorer, responses, answers):
    return scorer.score(["q"] * len(responses), responses, [{"answer": a} for a in answers])


def test_math_batch_rewards_and_counts(math_scorer):
    responses = [r"\boxed{\frac12}", r"\boxed{0.3}", "no box", r"\boxed{4}", r"\boxed{2, 1}"]
    answers = ["0.5", r"\frac{1}{3}", "2", "4", r"\{1, 2\}"]
    batch = _score(math_scorer, responses, answers)
    assert isinstance(batch, RewardBatch)
    assert batch.rewards.dtype == np.float32 and batch.rewards.shape == (5,)
    np.testing.assert_array_equal(batch.rewards, np.array([1, 0, 0, 1, 1], np.float32))
    assert batch.reasons == ["correct", "wrong", "no_answer", "correct", "correct"]
    assert batch.counts == {"correct": 3, "wrong": 1, "no_answer": 1}


def test_hanging_verifier_is_cut_and_the_pool_keeps_working(math_scorer):
    start = time.monotonic()
    batch = _score(math_scorer, [HANG, r"\boxed{7}", r"\boxed{8}"], ["1", "7", "7"])
    elapsed = time.monotonic() - start
    assert batch.reasons == ["timeout", "correct", "wrong"]
    np.testing.assert_array_equal(batch.rewards, np.array([0, 1, 0], np.float32))
    # Bounded by the deadline plus the cost of scoring the rest, not by the hang.
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 8.0
    after = _score(math_scorer, [r"\boxed{3}"] * 4, ["3"] * 4)
    assert after.counts == {"correct": 4}
    assert len(math_scorer._pool.workers) == 2
    assert all(w.process.is_alive() for w in math_scorer._pool.workers)


def test_two_hangs_at_once_with_two_workers(math_scorer):
    batch = _score(math_scorer, [HANG, HANG, r"\boxed{1}"], ["1", "1", "1"])
    assert batch.reasons == ["timeout", "timeout", "correct"]


def test_a_job_submitted_while_another_runs_starts_on_a_free_worker(custom_scorer):
    """Submissions stream into the pool: a second job's item takes the idle worker at once and
    its future is set while the first job's item still runs (streaming rewards rely on it)."""
    custom_scorer.wait_ready()
    slow = custom_scorer.submit(["q"], ["r"], [{"mode": "nap", "seconds": 1.5, "value": 1.0}])
    time.sleep(0.1)
    fast = custom_scorer.submit(["q"], ["r"], [{"mode": "nap", "seconds": 0.0, "value": 2.0}])
    assert fast.result(timeout=10).rewards.tolist() == [2.0]
    assert not slow.done()
    assert slow.result(timeout=10).rewards.tolist() == [1.0]


def test_custom_misbehaviour_gives_zero_with_reason(custom_scorer):
    modes = ["ok", "raise", "exit", "segfault", "nan", "str", "sleep", "ok"]
    items = [{"mode": m, "value": 0.25 * (i + 1)} for i, m in enumerate(modes)]
    start = time.monotonic()
    batch = custom_scorer.score(["p"] * len(items), ["r"] * len(items), items)
    assert time.monotonic() - start < TIMEOUT_S + 15.0
    assert batch.reasons == [
        "ok",
        "error:ZeroDivisionError",
        "worker_died",
        "worker_died",
        "error:ValueError",
        "error:TypeError",
        "timeout",
        "ok",
    ]
    np.testing.assert_array_equal(batch.rewards, np.array([0.25, 0, 0, 0, 0, 0, 0, 2.0]))
    again = custom_scorer.score(["p"] * 3, ["r"] * 3, [{"value": 1.0}] * 3)
    assert again.counts == {"ok": 3}


def test_serial_mode_matches_pool(math_scorer):
    responses = [r"\boxed{\dfrac{2}{4}}", r"\boxed{(0, 1]}", r"\boxed{5}", ""]
    answers = ["0.5", "(0, 1]", "6", "1"]
    serial = _score(RewardScorer("math", num_workers=0), responses, answers)
    pooled = _score(math_scorer, responses, answers)
    np.testing.assert_array_equal(serial.rewards, pooled.rewards)
    assert serial.reasons == pooled.reasons == ["correct", "correct", "wrong", "no_answer"]


def test_serial_custom_errors_are_caught():
    scorer = RewardScorer(CUSTOM, num_workers=0)
    batch = scorer.score(["p", "p"], ["r", "r"], [{"mode": "raise"}, {"value": 3}])
    assert batch.reasons == ["error:ZeroDivisionError", "ok"]
    np.testing.assert_array_equal(batch.rewards, np.array([0, 3], np.float32))


def test_format_and_callable_kinds():
    fmt = RewardScorer("format", num_workers=0)
    assert fmt.score(["p"] * 2, [r"\boxed{1}", "1"], [{}, {}]).reasons == ["format_ok", "no_boxed"]
    with RewardScorer(length_reward, num_workers=1) as scorer:
        batch = scorer.score(["p"], ["abcde"], [{}])
    np.testing.assert_allclose(batch.rewards, [0.5])


def test_code_kind_scores_responses():
    tests = '{"inputs": ["2"], "outputs": ["4"]}'
    responses = [
        "```python\nprint(int(input()) ** 2)\n```",
        "```python\nprint(int(input()) + 3)\n```",
        "I cannot solve this.",
    ]
    with RewardScorer("code", num_workers=2, timeout_s=5) as scorer:
        batch = scorer.score(["p"] * 3, responses, [{"tests": tests}] * 3)
    assert batch.reasons == ["passed", "wrong_answer", "no_code"]
    np.testing.assert_array_equal(batch.rewards, np.array([1, 0, 0], np.float32))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="package.module:function"):
        RewardScorer("maths", num_workers=0)
    with pytest.raises(ValueError, match="num_workers"):
        RewardScorer("math", num_workers=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardScorer("math", num_workers=0, timeout_s=0)
    scorer = RewardScorer("math", num_workers=0)
    with pytest.raises(ValueError, match="same length"):
        scorer.score(["p"], ["r", "r"], [{"answer": "1"}])
    with pytest.raises(ValueError, match=r"items\[1\].*'answer'"):
        scorer.score(["p", "p"], ["r", "r"], [{"answer": "1"}, {"tests": "x"}])


def test_close_is_idempotent_and_final():
    scorer = RewardScorer("math", num_workers=1)
    processes = [w.process for w in scorer._pool.workers]
    scorer.close()
    scorer.close()
    assert not any(p.is_alive() for p in processes)
    with pytest.raises(RuntimeError, match="closed"):
        scorer.score(["p"], [r"\boxed{1}"], [{"answer": "1"}])


def test_killed_worker_takes_its_sandbox_down():
    with RewardScorer("tests.rewards.custom_fns:sandboxed_spin", num_workers=1, timeout_s=1.5) as s:
        s.wait_ready()
        worker_pid = s._pool.workers[0].process.pid
        batch = s.score(["p"], ["r"], [{}])
    assert batch.reasons == ["timeout"]
    deadline = time.monotonic() + 5.0
    while sandbox_processes([worker_pid]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes([worker_pid]) == []
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"dj-sandbox-{worker_pid}-*")) == []


SCRIPT_WITHOUT_MAIN_GUARD = """
import sys
from delta_jax.rewards import RewardScorer

print("main program ran", flush=True)  # once: not again in each worker
with RewardScorer("math", num_workers=1, timeout_s=60) as scorer:
    batch = scorer.score(["p", "p"], ["\\\\boxed{2}", "\\\\boxed{3}"], [{"answer": "2"}] * 2)
print(batch.rewards.tolist(), sys.modules["__main__"].__file__ == __file__)
"""


def test_a_script_without_a_main_guard_gets_its_reward_workers(tmp_path):
    """Spawned workers do not run the user's main program (a README snippet saved as a file
    would otherwise start its trainer again in each worker, which never became ready)."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT_WITHOUT_MAIN_GUARD)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("main program ran") == 1
    assert done.stdout.splitlines()[-1] == "[1.0, 0.0] True"  # __main__ restored after the start
