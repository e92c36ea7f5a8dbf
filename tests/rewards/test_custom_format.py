"""Format rewards and loading custom reward functions by import path."""

import numpy as np
import pytest

from delta_jax.rewards import format_reward, load_reward_fn, score_format
from delta_jax.rewards.custom import as_reward


@pytest.mark.parametrize(
    ("response", "expected", "reason"),
    [
        (r"so the answer is \boxed{4}.", 1.0, "format_ok"),
        (r"\boxed{\frac{1}{2}}", 1.0, "format_ok"),
        ("the answer is 4", 0.0, "no_boxed"),
        (r"\boxed{1} or \boxed{2}", 0.0, "multiple_boxed"),
        (r"\boxed{}", 0.0, "malformed_boxed"),
        (r"\boxed{  }", 0.0, "malformed_boxed"),
        (r"\boxed{\frac{1}{2}", 0.0, "malformed_boxed"),
    ],
)
def test_default_format_rule(response, expected, reason):
    assert score_format(response) == (expected, reason)
    assert format_reward(response) == expected


def test_pattern_rule_matches_whole_response():
    pattern = r"<think>.+</think>.*\\boxed\{.+\}.*"
    assert format_reward("<think>hmm</think> so \\boxed{3}\n", pattern=pattern) == 1.0
    assert format_reward("so \\boxed{3}", pattern=pattern) == 0.0
    assert score_format("x <think>a</think>\\boxed{3}", pattern=pattern)[1] == "pattern_mismatch"


def test_load_reward_fn_imports_function():
    fn = load_reward_fn("tests.rewards.custom_fns:length_reward")
    assert fn("p", "abcd", {}) == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("path", "match"),
    [
        ("no_colon", "package.module:function"),
        ("a:b:c", "package.module:function"),
        (":fn", "package.module:function"),
        ("tests.rewards.does_not_exist:fn", "cannot import"),
        ("tests.rewards.custom_fns:missing", "no attribute"),
        ("tests.rewards.custom_fns:NOT_CALLABLE", "not callable"),
    ],
)
def test_load_reward_fn_errors(path, match):
    with pytest.raises(ValueError, match=match):
        load_reward_fn(path)


def test_as_reward_checks_values():
    assert as_reward(1) == 1.0
    assert as_reward(np.float32(0.5)) == 0.5
    assert as_reward(True) == 1.0
    with pytest.raises(TypeError):
        as_reward("1.0")
    with pytest.raises(ValueError, match="non-finite"):
        as_reward(float("inf"))
