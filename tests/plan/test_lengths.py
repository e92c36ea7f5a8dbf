"""The planner's rollout bounds at a response-length distribution (``--lengths``): the
distributions, the three schedules' arithmetic by hand, and the CLI's error lines."""

import json
import math
import re

import jax
import numpy as np
import pytest

from delta_jax import cli
from delta_jax.plan import lengths as lengths_lib
from delta_jax.plan import schedules

DEMO = "configs/demo.yaml"  # rollout.max_new_tokens: 24


@pytest.fixture(autouse=True)
def _session_devices():
    """JAX starts with the session's fake devices before a ``plan`` CLI call (which starts it with
    one device per chip of its topology when it is first) could, so later tests keep them."""
    jax.devices()


def test_continuous_batching_by_hand():
    # Slot 1 runs 3; slot 2 runs 1, then 1 (t=1..2), then 4 (t=2..6).
    assert schedules.continuous_batching_steps([3, 1, 1, 4], slots=2) == 6
    # Equal lengths: ceil(sequences / slots) rounds, the uniform roofline's decode steps.
    assert schedules.continuous_batching_steps([5] * 10, slots=4) == 3 * 5
    assert schedules.continuous_batching_steps([7], slots=4) == 7


def test_three_bounds_by_hand():
    engine = schedules.Engine(
        groups=2,
        chips=8,
        sequences=4,
        slots=2,
        prompts=1,
        prompt_len=10,
        decode_step_s=0.01,
        prefill_token_s=0.001,
    )
    sampled = np.array([[[3, 1, 1, 4], [2, 2, 2, 2]]])  # one step, two groups
    given = lengths_lib.Lengths(cap=4, source="by hand", values=(1, 2, 3, 4))
    b = schedules.bounds(given, sampled, engine, update_s=0.05, max_staleness=1)
    # Synchronous: group 1 ends at 6 decode steps, group 2 at 4; the step waits for 6.
    assert b.sync_steps == 6 and b.sync_occupancy == pytest.approx(17 / (2 * 2 * 6))
    assert b.prefill_s == pytest.approx(1 * 10 * 0.001)
    assert b.sync_s == pytest.approx(6 * 0.01 + 0.01)
    # Partial: E[L] = 17/8, E[L^2] = 43/8, slots always full: n E[L] / S decode steps, and the
    # 2 carried sequences per group prefilled again (prompt + mean age E[L^2] / (2 E[L])).
    mean, age = 17 / 8, (43 / 8) / (2 * 17 / 8)
    assert b.partial_steps == pytest.approx(4 * mean / 2) and b.age == pytest.approx(age)
    reprefill = 2 * (10 + age) * 0.001
    assert b.partial_s == pytest.approx(4 * mean / 2 * 0.01 + 0.01 + reprefill)
    # Asynchronous: one split, 4 chips (1 of 2 groups) each; the rollout on half the groups
    # takes twice the decode and prefill; the update on half the chips twice its bound; the
    # longest sequence (4 tokens) over 1 version of staleness.
    (split,) = b.splits
    assert (split.rollout_chips, split.groups) == (4, 1)
    assert split.rollout_s == pytest.approx(2 * (4 * mean / 2 * 0.01 + 0.01) + reprefill)
    assert split.update_s == pytest.approx(0.05 * 8 / 4)
    assert split.tail_s == pytest.approx(4 * 0.01)
    assert split.step_s == split.rollout_s and b.best_split is split
    # More staleness hides the tail; none is refused.
    assert schedules.bounds(given, sampled, engine, 0.05, 2).splits[0].tail_s == 0.02
    with pytest.raises(ValueError, match="--max-staleness=0 must be >= 1"):
        schedules.bounds(given, sampled, engine, 0.05, 0)
    text = "\n".join(b.lines())
    assert "synchronous" in text and "partial rollouts" in text and "best 4 of 8 chips" in text


def test_one_group_has_no_split():
    engine = schedules.Engine(1, 1, 4, 2, 1, 10, 0.01, 0.001)
    given = lengths_lib.Lengths(cap=4, source="by hand", values=(4,))
    b = schedules.bounds(given, np.full((2, 1, 4), 4), engine, 0.05, 1)
    assert b.splits == () and b.sync_steps == 8 and b.sync_occupancy == 1
    assert "no split" in b.lines()[-1]


def test_distributions():
    cap = 20480
    # The mean form: mu set so that the capped lengths have the mean given.
    d = lengths_lib.parse_lengths("lognormal:mean=4000,sigma=1.2", cap)
    assert lengths_lib.capped_lognormal_mean(d.mu, d.sigma, cap) == pytest.approx(4000)
    drawn = d.sample(np.random.default_rng(0), 200_000)
    assert drawn.min() >= 1 and drawn.max() == cap
    assert drawn.mean() == pytest.approx(4000, rel=0.01)
    # Far below the cap the capped mean is the log-normal's, e^(mu + sigma^2 / 2).
    assert lengths_lib.capped_lognormal_mean(0.0, 0.5, 1e9) == pytest.approx(math.exp(0.125))
    median = lengths_lib.parse_lengths("lognormal:median=900,sigma=1", cap)
    assert median.mu == pytest.approx(math.log(900))
    # Quantiles: flat at 100 up to q=0.5, then linear to 300: mean 0.5 * 100 + 0.5 * 200.
    q = lengths_lib.parse_lengths("quantiles:0.5=100,1=300", cap)
    assert q.mean == pytest.approx(150)
    assert np.mean(q.sample(np.random.default_rng(0), 100_000)) == pytest.approx(150, rel=0.01)
    listed = lengths_lib.parse_lengths("list:10,20,60", cap)
    assert listed.mean == 30 and set(listed.sample(np.random.default_rng(0), 100)) == {10, 20, 60}


def test_metrics_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    names = list(lengths_lib.METRIC_QUANTILES)
    rows = [
        {"step": 1, "response_length_mean": 5.0, **dict.fromkeys(names, 10.0)},
        {"step": 2, **{k: 10.0 * (i + 1) for i, k in enumerate(names)}},
        {"step": 3, "eval/avg@1": 0.5},  # rows without lengths are passed over
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{torn")
    d = lengths_lib.parse_lengths(str(path), cap=60)
    assert len(d.tables) == 2 and d.source == f"{path} (2 steps)"
    # Step 2's table capped at 60: (0, 10), (.1, 20), (.25, 30), (.5, 40), (.75, 50), then 60.
    step2 = 0.1 * 15 + 0.15 * 25 + 0.25 * 35 + 0.25 * 45 + 0.15 * 55 + 0.09 * 60 + 0.01 * 60
    assert d.mean == pytest.approx((10 + step2) / 2)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("lognormal:mean=-3,sigma=1", r"mean=-3.0 must be in \(0, rollout.max_new_tokens=24\)"),
        ("lognormal:mean=0,sigma=1", r"mean=0.0 must be in \(0"),
        ("lognormal:mean=30,sigma=1", r"mean=30.0 must be in \(0, rollout.max_new_tokens=24\)"),
        ("lognormal:mean=10,sigma=0", "sigma=0.0 must be > 0"),
        ("lognormal:mean=10", "give mean=M,sigma=S or median=M,sigma=S"),
        ("lognormal:mean=ten,sigma=1", "'mean=ten' is not key=number"),
        ("gamma:k=2", "not a file, nor lognormal:mean=M,sigma=S"),
        ("quantiles:0.5=30", r"lengths in \[1, rollout.max_new_tokens=24\]"),
        ("quantiles:0.5=20,0.9=10", "must not decrease"),
        ("list:3,x", "give whole token counts"),
    ],
)
def test_bad_lengths_are_one_error_line(capsys, spec, message):
    argv = ["plan", "--config", DEMO, "--topology", "v5e-1", "--compiler", "cpu"]
    assert cli.main([*argv, "--lengths", spec]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --lengths {spec}: ")
    assert re.search(message, err[0])


def test_bad_files_and_staleness_are_one_error_line(capsys, tmp_path):
    argv = ["plan", "--config", DEMO, "--topology", "v5e-1", "--compiler", "cpu"]
    old = tmp_path / "metrics.jsonl"
    old.write_text(json.dumps({"step": 1, "response_length_mean": 5.0}) + "\n")
    assert cli.main([*argv, "--lengths", str(old)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no step records the response-length quantiles" in err[0]
    assert cli.main([*argv, "--lengths", "list:3", "--max-staleness", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --max-staleness=0 must be >= 1"
    assert cli.main([*argv, "--lengths", "list:3", "--no-roofline"]) == 2
    assert "drop --no-roofline" in capsys.readouterr().err
    assert cli.main([*argv, "--lengths", "list:3", "--mean-new-tokens", "3"]) == 2
    assert "drop --mean-new-tokens" in capsys.readouterr().err
