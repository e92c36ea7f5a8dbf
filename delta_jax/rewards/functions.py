"""Several reward functions with weights: the reward of a response is their weighted sum.

Each function is a built-in kind (``"math"``, ``"code"``, ``"format"``, ``"reasoning_gym"``), a
``"package.module:function"`` path (both scored per item), or a Python callable in the batched
convention of TRL and Tunix, ``fn(prompts, completions, **columns) -> list[float | None]``.
Each runs in its own :class:`~delta_jax.rewards.RewardScorer` (a worker pool, or this process
for callables that cannot reach one), so a hang or crash in one function costs only its own
items: they score 0 with a reason (``"timeout"``, ``"error:<Type>"``, ...) counted by
``"<name>:<reason>"`` when there are several functions, and the first failure of each reason is
logged once under the function's name. The result keeps every function's rewards by name, which
the trainer logs as ``reward/<name>``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from delta_jax.rewards.batch import RewardBatch, RewardScorer

RewardLike = str | Callable[..., Any]


def reward_name(fn: RewardLike) -> str:
    """A metric-friendly name: the kind, the path's function name, or the callable's name."""
    if isinstance(fn, str):
        raw = fn.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
    else:
        raw = getattr(fn, "__name__", None) or type(fn).__name__
    return re.sub(r"[^A-Za-z0-9_]+", "", raw) or "reward"


class RewardSet:
    """Named reward functions with weights, scored together.

    Args:
      fns: one or more reward functions (module docstring).
      weights: one float per function (default 1 each).
      num_workers: worker processes per function's pool (0: serial, in this process).
      timeout_s: deadline per item, or per group call for a batched function.
      columns: data columns every call passes as keywords (the trainer: ``answer``, ``tests``):
        a batched function that cannot take them is refused now (one-line ``ValueError``).

    Examples:
      >>> def brevity(prompts, completions, **columns):  # doctest: +SKIP
      ...     return [1.0 / (1 + len(c)) for c in completions]
      >>> with RewardSet(["math", brevity], weights=[1.0, 0.1]) as rewards:  # doctest: +SKIP
      ...     batch = rewards.score(["1+1?"], [r"\\boxed{2}"], [{"answer": "2"}])
      >>> batch.components["brevity"]  # doctest: +SKIP
    """

    def __init__(
        self,
        fns: RewardLike | Sequence[RewardLike],
        weights: Sequence[float] | None = None,
        *,
        num_workers: int | None = 2,
        timeout_s: float = 10.0,
        columns: Sequence[str] = (),
    ):
        fns = [fns] if isinstance(fns, str) or callable(fns) else list(fns)
        if not fns:
            raise ValueError("reward_fns must name at least one reward function")
        for fn in fns:
            if not (isinstance(fn, str) or callable(fn)):
                raise ValueError(
                    f"a reward function must be a kind, a 'module:function' path or a callable, "
                    f"got {fn!r}"
                )
        weights = [1.0] * len(fns) if weights is None else [float(w) for w in weights]
        if len(weights) != len(fns):
            raise ValueError(f"{len(weights)} reward_weights for {len(fns)} reward functions")
        if not all(np.isfinite(weights)):
            raise ValueError(f"reward_weights must be finite, got {weights}")
        self.names = _unique([reward_name(fn) for fn in fns])
        self.weights = weights
        self.scorers: list[RewardScorer] = []
        try:
            for fn, name in zip(fns, self.names, strict=True):
                self.scorers.append(
                    RewardScorer(
                        fn,
                        num_workers=num_workers,
                        timeout_s=timeout_s,
                        batched=callable(fn),
                        name=name,
                        columns=columns,
                    )
                )
        except BaseException:
            self.close()
            raise

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        items: Sequence[Mapping[str, Any]],
        *,
        group_size: int = 1,
    ) -> RewardBatch:
        """The weighted sum of every function's rewards; counts by ``"<name>:<reason>"``."""
        return self.submit(prompts, responses, items, group_size=group_size).result()

    def submit(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        items: Sequence[Mapping[str, Any]],
        *,
        group_size: int = 1,
    ) -> PendingRewards:
        """Starts scoring in the background (:meth:`RewardScorer.submit`); ``.result()`` waits."""
        futures = [s.submit(prompts, responses, items, group_size=group_size) for s in self.scorers]
        return PendingRewards(self, futures)

    def unit(self, group_size: int) -> int:
        """The smallest submission: a group (``group_size``) if any function is batched, else 1."""
        return max(s.unit(group_size) for s in self.scorers)

    def finish(self, batch: RewardBatch, prompts, responses) -> RewardBatch:
        """What the scorer does to a whole batch once all of it is scored: nothing here."""
        return batch

    def combine(self, batches: Sequence[RewardBatch]) -> RewardBatch:
        """One batch from every function's (same items, in :attr:`names` order)."""
        weighted = sum(w * b.rewards for w, b in zip(self.weights, batches, strict=True))
        total = np.asarray(weighted, np.float32)
        components = {name: b.rewards for name, b in zip(self.names, batches, strict=True)}
        if len(batches) == 1:
            return RewardBatch(total, batches[0].reasons, batches[0].counts, components)
        reasons = [";".join(r) for r in zip(*(b.reasons for b in batches), strict=True)]
        counts = {
            f"{n}:{k}": v
            for n, b in zip(self.names, batches, strict=True)
            for k, v in b.counts.items()
        }
        return RewardBatch(total, reasons, counts, components)

    def close(self) -> None:
        for scorer in self.scorers:
            scorer.close()

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PendingRewards:
    """Rewards being scored: :meth:`result` waits for every function's and combines them."""

    def __init__(self, rewards: RewardSet, futures: list):
        self.rewards, self.futures = rewards, futures

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self, timeout: float | None = None) -> RewardBatch:
        return self.rewards.combine([f.result(timeout) for f in self.futures])


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out
