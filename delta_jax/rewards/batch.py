"""Batch scoring of a rollout batch in a process pool with per-item deadlines.

:class:`RewardScorer` owns ``num_workers`` worker processes (``spawn``: the trainer's threads
make ``fork`` unsafe), each with its own pipe: a :class:`~delta_jax.rewards.pool.WorkerPool`,
which starts, watches and replaces them. Items go one at a time to idle workers; the parent
keeps a wall-clock deadline for each item and

* kills a worker past its deadline (SIGKILL: a verifier stuck in C code ignores signals) and
  starts a replacement; the item gets reward 0, reason ``"timeout"`` (a code sandbox the worker
  was running dies with it, and its temp dir is removed);
* notices a worker that dies (``os._exit``, a segfault, the OOM killer); the item gets reward 0,
  reason ``"worker_died"``, and a replacement is started;
* gets reward 0, reason ``"error:<ExceptionType>"``, back from a worker whose reward function
  raised or returned what is not a reward (``"error:TypeError"`` for a non-number,
  ``"error:ValueError"`` for NaN or infinity, ``"error:OverflowError"`` for an integer too
  large for a float).

So one bad item never takes the run down nor blocks the pool. The first failure of each reason
is logged once, on one line: the function's name, the reason and its first cause (the
exception's message, what was returned, the deadline); later ones are only counted.

Reasons of successful scores come from the reward kind: ``"correct"`` / ``"wrong"`` /
``"no_answer"`` / ... for math (:func:`~delta_jax.rewards.math.score_math`),
:class:`~delta_jax.rewards.CodeResult` reasons and ``"no_code"`` for code,
:func:`~delta_jax.rewards.format.score_format` reasons for format, ``"correct"`` /
``"partial"`` / ``"wrong"`` (and ``"no_marker"`` / ``"no_working"`` with an answer marker) for
reasoning_gym (:func:`~delta_jax.rewards.gym.score_gym`),
``"ok"`` for a custom function.

Two calling conventions:

* **per item** (the built-in kinds and ``"package.module:function"`` paths):
  ``fn(prompt, response, item) -> float``, one task per item;
* **batched** (``batched=True``, the convention of TRL's ``GRPOTrainer`` and Tunix):
  ``fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]`` where
  ``columns`` are the rows' other fields as lists; one task per group of ``group_size`` items
  (a prompt's samples), whose deadline is ``timeout_s`` for the whole call. ``None`` means "does
  not apply": reward 0, reason ``"none"``; a wrong length (``"error:wrong_length"``) or a
  result that is not a list (a number, a string, a dict: ``"error:TypeError"``) is an error for
  the whole group, a non-finite or non-numeric value an error for its item.

A function that cannot take these arguments at all (too few positional parameters, no
``**columns`` for the columns every call passes) is refused when the scorer is built, with a
one-line ``ValueError`` naming it.

A callable that cannot reach a worker process (a lambda or closure, anything defined in
``__main__`` or a notebook cell, anything that does not pickle) runs in the calling process
instead, with the same deadline (a call past it is abandoned to its daemon thread and scored
``"timeout"``: Python cannot stop a thread, so the call may go on running, and holding what it
holds, until it returns) and the same error handling, but no crash isolation; a warning says so
once.

``num_workers=0`` scores serially in the calling process: no deadline and no crash isolation
(for debugging, and as the baseline of ``benchmarks/reward_throughput.py``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from delta_jax.rewards.custom import check_call, load_reward_fn
from delta_jax.rewards.gym import GYM_ENTRY
from delta_jax.rewards.pool import STARTUP_TIMEOUT_S, WorkerPool
from delta_jax.rewards.units import (
    Scored,
    call_with_deadline,
    failed,
    make_unit_fn,
    runs_in_process,
)

_BUILTIN = ("math", "code", "format", "reasoning_gym")
_REQUIRED_FIELD = {"math": "answer", "code": "tests", "reasoning_gym": GYM_ENTRY}
_CODE_GRACE_S = 10.0  # Pool deadline past run_code's own timeout: sandbox start and clean-up.

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RewardBatch:
    """Rewards of a batch.

    Attributes:
      rewards: float32 ``[N]``, 0 wherever scoring failed.
      reasons: one reason string per item (``"correct"``, ``"timeout"``, ...).
      counts: number of items per reason.
      components: each reward function's own rewards ``[N]`` by name, when several are summed
        (:class:`~delta_jax.rewards.RewardSet`).
    """

    rewards: np.ndarray
    reasons: list[str]
    counts: dict[str, int]
    components: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def concat_batches(batches: Sequence[RewardBatch]) -> RewardBatch:
    """One batch of the items of ``batches``, in order (counts summed, components joined)."""
    counts: collections.Counter = collections.Counter()
    for b in batches:
        counts.update(b.counts)
    names = batches[0].components if batches else {}
    return RewardBatch(
        np.concatenate([b.rewards for b in batches]).astype(np.float32),
        [r for b in batches for r in b.reasons],
        dict(counts),
        {k: np.concatenate([b.components[k] for b in batches]) for k in names},
    )


class _Job:
    """One submitted batch: its tasks, the rewards and reasons filled in as tasks finish."""

    def __init__(self, n: int):
        self.n, self.tasks = n, []
        self.rewards, self.reasons = np.zeros(n, np.float32), [""] * n
        self.causes: dict[str, str] = {}  # failure reason -> its first cause
        self.future: concurrent.futures.Future = concurrent.futures.Future()

    def finish(self, start: int, results: Sequence[Scored]) -> None:
        for j, (reward, reason, cause) in enumerate(results):
            self.rewards[start + j], self.reasons[start + j] = reward, reason
            if cause:
                self.causes.setdefault(reason, cause)

    def batch(self) -> RewardBatch:
        return RewardBatch(self.rewards, self.reasons, dict(collections.Counter(self.reasons)))


class RewardScorer:
    """Scores whole rollout batches in parallel, with per-item timeouts and crash isolation.

    Args:
      kind: ``"math"`` (items need ``"answer"``), ``"code"`` (items need ``"tests"``; the code
        is the response's last fenced block), ``"format"``, ``"reasoning_gym"`` (items need
        ``"gym_entry"``, a reasoning-gym entry: :mod:`delta_jax.rewards.gym`), a
        ``"package.module:function"`` path, or a callable: ``(prompt, response, item) -> float``,
        or with ``batched=True`` ``(prompts, completions, **columns) -> list[float | None]``
        (module docstring).
      num_workers: worker processes; None for one per CPU, 0 for serial in-process scoring
        (no timeout, no crash isolation).
      timeout_s: wall-clock seconds per item (per group call when batched). For ``"code"`` it
        is run_code's budget, and the pool deadline adds a grace for the sandbox's start and
        clean-up.
      format_pattern: regular expression for ``"format"`` (see
        :func:`~delta_jax.rewards.format.score_format`).
      code_kwargs: extra keyword arguments of :func:`~delta_jax.rewards.run_code`
        (``memory_mb``, ``max_procs``, ...).
      batched: ``kind`` is a batched callable.
      name: the function's name in log lines (default: the kind, or the callable's name).
      columns: data columns every batched call passes (checked against the signature now).

    Raises:
      ValueError: (one line) an unknown kind, a path that does not import, a function that
        cannot take the scorer's arguments, a bad number.

    Examples:
      >>> with RewardScorer("math", num_workers=2) as scorer:  # doctest: +SKIP
      ...     batch = scorer.score(["1+1?"], [r"\\boxed{2}"], [{"answer": "2"}])
      >>> batch.rewards, batch.counts  # doctest: +SKIP
      (array([1.], dtype=float32), {'correct': 1})
    """

    def __init__(
        self,
        kind: str | Callable[..., Any] = "math",
        *,
        num_workers: int | None = None,
        timeout_s: float = 10.0,
        format_pattern: str | None = None,
        code_kwargs: Mapping[str, Any] | None = None,
        batched: bool = False,
        name: str | None = None,
        columns: Sequence[str] = (),
    ):
        if not isinstance(kind, str) and not callable(kind):
            raise ValueError(f"kind must be one of {_BUILTIN}, 'module:function' or a callable")
        if batched and not callable(kind):
            raise ValueError(f"batched=True needs a callable, got {kind!r}")
        self.name = name or (
            kind if isinstance(kind, str) else getattr(kind, "__name__", type(kind).__name__)
        )
        # A wrong path or a function that cannot take the arguments is a configuration error:
        # raise it now, not at the first batch.
        if isinstance(kind, str) and kind not in _BUILTIN:
            check_call(load_reward_fn(kind), self.name, batched=False)
        elif callable(kind):
            check_call(kind, self.name, batched=batched, columns=columns)
        if num_workers is None:
            num_workers = len(os.sched_getaffinity(0))
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        code_kwargs = dict(code_kwargs or {})
        if kind == "code":
            code_kwargs.setdefault("timeout_s", timeout_s)
        self.kind = kind
        self.batched = batched
        self.num_workers = num_workers
        self.deadline_s = timeout_s + (_CODE_GRACE_S if kind == "code" else 0.0)
        self._options = {"pattern": format_pattern, "code_kwargs": code_kwargs, "batched": batched}
        self._pool = WorkerPool(kind, self._options, self.deadline_s)
        self._closed = False
        self._jobs: list[_Job] = []
        self._reported: set[str] = set()
        self._report_lock = threading.Lock()
        self._wakeup = threading.Condition()
        # One byte per submission wakes the pool loop, which waits on the workers' pipes too.
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._dispatcher: threading.Thread | None = None
        self._unit_fn = make_unit_fn(kind, self._options)
        # In this process: serial (num_workers=0), or with deadlines when the callable cannot
        # reach a worker.
        self.in_process = num_workers == 0 or runs_in_process(kind)
        if num_workers and self.in_process:
            name = getattr(kind, "__qualname__", repr(kind))
            log.warning(
                "reward function %s cannot run in the reward pool (defined in __main__ or a "
                "notebook, or not picklable): it runs in the trainer's process, with the same "
                "%.3g s deadline and error handling but no crash isolation",
                name,
                self.deadline_s,
            )
        if not self.in_process:
            self._pool.start(num_workers)

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        items: Sequence[Mapping[str, Any]],
        *,
        group_size: int = 1,
    ) -> RewardBatch:
        """Scores a batch; never raises for what a response or reward function does.

        Args:
          prompts: ``[N]`` prompt texts.
          responses: ``[N]`` response texts.
          items: ``[N]`` data set rows (with ``"answer"`` for math, ``"tests"`` for code,
            ``"gym_entry"`` for reasoning_gym).
          group_size: items per call of a batched function (a prompt's samples); must divide N.

        Returns:
          A :class:`RewardBatch` with float32 ``rewards [N]``, ``reasons`` and ``counts``.
        """
        return self.submit(prompts, responses, items, group_size=group_size).result()

    def submit(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        items: Sequence[Mapping[str, Any]],
        *,
        group_size: int = 1,
    ) -> concurrent.futures.Future:
        """Starts scoring a batch (e.g. one prompt's samples, while others are still sampled).

        Submissions are scored in the background, all that are waiting together (so a batched
        function's groups still spread over the workers); :meth:`score` is ``submit(...)
        .result()``. Arguments as for :meth:`score`; validation errors raise here.

        Returns:
          A future of the :class:`RewardBatch`.
        """
        n = len(responses)
        if len(prompts) != n or len(items) != n:
            raise ValueError(
                f"prompts, responses and items must have the same length, got {len(prompts)}, "
                f"{n} and {len(items)}"
            )
        field = _REQUIRED_FIELD.get(self.kind) if isinstance(self.kind, str) else None
        for i, item in enumerate(items):
            if not isinstance(item, Mapping) or (field is not None and field not in item):
                raise ValueError(f"items[{i}] must be a mapping with key {field!r}, got {item!r}")
        unit = group_size if self.batched else 1
        if unit < 1 or n % unit:
            raise ValueError(f"group_size={group_size} must be >= 1 and divide the batch ({n})")
        if self._closed:
            raise RuntimeError("RewardScorer is closed")
        job = _Job(n)
        units = [slice(s, s + unit) for s in range(0, n, unit)]
        job.tasks = [
            (u.start, list(prompts[u]), list(responses[u]), [dict(x) for x in items[u]])
            for u in units
        ]
        if self.num_workers == 0:  # serial: here and now
            for start, *args in job.tasks:
                job.finish(start, self._unit_fn(*args))
            self._done(job)
            return job.future
        with self._wakeup:
            self._jobs.append(job)
            self._wake_w.send_bytes(b"")
            if self._dispatcher is None:
                self._dispatcher = threading.Thread(target=self._dispatch, daemon=True)
                self._dispatcher.start()
            self._wakeup.notify()
        return job.future

    def unit(self, group_size: int) -> int:
        """The smallest submission: a batched function's group (``group_size`` items), else 1."""
        return group_size if self.batched else 1

    def finish(self, batch: RewardBatch, prompts, responses) -> RewardBatch:
        """What the scorer does to a whole batch once all of it is scored: nothing here."""
        return batch

    def _done(self, job: _Job) -> None:
        """Logs the job's new kinds of failure (once per scorer), then hands its batch over."""
        with self._report_lock:
            new = {k: v for k, v in job.causes.items() if k not in self._reported}
            self._reported.update(new)
        for reason, cause in new.items():
            log.warning(
                "reward function %s: %s: %s (its samples score 0, counted in reward_reason/; "
                "the step goes on, and further failures like it are not logged)",
                self.name,
                reason,
                cause,
            )
        job.future.set_result(job.batch())

    def _take_jobs(self, block: bool) -> list[_Job] | None:
        """The jobs submitted since the last take (``block``: waits for one); None once closed."""
        with self._wakeup:
            while block and not self._jobs and not self._closed:
                self._wakeup.wait()
            while self._wake_r.poll():  # one byte per job taken here (sent under this lock)
                self._wake_r.recv_bytes()
            if self._closed:
                return None
            jobs, self._jobs = self._jobs, []
            return jobs

    def _dispatch(self) -> None:
        """The background thread: scores jobs as they come, until the scorer closes."""
        while (jobs := self._take_jobs(block=True)) is not None:
            if self.in_process:
                for job in jobs:
                    self._run_in_process(job)
            else:
                self._run_pool(jobs)

    def _run_in_process(self, job: _Job) -> None:
        timeout = (
            f"did not return within its {self.deadline_s:g} s deadline (reward.timeout_s); the "
            "call was abandoned to its thread, which may run on until it returns"
        )
        try:
            for start, *args in job.tasks:
                done, results = call_with_deadline(
                    lambda args=args: self._unit_fn(*args), self.deadline_s
                )
                if not done:
                    results = [(0.0, "timeout", timeout)] * len(args[0])
                elif isinstance(results, BaseException):  # past the unit's own handlers
                    results = [failed(results)] * len(args[0])
                job.finish(start, results)
        except BaseException as e:  # noqa: BLE001 - a broken scorer fails its job, loudly
            job.future.set_exception(e)
            return
        self._done(job)

    def _run_pool(self, jobs: list[_Job]) -> None:
        """Scores ``jobs`` and every job submitted while they run, in one stream of tasks over
        the workers: a job's items start as soon as a worker is free, not after the jobs before
        it, and each job's future is set as soon as its own items are scored."""
        todo: collections.deque = collections.deque()
        owner: dict[int, tuple[_Job, int, int]] = {}  # task id -> (job, start, items)
        left: dict[_Job, int] = {}  # tasks still to score, per job
        ids = itertools.count()

        def add(new: list[_Job]) -> None:
            for job in new:
                if not job.tasks:  # an empty batch
                    self._done(job)
                    continue
                left[job] = len(job.tasks)
                for start, *args in job.tasks:
                    tid = next(ids)
                    owner[tid] = (job, start, len(args[0]))
                    todo.append((tid, *args))

        def finish(tid: int, results: Sequence) -> None:
            job, start, _ = owner.pop(tid)
            job.finish(start, results)
            left[job] -= 1
            if not left[job]:
                del left[job]
                self._done(job)

        def fail(tid: int, reason: str, cause: str) -> None:
            finish(tid, [(0.0, reason, cause)] * owner[tid][2])

        add(jobs)
        try:
            while todo or self._pool.busy():
                self._pool.round(todo, finish, fail, wake=self._wake_r)
                if self._wake_r.poll():  # jobs submitted meanwhile join the stream
                    add(self._take_jobs(block=False) or [])
        except BaseException as e:  # noqa: BLE001 - a broken pool fails its jobs, loudly
            for job in left:
                job.future.set_exception(e)

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Blocks until every worker has started (imports done), e.g. before timing a batch."""
        self._pool.wait_ready(timeout_s)

    def close(self) -> None:
        """Shuts the workers down (idempotent); jobs still waiting are cancelled."""
        with self._wakeup:
            self._closed = True
            for job in self._jobs:
                job.future.cancel()
            self._jobs = []
            self._wakeup.notify()
        if self._dispatcher is not None and self._dispatcher is not threading.current_thread():
            self._dispatcher.join(timeout=max(5.0, self.deadline_s + 5.0))
        self._pool.close()
        if self._dispatcher is None or not self._dispatcher.is_alive():
            self._wake_r.close()
            self._wake_w.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_pool", None) and self._pool.workers:
            self.close()
