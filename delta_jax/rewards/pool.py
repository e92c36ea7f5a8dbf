"""The reward worker processes of a :class:`~delta_jax.rewards.RewardScorer` and their lifecycle.

A :class:`WorkerPool` starts its workers (``spawn``: the trainer's threads make ``fork``
unsafe; the parent's main program left out, so a script without a ``__main__`` guard does not
start again in each worker), each with its own pipe running
:func:`~delta_jax.rewards.units.worker_main`. Each round (:meth:`WorkerPool.round`) gives idle
workers the next tasks, one at a time, keeps a wall-clock deadline for each and

* kills a worker past its deadline (SIGKILL: a verifier stuck in C code ignores signals),
  removes the code sandboxes it was running and starts a replacement;
* notices a worker that dies (``os._exit``, a segfault, the OOM killer) and replaces it;
* replaces a worker that does not become ready within :data:`STARTUP_TIMEOUT_S`, and gives up
  (``RuntimeError``) when workers keep dying before they are ready.

What a task is, and which job its results belong to, is the scorer's business
(:mod:`delta_jax.rewards.batch`): the pool hands each result, or each failure with its reason
and cause, back by task id.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import multiprocessing as mp
import multiprocessing.connection
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from delta_jax.rewards.code import cleanup_sandboxes_of
from delta_jax.rewards.custom import error_line
from delta_jax.rewards.units import worker_main

STARTUP_TIMEOUT_S = 120.0
_MAX_STARTUP_FAILURES = 3


@dataclasses.dataclass
class _Worker:
    process: Any
    conn: Any
    started: float
    ready: bool = False
    task: int | None = None
    deadline: float = math.inf


@contextlib.contextmanager
def _main_program_left_out():
    """A spawned process runs the parent's main program first (as ``__mp_main__``), unless it
    has neither a file nor a module spec: a user's script without an ``if __name__ ==
    "__main__":`` guard would start its trainer again in every reward worker, which then never
    becomes ready. The workers need nothing from it (functions of ``__main__`` run in this
    process, :func:`~delta_jax.rewards.units.runs_in_process`), so it is hidden while one
    starts."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class WorkerPool:
    """Worker processes that score tasks for one reward kind, each task within ``deadline_s``.

    Args:
      kind: the reward kind or callable the workers load (:func:`~delta_jax.rewards.units.
        worker_main`).
      options: the scorer's options for the workers' unit function.
      deadline_s: wall-clock seconds a worker may spend on one task.
    """

    def __init__(
        self, kind: str | Callable[..., Any], options: Mapping[str, Any], deadline_s: float
    ):
        self.kind, self.options, self.deadline_s = kind, options, deadline_s
        self.workers: list[_Worker] = []
        self._startup_failures = 0
        self._ctx = mp.get_context("spawn")

    def start(self, num_workers: int) -> None:
        """Starts ``num_workers`` workers (they become ready in the background)."""
        self.workers = [self._spawn() for _ in range(num_workers)]

    def busy(self) -> bool:
        """Whether a worker is scoring a task."""
        return any(w.task is not None for w in self.workers)

    def _spawn(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=worker_main, args=(child_conn, self.kind, self.options), daemon=True
        )
        with _main_program_left_out():
            process.start()
        child_conn.close()
        return _Worker(process, parent_conn, time.monotonic())

    def _replace(self, worker: _Worker) -> None:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join()
        worker.conn.close()
        cleanup_sandboxes_of(worker.process.pid)
        if not worker.ready:
            self._startup_failures += 1
            if self._startup_failures > _MAX_STARTUP_FAILURES:
                raise RuntimeError(
                    f"reward workers for kind {self.kind!r} keep dying before they are ready "
                    f"(last exit code {worker.process.exitcode})"
                )
        self.workers[self.workers.index(worker)] = self._spawn()

    def round(
        self,
        todo: collections.deque,
        finish: Callable[..., None],
        fail: Callable[[int, str, str], None],
        wake: Any,
    ) -> None:
        """Gives idle workers the next tasks, then waits for a result, a dead worker, a deadline
        or ``wake`` (a connection: a new submission), and handles what came.

        Args:
          todo: tasks ``(task id, prompts, responses, items)`` still to send; taken from the left.
          finish: called as ``finish(task id, results)`` with a task's results.
          fail: called as ``fail(task id, reason, cause)`` for a task that could not be scored.
          wake: a connection whose readiness ends the wait (it is not read here).
        """
        for worker in list(self.workers):
            if worker.ready and worker.task is None and todo:
                task = todo.popleft()
                try:
                    worker.conn.send(task)
                except (BrokenPipeError, OSError):
                    todo.appendleft(task)  # Not this item's fault: the worker was gone.
                    self._replace(worker)
                    continue
                except Exception as e:  # noqa: BLE001 - pickling runs before a byte is sent
                    cause = f"its rows cannot be sent to a reward worker: {error_line(e)}"
                    fail(task[0], "error:unpicklable_row", cause)
                    continue
                worker.task, worker.deadline = task[0], time.monotonic() + self.deadline_s
        if not todo and not self.busy():
            return  # every task failed to send: nothing to wait for
        now = time.monotonic()
        due = min(w.deadline if w.ready else w.started + STARTUP_TIMEOUT_S for w in self.workers)
        waitables = [w.conn for w in self.workers] + [w.process.sentinel for w in self.workers]
        timeout = None if math.isinf(due) else max(0.0, due - now)
        ready = set(mp.connection.wait([*waitables, wake], timeout=timeout))
        for worker in list(self.workers):
            if worker.conn in ready:
                try:
                    msg = worker.conn.recv()
                except (EOFError, OSError):
                    msg = None
                if msg is None:
                    if worker.task is not None:
                        fail(worker.task, "worker_died", self._died(worker))
                    self._replace(worker)
                elif msg[0] == "ready":
                    worker.ready, self._startup_failures = True, 0
                elif msg[0] == "init_error":
                    raise RuntimeError(f"reward worker failed to start: {msg[1]}")
                else:
                    finish(*msg)
                    worker.task, worker.deadline = None, math.inf
            elif worker.process.sentinel in ready:
                if worker.task is not None:
                    fail(worker.task, "worker_died", self._died(worker))
                self._replace(worker)
        now = time.monotonic()
        for worker in list(self.workers):
            if worker.task is not None and now > worker.deadline:
                cause = (
                    f"did not return within its {self.deadline_s:g} s deadline "
                    "(reward.timeout_s); its worker process was killed and replaced"
                )
                fail(worker.task, "timeout", cause)
                worker.ready = True  # A hang while scoring is not a start-up failure.
                self._replace(worker)
            elif not worker.ready and now > worker.started + STARTUP_TIMEOUT_S:
                self._replace(worker)

    @staticmethod
    def _died(worker: _Worker) -> str:
        worker.process.join(timeout=1.0)  # its exit code, once the process is reaped
        code = worker.process.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"its worker process died ({how}: os._exit, a crash, the OOM killer)"

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Blocks until every worker has started (imports done)."""
        end = time.monotonic() + timeout_s
        for worker in self.workers:
            if worker.ready:
                continue
            if not worker.conn.poll(max(0.0, end - time.monotonic())):
                raise RuntimeError(f"reward worker not ready after {timeout_s} s")
            msg = worker.conn.recv()
            if msg[0] != "ready":
                raise RuntimeError(f"reward worker failed to start: {msg[1]}")
            worker.ready = True

    def close(self) -> None:
        """Asks idle workers to exit, kills those still starting or stuck, and waits for all."""
        for worker in self.workers:
            if not worker.ready or worker.task is not None:
                worker.process.kill()  # Still starting, or stuck: nothing to wait for.
                continue
            try:
                worker.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for worker in self.workers:
            worker.process.join(timeout=5.0)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
        self.workers = []
