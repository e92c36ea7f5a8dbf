"""Misbehaving custom rewards for the loop tests (imported by path in reward worker processes)."""

import re
import time

from delta_jax.rewards import math_reward


def raises_or_hangs(prompt: str, response: str, item) -> float:
    """Raises when the first operand is even and hangs when it is odd: never returns."""
    a = int(re.search(r"\d+", prompt).group())
    if a % 2 == 0:
        raise RuntimeError("custom reward failed on purpose")
    time.sleep(60)
    return 1.0


def graded_length(prompt: str, response: str, item) -> float:
    """A dense reward (longer is better, up to 20 characters): every group carries signal."""
    return min(len(response), 20) / 20


def slow_math(prompt: str, response: str, item) -> float:
    """The math reward, 0.1 s per item: gives a test time to kill a run between two saves."""
    time.sleep(0.1)
    return math_reward(response, item["answer"])
