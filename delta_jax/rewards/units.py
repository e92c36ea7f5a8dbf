"""The scoring of one unit of work: an item (per-item reward functions) or a group (batched
ones), as ``(reward, reason, cause)`` triples, whatever the function does.

What runs inside a reward worker process (:func:`worker_main`) and, for callables that cannot
reach one, in the trainer's process (:func:`call_with_deadline`): the built-in kinds' score
functions, the per-item and batched calling conventions, and the conversion of what a function
returns into a reward, a reason and, for a failure, its first cause on one line. The pool that
runs units, keeps deadlines and replaces dead workers is :mod:`delta_jax.rewards.pool`; the
scorer that splits batches into units is :mod:`delta_jax.rewards.batch`.
"""

from __future__ import annotations

import pickle
import signal
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from delta_jax.rewards.code import extract_code, run_code
from delta_jax.rewards.custom import as_reward, error_line, load_reward_fn
from delta_jax.rewards.format import score_format
from delta_jax.rewards.gym import (
    ANSWER_MARKER,
    GYM_ENTRY,
    MIN_WORKING,
    import_reasoning_gym,
    score_gym,
)
from delta_jax.rewards.math import score_math

ScoreFn = Callable[[str, str, Mapping[str, Any]], tuple[float, str]]
# (reward, reason, cause): the cause is "" unless the reward function failed, else one line.
Scored = tuple[float, str, str]
# A unit of work: (prompts, responses, items) of one item, or of one group for batched functions.
UnitFn = Callable[[Sequence[str], Sequence[str], Sequence[Mapping[str, Any]]], list[Scored]]


def make_score_fn(kind: str | Callable[..., Any], options: Mapping[str, Any]) -> ScoreFn:
    """``(prompt, response, item) -> (reward, reason)`` of a built-in kind, a
    ``package.module:function`` path or a per-item callable."""
    if kind == "math":
        return lambda prompt, response, item: score_math(response, item["answer"])
    if kind == "format":
        pattern = options.get("pattern")
        return lambda prompt, response, item: score_format(response, pattern=pattern)
    if kind == "code":
        code_kwargs = dict(options.get("code_kwargs", {}))

        def score_code(prompt: str, response: str, item: Mapping[str, Any]) -> tuple[float, str]:
            code = extract_code(response)
            if code is None:
                return 0.0, "no_code"
            result = run_code(code, item["tests"], **code_kwargs)
            return float(result.passed), result.reason

        return score_code
    if kind == "reasoning_gym":
        # Imported now: a missing package fails the scorer's construction (one line), and a
        # worker pays the import before it is ready, not within an item's deadline.
        import_reasoning_gym()
        return lambda prompt, response, item: score_gym(
            response, item[GYM_ENTRY], item.get(ANSWER_MARKER), item.get(MIN_WORKING, 0)
        )
    fn = load_reward_fn(kind) if isinstance(kind, str) else kind
    return lambda prompt, response, item: (as_reward(fn(prompt, response, item)), "ok")


def failed(e: BaseException) -> Scored:
    """A failed call: reward 0, reason ``error:<ExceptionType>``, the exception on one line."""
    return 0.0, f"error:{type(e).__name__}", error_line(e)


def score_one(score_fn: ScoreFn, prompt: str, response: str, item: Mapping[str, Any]) -> Scored:
    """One item through a per-item score function; any exception is a failed score."""
    try:
        reward, reason = score_fn(prompt, response, item)
        return float(reward), reason, ""
    except Exception as e:  # noqa: BLE001 - any failure of a reward function is a 0 reward
        return failed(e)


def batched_value(value: Any) -> Scored:
    """One value a batched function returned: None does not apply (reason ``none``)."""
    if value is None:
        return 0.0, "none", ""
    try:
        return as_reward(value), "ok", ""
    except Exception as e:  # noqa: BLE001 - a number whose conversion raises is a bad value too
        return failed(e)


def make_unit_fn(kind: str | Callable[..., Any], options: Mapping[str, Any]) -> UnitFn:
    """``(prompts, responses, items) -> [(reward, reason)]`` for one unit of work."""
    if not options.get("batched"):
        score_fn = make_score_fn(kind, options)
        return lambda prompts, responses, items: [
            score_one(score_fn, p, r, i) for p, r, i in zip(prompts, responses, items, strict=True)
        ]

    def batched(prompts, responses, items) -> list[Scored]:
        n = len(prompts)
        keys = dict.fromkeys(k for item in items for k in item)
        columns = {k: [item.get(k) for item in items] for k in keys}
        try:
            values = kind(list(prompts), list(responses), **columns)
            if isinstance(values, str | bytes | Mapping) or not isinstance(values, Iterable):
                raise TypeError(f"returned {type(values).__name__}, not a list of floats")
            values = list(values)
        except Exception as e:  # noqa: BLE001 - any failure of a reward function is a 0 reward
            return [failed(e)] * n
        if len(values) != n:
            cause = f"returned {len(values)} values for {n} completions"
            return [(0.0, "error:wrong_length", cause)] * n
        return [batched_value(v) for v in values]

    return batched


def runs_in_process(fn: Any) -> bool:
    """Whether a reward callable must run in this process: it cannot reach a spawned worker.

    Functions of ``__main__`` (a script, a notebook cell) would make each worker re-import the
    main program; lambdas, closures and other unpicklable objects cannot be sent at all.
    """
    if isinstance(fn, str):
        return False
    if getattr(fn, "__module__", None) == "__main__":
        return True
    try:
        pickle.dumps(fn)
    except Exception:  # noqa: BLE001 - any pickling failure means: not for the pool
        return True
    return False


def call_with_deadline(fn: Callable[[], Any], deadline_s: float) -> tuple[bool, Any]:
    """Runs ``fn`` in a daemon thread; ``(False, None)`` if it is still running at the deadline
    (the thread is abandoned: it runs on until ``fn`` returns), ``(True, exception)`` if ``fn``
    raised (even ``SystemExit``: a thread's exit must not pass for a hang)."""
    box: list = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline_s)
    return (False, None) if thread.is_alive() or not box else (True, box[0])


def worker_main(conn, kind, options) -> None:
    """A reward worker process: ``ready`` (or ``init_error``) on ``conn``, then units in,
    results out, until the pipe closes or sends None."""
    # Ctrl-C is the parent's to handle; workers are shut down through their pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        unit_fn = make_unit_fn(kind, options)
        if kind == "math":
            # The first parse builds math-verify's grammar (about a second): not an item's time.
            unit_fn([""], ["\\boxed{1}"], [{"answer": "1"}])
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        index, prompts, responses, items = task
        try:
            results = unit_fn(prompts, responses, items)
        except Exception as e:  # noqa: BLE001 - the unit functions catch; this is a last guard
            results = [failed(e)] * len(prompts)
        conn.send((index, results))
