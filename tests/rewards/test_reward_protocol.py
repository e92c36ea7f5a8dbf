"""A batched reward function that breaks the protocol (returns the wrong length, a non-list, a
non-number, NaN or infinity, raises, hangs) costs only its own samples: reward 0, a reason
counted, the first cause of each reason logged once on one line; the scorer never raises. One it
cannot be called as at all is a one-line error when the scorer is built. Driven with generated
bad values (hypothesis)."""

import logging
import math
import numbers
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delta_jax.config import Config, ConfigError
from delta_jax.rewards import RewardScorer, RewardSet
from delta_jax.rewards.custom import check_call
from tests.rewards.custom_fns import batched_by_answer

N = 4  # samples per group (one call)


class Unprintable:
    """A value whose every conversion raises (a reward that is nothing)."""

    def __str__(self):
        raise RuntimeError("no str")

    __repr__ = __format__ = __str__

    def __float__(self):
        raise RuntimeError("no float")


class BadFloat(float):
    """A float whose conversion raises: a numbers.Real that is not a number."""

    def __float__(self):
        raise RuntimeError("no float")


class Rows:
    """An iterable of rewards that is not a list (read afresh each time)."""

    def __init__(self, values):
        self.values = values

    def __iter__(self):
        return iter(self.values)


class Boom(Exception):
    def __str__(self):
        raise RuntimeError("an exception that cannot print itself")


good = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.integers(-(10**6), 10**6),
    st.booleans(),
    st.builds(np.float32, st.floats(-1e3, 1e3, width=32)),
)
bad = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 10**400, -(10**400)]),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.complex_numbers(),
    st.builds(dict),
    st.lists(st.floats(), max_size=2),
    st.builds(Unprintable),
    st.builds(BadFloat, st.floats(allow_nan=False)),
)
element = st.one_of(good, bad, st.none())
# What the function returns: a list of the right length of anything, a list of the wrong
# length, or something that is not a list of rewards at all.
returned = st.one_of(
    st.lists(element, min_size=N, max_size=N),
    st.lists(element, max_size=2 * N).filter(lambda v: len(v) != N),
    st.lists(element, min_size=N, max_size=N).map(tuple),
    st.lists(element, min_size=N, max_size=N).map(Rows),
    st.lists(good, min_size=N, max_size=N).map(np.asarray),
    bad,
    good,
    st.none(),
    st.text(min_size=N, max_size=N),
)
raised = st.sampled_from(
    [RuntimeError("bug"), KeyError("k"), ValueError("line one\nline two"), Boom(), MemoryError()]
)
behaviour = st.one_of(st.tuples(st.just("return"), returned), st.tuples(st.just("raise"), raised))


def _hostile(kind, value):
    def hostile(prompts, completions, **columns):
        if kind == "raise":
            raise value
        return value

    return hostile


def _expected(kind, value):
    """(reward, reason) per sample as the protocol says, ``"error"`` for any error reason."""
    fail = [(0.0, "error")] * N
    if kind == "raise" or isinstance(value, str | bytes | dict):
        return fail
    try:
        values = list(value)
    except TypeError:
        return fail
    if len(values) != N:
        return fail
    out = []
    for v in values:
        if v is None:
            out.append((0.0, "none"))
            continue
        try:  # a real number, bool and NumPy included (custom.as_reward)
            x = float(v) if isinstance(v, numbers.Real) else math.nan
        except Exception:
            x = math.nan
        out.append((x, "ok") if math.isfinite(x) else (0.0, "error"))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(behaviour, st.sampled_from([0, 1]))
def test_a_protocol_breach_costs_only_its_samples(behaviour, num_workers):
    """Serial (``num_workers=0``) and in this process with a deadline (a closure cannot reach
    a worker): each breach is the same counted failure, the good group is kept."""
    kind, value = behaviour
    fn = _hostile(kind, value)
    with RewardScorer(fn, num_workers=num_workers, timeout_s=30, batched=True) as scorer:
        batch = scorer.score(["p"] * N, ["c"] * N, [{"answer": "1"}] * N, group_size=N)
    assert batch.rewards.dtype == np.float32 and np.isfinite(batch.rewards).all()
    want = _expected(kind, value)
    for (reward, reason), got, got_reason in zip(want, batch.rewards, batch.reasons, strict=True):
        if reason == "error":
            assert got_reason.startswith("error:") and got == 0, (got_reason, got)
        else:
            assert got_reason == reason and got == np.float32(reward), (got_reason, got)
    assert sum(batch.counts.values()) == N


def test_each_kind_of_failure_is_logged_once_on_one_line(caplog):
    results = iter([[1.0] * N, [1.0], "wrong", [math.nan] * N, [1.0], [object()] * N])

    def flaky(prompts, completions, **columns):
        return next(results)

    with caplog.at_level(logging.WARNING, "delta_jax.rewards.batch"):
        with RewardSet([flaky], num_workers=0) as rewards:
            reasons = [rewards.score(["p"] * N, ["c"] * N, [{}] * N, group_size=N).reasons[0]
                       for _ in range(6)]  # fmt: skip
    assert reasons == ["ok", "error:wrong_length", "error:TypeError", "error:ValueError",
                       "error:wrong_length", "error:TypeError"]  # fmt: skip
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all("\n" not in line for line in lines), lines
    assert lines[0].startswith("reward function flaky: error:wrong_length: returned 1 values")
    assert "error:TypeError: TypeError: returned str, not a list of floats" in lines[1]
    assert "ValueError: reward function returned a non-finite value nan" in lines[2]


def test_a_hang_is_abandoned_at_the_deadline_and_logged_once(caplog):
    release = threading.Event()

    def hangs(prompts, completions, **columns):
        if completions[0] == "hang":
            release.wait(60)
        return [1.0] * len(completions)

    completions = ["hang", "hang", "ok", "ok", "hang", "hang"]
    try:
        with caplog.at_level(logging.WARNING, "delta_jax.rewards.batch"):
            with RewardScorer(hangs, num_workers=1, timeout_s=0.3, batched=True) as scorer:
                t0 = time.monotonic()
                batch = scorer.score(["p"] * 6, completions, [{}] * 6, group_size=2)
                assert time.monotonic() - t0 < 10
    finally:
        release.set()
    assert batch.reasons == ["timeout", "timeout", "ok", "ok", "timeout", "timeout"]
    np.testing.assert_array_equal(batch.rewards, [0, 0, 1, 1, 0, 0])
    lines = [r.getMessage() for r in caplog.records if "hangs: timeout" in r.getMessage()]
    assert len(lines) == 1 and "reward function hangs: timeout: did not return within" in lines[0]
    assert "0.3 s deadline (reward.timeout_s)" in lines[0] and "abandoned" in lines[0]


def test_in_the_pool_bad_values_and_unsendable_rows_are_counted(caplog):
    """The same rules in a worker process; a row column that cannot be pickled to the worker
    costs its own unit only."""
    items = [{"answer": "4"}, {"answer": "4"}, {"answer": "4", "lock": threading.Lock()}]
    with caplog.at_level(logging.WARNING, "delta_jax.rewards.batch"):
        with RewardScorer(batched_by_answer, num_workers=1, batched=True) as scorer:
            batch = scorer.score(["p"] * 3, ["4", "n/a", "4"], items, group_size=1)
    assert batch.reasons == ["ok", "none", "error:unpicklable_row"]
    np.testing.assert_array_equal(batch.rewards, [1, 0, 0])
    (line,) = [r.getMessage() for r in caplog.records]
    assert "batched_by_answer: error:unpicklable_row: its rows cannot be sent" in line


def exact(prompts, completions, answer, **columns):
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


def no_columns(prompts, completions):
    return [0.0] * len(completions)


def one_argument(completions, **columns):
    return [0.0] * len(completions)


def positional_only(prompts, completions, level, /, **columns):
    return [0.0] * len(completions)


def per_item_two(prompt, response):
    return 0.0


@pytest.mark.parametrize(
    "fn, message",
    [
        (no_columns, r"reward function no_columns\(prompts, completions\) cannot be called as "
                     r"no_columns\(prompts, completions, answer=..., tests=..., \*\*columns\): "
                     r"got an unexpected keyword argument 'answer'$"),
        (one_argument, r"one_argument\(completions, \*\*columns\) cannot be called as .*: too "
                       r"many positional arguments$"),
        (positional_only, r"positional-only parameter 'level' is never given$"),
    ],
)  # fmt: skip
def test_a_function_that_cannot_take_the_arguments_is_a_start_up_error(fn, message):
    from delta_jax.rl.setup import make_scorers

    with pytest.raises(ValueError, match=message) as error:
        RewardSet([fn], num_workers=0, columns=("answer", "tests"))
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="^reward: reward function " + fn.__name__) as error:
        make_scorers(Config(), reward_fns=[fn])
    assert "\n" not in str(error.value)


def test_functions_that_can_take_the_arguments_pass():
    for fn in (exact, batched_by_answer, lambda p, c, **k: c, lambda *a, **k: a, max):
        check_call(fn, "f", batched=True, columns=("answer", "tests"))
    check_call(lambda prompt, response, item: 0.0, "f", batched=False)
    with pytest.raises(ValueError, match=r"cannot be called as f\(prompt, response, item\)"):
        check_call(per_item_two, "f", batched=False)
    with pytest.raises(ValueError, match="per_item_two"):
        RewardScorer("tests.rewards.test_reward_protocol:per_item_two", num_workers=0)
