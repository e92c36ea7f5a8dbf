"""Math reward on hand-written cases; every expected value follows from the mathematics."""

import pytest

from delta_jax.rewards import math_reward
from delta_jax.rewards.math import extract_last_boxed, score_math

# (gold answer as a data set stores it, response, expected reward)
CASES = [
    # fractions vs decimals
    (r"\frac{1}{2}", r"so the answer is \boxed{0.5}", 1.0),
    ("0.5", r"\boxed{\frac{1}{2}}", 1.0),
    ("0.25", r"\boxed{\frac{1}{4}}", 1.0),
    (r"\frac{1}{3}", r"\boxed{0.33}", 0.0),
    (r"\frac{3}{4}", r"\boxed{3/4}", 1.0),
    (r"\frac{1}{2}", r"\boxed{\frac{2}{4}}", 1.0),
    (r"\frac{1}{2}", r"\boxed{\frac12}", 1.0),
    ("2", r"\boxed{\frac{4}{2}}", 1.0),
    ("7", r"\boxed{7.1}", 0.0),
    # \dfrac, \tfrac
    (r"\frac{1}{2}", r"\boxed{\dfrac{1}{2}}", 1.0),
    (r"\dfrac{3}{4}", r"\boxed{0.75}", 1.0),
    (r"\dfrac{2}{3}", r"\boxed{\tfrac{2}{3}}", 1.0),
    (r"\dfrac{2}{3}", r"\boxed{\frac{3}{2}}", 0.0),
    # integers and signs
    ("12", r"The answer is \boxed{12}.", 1.0),
    ("12", r"\boxed{13}", 0.0),
    ("-3", r"\boxed{-3}", 1.0),
    ("-3", r"\boxed{3}", 0.0),
    ("1000000", r"\boxed{10^6}", 1.0),
    # radicals, constants, expressions
    (r"\sqrt{2}", r"\boxed{2^{1/2}}", 1.0),
    (r"\sqrt{2}", r"\boxed{1.414}", 0.0),
    (r"\frac{\sqrt{3}}{2}", r"\boxed{\frac{\sqrt3}{2}}", 1.0),
    (r"2\pi", r"\boxed{2 \pi}", 1.0),
    (r"2\pi", r"\boxed{\pi}", 0.0),
    ("x^2 + 2x + 1", r"\boxed{(x+1)^2}", 1.0),
    ("x^2 + 1", r"\boxed{(x+1)^2}", 0.0),
    ("3", r"\boxed{\log_2 8}", 1.0),
    # intervals
    ("(1, 2]", r"\boxed{(1,2]}", 1.0),
    ("(1, 2]", r"\boxed{[1,2]}", 0.0),
    (r"[0, \infty)", r"\boxed{[0,\infty)}", 1.0),
    (r"(-\infty, 3)", r"\boxed{(-\infty, 3]}", 0.0),
    # sets and lists of solutions
    (r"\{1, 2, 3\}", r"\boxed{\{3, 2, 1\}}", 1.0),
    (r"\{1, 2, 3\}", r"\boxed{\{1, 2\}}", 0.0),
    ("1, 2, 3", r"\boxed{3, 1, 2}", 1.0),
    ("-1, 1", r"\boxed{1}", 0.0),
    # units and \text{} wrappers
    ("5", r"\boxed{5\text{ cm}}", 1.0),
    ("5", r"\boxed{5 \text{ meters}}", 1.0),
    ("90", r"\boxed{90^\circ}", 1.0),
    ("5", r"\boxed{\text{5}}", 1.0),
    (r"\frac{1}{2}", r"\boxed{\dfrac{1}{2}\text{ liters}}", 1.0),
    (r"\text{B}", r"\boxed{\text{B}}", 1.0),
    (r"\text{B}", r"\boxed{\text{C}}", 0.0),
    # equations: the right-hand side is the answer
    ("5", r"\boxed{x = 5}", 1.0),
    ("5", r"\boxed{x = 6}", 0.0),
    # multiple boxed answers: the last one counts
    ("5", r"First \boxed{3}, but correcting: \boxed{5}", 1.0),
    ("3", r"First \boxed{3}, but correcting: \boxed{5}", 0.0),
    ("2", r"\boxed{2} \boxed{2}", 1.0),
    # gold answers with delimiters
    (r"$\frac{1}{2}$", r"\boxed{0.5}", 1.0),
    (r"\boxed{10}", r"$\boxed{10}$", 1.0),
    # no (complete) answer
    ("12", "The answer is 12.", 0.0),
    ("12", "", 0.0),
    ("12", r"\boxed{}", 0.0),
    ("5", r"\boxed{5", 0.0),
    ("5", r"\boxed{5} but wait \boxed{", 0.0),
]


@pytest.mark.parametrize(("answer", "response", "expected"), CASES)
def test_math_reward_table(answer, response, expected):
    assert math_reward(response, answer) == expected


def test_table_size():
    assert len(CASES) >= 40


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        ("no box here", "no_answer"),
        (r"\boxed{}", "no_answer"),
        (r"\boxed{7}", "wrong"),
        (r"\boxed{12}", "correct"),
    ],
)
def test_score_math_reasons(response, reason):
    assert score_math(response, "12")[1] == reason


def test_extract_last_boxed_nested_braces():
    text = r"\boxed{1} then \boxed{\frac{a}{b^{2}}} done"
    assert extract_last_boxed(text) == r"\frac{a}{b^{2}}"


def test_score_math_rejects_non_strings():
    with pytest.raises(ValueError, match="response and answer"):
        score_math(None, "1")
