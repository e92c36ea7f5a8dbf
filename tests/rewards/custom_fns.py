"""Custom reward functions for the tests, imported by path ("tests.rewards.custom_fns:...")."""

import ctypes
import os
import time


def by_mode(prompt, response, item):
    """Misbehaves as ``item["mode"]`` says; otherwise returns ``item["value"]``."""
    mode = item.get("mode", "ok")
    if mode == "sleep":
        time.sleep(3600)
    if mode == "nap":
        time.sleep(item["seconds"])
    if mode == "raise":
        return 1 / 0
    if mode == "exit":
        os._exit(3)
    if mode == "segfault":
        ctypes.string_at(0)
    if mode == "nan":
        return float("nan")
    if mode == "str":
        return "1.0"
    return item["value"]


def length_reward(prompt, response, item):
    """A well-behaved custom reward: the response length divided by 10."""
    return len(response) / 10


NOT_CALLABLE = 3


def sandboxed_spin(prompt, response, item):
    """Runs an endless program in the code sandbox with a long budget of its own."""
    from delta_jax.rewards import run_code

    return float(run_code("while True:\n    pass", "assert True", timeout_s=60).passed)


def batched_by_answer(prompts, completions, answer, **columns):
    """Batched convention: 1 where the completion equals the answer, None where it is "n/a"."""
    return [None if c == "n/a" else float(c == a) for c, a in zip(completions, answer, strict=True)]


def batched_misbehaving(prompts, completions, mode, **columns):
    """Misbehaves as the group's first ``mode`` says (one call per group)."""
    if mode[0] == "sleep":
        time.sleep(3600)
    if mode[0] == "raise":
        raise RuntimeError("boom")
    if mode[0] == "short":
        return [1.0]
    if mode[0] == "nan":
        return [float("nan")] + [1.0] * (len(completions) - 1)
    return [2.0] * len(completions)
