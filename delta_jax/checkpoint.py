"""Orbax checkpoints of a run: train state plus the host-side state needed for an exact resume.

A checkpoint at step ``s`` holds two items:

* ``state`` — the :class:`~delta_jax.rl.train_step.TrainState` pytree (parameters, optimiser
  state, update counter), saved asynchronously with Orbax's standard (tensorstore) format, so
  multi-host and sharded arrays save and restore in place;
* ``host`` — a JSON document: the data iterator's state, the RNG seed material, the RL step and
  the best metric so far.

Retention is "keep the last N plus the best by a metric" (an Orbax preservation policy). Orbax
commits a step atomically (temporary directory, then rename), so a process killed in the middle
of a save leaves the previous step intact; :meth:`Checkpointer.latest_step` only sees finished
ones.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as pp


class Checkpointer:
    """Save and restore run checkpoints under ``directory``.

    Args:
      directory: where step folders go (``<run_dir>/checkpoints``).
      keep_last: number of most recent checkpoints kept.
      best_metric: metric name whose best checkpoint is kept as well (None: none).
      best_mode: ``"max"`` or ``"min"``.
      async_save: write in a background thread while training continues.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        keep_last: int = 2,
        best_metric: str | None = None,
        best_mode: str = "max",
        async_save: bool = True,
    ):
        self.directory = Path(directory).absolute()
        self.best_metric = best_metric
        policies: list[pp.PreservationPolicy] = [pp.LatestN(n=keep_last)]
        if best_metric:
            sign = 1.0 if best_mode == "max" else -1.0

            def metric_of(metrics: dict[str, float]) -> float:
                value = metrics.get(best_metric, math.nan)
                return sign * value if math.isfinite(value) else -math.inf

            policies.append(pp.BestN(get_metric_fn=metric_of, n=1))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=pp.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, item_names=("state", "host"), options=options
        )

    def latest_step(self) -> int | None:
        """The newest fully written step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(
        self,
        step: int,
        state: Any,
        host: dict[str, Any],
        metrics: dict[str, float] | None = None,
    ) -> None:
        """Start saving ``state`` and the JSON ``host`` document as ``step`` (asynchronous)."""
        metrics = {k: float(v) for k, v in (metrics or {}).items()}
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), host=ocp.args.JsonSave(host)
            ),
            metrics=metrics,
            force=True,
        )

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """Restore ``step`` into the structure, shapes and shardings of ``abstract_state``."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), host=ocp.args.JsonRestore()
            ),
        )
        return restored["state"], restored["host"]

    def wait(self) -> None:
        """Block until pending asynchronous saves are committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
