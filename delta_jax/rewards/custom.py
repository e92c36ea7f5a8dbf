"""Custom rewards by import path: ``"package.module:function"``.

The function is called as ``fn(prompt: str, response: str, item: Mapping) -> float`` where
``item`` is the data set row (``"answer"``, ``"tests"`` and any other field it has). It should
return a finite number; :class:`~delta_jax.rewards.RewardScorer` turns anything else (an
exception, a non-number, NaN, a hang, a crash of the process) into reward 0 with a reason.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

RewardFn = Callable[[str, str, Mapping[str, Any]], float]


def load_reward_fn(path: str) -> RewardFn:
    """Imports a reward function given as ``"package.module:function"``.

    Args:
      path: module import path and attribute name separated by one colon; the attribute may be
        dotted (``"pkg.mod:Class.method"``).

    Returns:
      The callable, with signature ``(prompt, response, item) -> float``.

    Raises:
      ValueError: if `path` is malformed, the module or attribute does not exist, or the
        attribute is not callable.

    Examples:
      >>> fn = load_reward_fn("my_rewards:length_penalty")  # doctest: +SKIP
      >>> fn("2+2?", "4", {"answer": "4"})  # doctest: +SKIP
    """
    return load_callable(path, "reward function")


def load_callable(path: str, what: str) -> Callable:
    """The callable at ``"package.module:attribute"`` (``what`` names it in errors)."""
    if not isinstance(path, str) or path.count(":") != 1:
        raise ValueError(f"{what} path must be 'package.module:function', got {path!r}")
    module_name, attr = path.split(":")
    if not module_name or not attr:
        raise ValueError(f"{what} path must be 'package.module:function', got {path!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {path!r}: cannot import {module_name!r}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {path!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {path!r} is not callable ({type(obj).__name__})")
    return obj


def check_call(fn: Callable, name: str, *, batched: bool, columns: Sequence[str] = ()) -> None:
    """Raises a one-line ValueError when ``fn`` cannot take the arguments the scorer passes.

    Per item: ``fn(prompt, response, item)``. Batched: ``fn(prompts, completions, **columns)``,
    where ``columns`` names the columns every call passes (the trainer passes ``answer`` and
    ``tests``); other named parameters may be any data column, which only a call can tell. A
    callable without a signature (a builtin) is not checked.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    if batched:
        given = ", ".join(["prompts", "completions", *(f"{c}=..." for c in columns)])
        call = f"{name}({given}, **columns)"
        args, kwargs = ([], []), dict.fromkeys(columns, [])
    else:
        call, args, kwargs = f"{name}(prompt, response, item)", ("", "", {}), {}
    try:
        bound = sig.bind_partial(*args, **kwargs) if batched else sig.bind(*args)
    except TypeError as e:
        raise ValueError(f"reward function {name}{sig} cannot be called as {call}: {e}") from None
    for p in sig.parameters.values():  # a positional-only parameter cannot be a column
        if p.kind is p.POSITIONAL_ONLY and p.default is p.empty and p.name not in bound.arguments:
            raise ValueError(
                f"reward function {name}{sig} cannot be called as {call}: its positional-only "
                f"parameter {p.name!r} is never given"
            )


def error_line(e: BaseException) -> str:
    """``Type: message`` on one line, at most 200 characters (an exception's __str__ may raise)."""
    try:
        text = " ".join(str(e).split())
    except Exception:  # noqa: BLE001 - an exception that cannot print itself
        text = "<unprintable>"
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def as_reward(value: Any) -> float:
    """Checks a custom function's return value: a finite real number (bool and NumPy included)."""
    if not isinstance(value, numbers.Real):
        raise TypeError(f"reward function returned {type(value).__name__}, expected a float")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"reward function returned a non-finite value {out}")
    return out
