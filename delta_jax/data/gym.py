"""Prompt records from reasoning-gym's procedural tasks (``data.source: reasoning_gym:<task>``).

reasoning-gym generates problems instead of reading them: a task name (``basic_arithmetic``,
``sudoku``, ...), the task's options, a size and a seed give the same entries every time. Each
record keeps its whole entry in ``extra["gym_entry"]``, which the ``reasoning_gym`` reward kind
(:mod:`delta_jax.rewards.gym`) hands back to the task's own scorer; the entry is plain data
(dicts, strings, numbers), so it travels to the reward worker processes.

Held-out sets: entry ``i`` of seed ``s`` is drawn from ``Random(s + i)`` in reasoning-gym's
tasks, so seeds ``s`` and ``s + 1`` share all their entries but one. The held-out set is
generated from seed ``s + EVAL_SEED_OFFSET`` (1_000_003), and a training set holds at most
``MAX_SIZE`` (1_000_000) entries, so the two never draw from the same random stream.

``reasoning_gym`` is an optional dependency (``pip install -e ".[gym]"``), imported on
first use (:func:`delta_jax.rewards.gym.import_reasoning_gym`).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import pickle
from collections.abc import Mapping
from typing import Any

from delta_jax.data.sources import PromptRecord
from delta_jax.rewards.gym import import_reasoning_gym

GYM_PREFIX = "reasoning_gym:"
EVAL_SEED_OFFSET = 1_000_003
MAX_SIZE = 1_000_000
GYM_ENTRY = "gym_entry"  # the reward's item field (delta_jax.rewards.gym.GYM_ENTRY)
ANSWER_MARKER = "answer_marker"  # data.answer_marker's (delta_jax.rewards.gym.ANSWER_MARKER)
MIN_WORKING = "min_working_words"  # data.min_working_words' (delta_jax.rewards.gym.MIN_WORKING)
_GIVEN_APART = ("size", "seed")  # config fields that are arguments here, not options


def is_gym_source(source: str | None) -> bool:
    """Whether a ``data.source`` / ``data.eval_source`` names a reasoning-gym task."""
    return isinstance(source, str) and source.startswith(GYM_PREFIX)


def gym_task(source: str) -> str:
    """The task of a ``reasoning_gym:<task>`` source."""
    task = source[len(GYM_PREFIX) :].strip() if is_gym_source(source) else ""
    if not task:
        raise ValueError(f"{source!r} names no task: write reasoning_gym:<task>")
    return task


def eval_gym_options(data_config: Any, source: str | None = None) -> dict[str, Any]:
    """The options of a held-out set, ``source`` (default ``data.eval_source``, else
    ``data.source``): ``data.gym_options`` when it is the task of ``data.source``, else none
    (the task's defaults)."""
    d = data_config
    held_out = source or d.eval_source or d.source
    same = is_gym_source(d.source) and gym_task(held_out) == gym_task(d.source)
    return dict(d.gym_options) if same else {}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def check_task(task: str, options: Mapping[str, Any] | None = None) -> None:
    """Raises a one-line ValueError unless ``task`` is registered and takes ``options``.

    The options are checked by the task's own config class (its fields, then its
    ``validate()``), without generating anything.
    """
    registry = import_reasoning_gym().factory.DATASETS
    if task not in registry:
        close = difflib.get_close_matches(task, list(registry), n=3, cutoff=0.5)
        hint = (
            f"did you mean {', '.join(close)}?"
            if close
            else f"see reasoning_gym.factory.DATASETS ({len(registry)} tasks)"
        )
        raise ValueError(f"unknown reasoning_gym task {task!r}; {hint}")
    options = copy.deepcopy(dict(options or {}))  # the task may keep (and change) them
    config_cls = registry[task][1]
    if dataclasses.is_dataclass(config_cls):
        valid = [f.name for f in dataclasses.fields(config_cls) if f.name not in _GIVEN_APART]
        for name in options:
            if name in _GIVEN_APART:
                raise ValueError(
                    f"reasoning_gym task {task!r}: {name!r} is not an option here, the size and "
                    "seed are given apart (data.gym_size, data.gym_seed)"
                )
            if name not in valid:
                raise ValueError(
                    f"reasoning_gym task {task!r} has no option {name!r}; valid: {', '.join(valid)}"
                )
    try:
        config = config_cls(**options)
        if callable(getattr(config, "validate", None)):
            config.validate()
    except Exception as e:  # noqa: BLE001 - whatever the task's own checks raise
        raise ValueError(
            f"reasoning_gym task {task!r}: bad options {options}: {_first_line(e)}"
        ) from None


def gym_records(
    task: str, *, size: int, seed: int, options: Mapping[str, Any] | None = None
) -> list[PromptRecord]:
    """``size`` records of a reasoning-gym task, a function of ``(task, options, seed)``.

    Args:
      task: a registered task name (``reasoning_gym.factory.DATASETS``).
      size: entries generated (>= 1).
      seed: the data set's seed; entry ``i`` depends on ``seed + i`` (module docstring).
      options: the task's config options (e.g. ``{"min_terms": 2}`` for basic_arithmetic).

    Returns:
      Records with the question as prompt, the answer, source
      ``reasoning_gym:<task>[seed=<seed>]``, the entry's index as row and the whole entry in
      ``extra["gym_entry"]``.

    Raises:
      ValueError: one line, for an unknown task, an unknown option or a bad option value.
      ImportError: reasoning_gym is not installed.
    """
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"reasoning_gym task {task!r}: size={size!r} must be >= 1")
    check_task(task, options)
    options = copy.deepcopy(dict(options or {}))
    data = import_reasoning_gym().create_dataset(task, size=size, seed=seed, **options)
    source = f"{GYM_PREFIX}{task}[seed={seed}]"
    return [_record(entry, source, i) for i, entry in enumerate(_entries(data, size, source))]


def is_gym_dataset(data: Any) -> bool:
    """A reasoning-gym data set object (``ProceduralDataset``, duck-typed): sized, indexable,
    with a ``score_answer`` method."""
    return callable(getattr(data, "score_answer", None)) and all(
        hasattr(data, a) for a in ("__len__", "__getitem__")
    )


def records_from_gym_dataset(
    data: Any, *, label: str = "train_dataset", limit: int | None = None
) -> list[PromptRecord]:
    """The records of a reasoning-gym data set object (its first ``limit`` entries), as
    :func:`gym_records` makes them, with ``label`` as their source."""
    n = len(data) if limit is None else min(len(data), limit)
    return [_record(entry, label, i) for i, entry in enumerate(_entries(data, n, label))]


def _entries(data: Any, n: int, label: str) -> list[dict]:
    # By index, not by iteration: a ProceduralDataset is its own (shared) iterator.
    entries = [data[i] for i in range(n)]
    if entries:
        try:
            pickle.dumps(entries[0])  # the reward workers receive it
        except Exception as e:  # noqa: BLE001 - any pickling failure
            raise ValueError(f"{label}: entry 0 does not pickle ({_first_line(e)})") from None
    return entries


def _record(entry: Any, source: str, row: int) -> PromptRecord:
    if not isinstance(entry, Mapping) or not isinstance(entry.get("question"), str):
        raise ValueError(f"{source}: entry {row} is not a reasoning_gym entry with a 'question'")
    metadata = entry.get("metadata")
    if not isinstance(metadata, Mapping) or "source_dataset" not in metadata:
        raise ValueError(f"{source}: entry {row} has no metadata.source_dataset (its task)")
    answer = entry.get("answer")
    return PromptRecord(
        prompt=entry["question"],
        answer=None if answer is None else str(answer),
        source=source,
        row=row,
        extra={GYM_ENTRY: dict(entry)},
    )
