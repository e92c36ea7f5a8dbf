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

Damage after the commit (a truncated or deleted file: a full disk, a bad copy, a half-synced
bucket) is caught on resume by :meth:`Checkpointer.restore_latest`: each committed step gets an
integrity record, ``integrity.json`` (the size of every file of the step), written once the
step is committed; a step whose files do not match it, or whose restore fails, is skipped for
the next older one, with a warning, and moved aside to ``<directory>_damaged/``; if no step is
intact the resume stops with a :class:`CheckpointError`. The record holds sizes only (hashing
a large checkpoint would cost minutes per save); a step without a record (the process died
between the commit and the record) is checked by its restore alone.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as pp

log = logging.getLogger(__name__)
RECORD = "integrity.json"


class CheckpointError(ValueError):
    """No intact checkpoint to resume from, in one line (the CLI prints it as ``error:``)."""


def _file_sizes(step_dir: Path) -> dict[str, int]:
    return {
        str(f.relative_to(step_dir)): f.stat().st_size
        for f in sorted(step_dir.rglob("*"))
        if f.is_file() and f.name != RECORD
    }


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

    def _step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def _record_committed(self) -> None:
        """Write the integrity record of every committed step that has none (process 0; call
        with no save in flight)."""
        if jax.process_index() != 0:
            return
        for step in self._manager.all_steps():
            record = self._step_dir(step) / RECORD
            if not record.exists():
                tmp = record.with_suffix(".tmp")
                tmp.write_text(json.dumps(_file_sizes(self._step_dir(step))))
                tmp.rename(record)

    def damage(self, step: int) -> str | None:
        """What is wrong with the files of ``step`` against its integrity record (None: they
        match, or there is no record)."""
        step_dir = self._step_dir(step)
        try:
            expected = json.loads((step_dir / RECORD).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return f"unreadable {RECORD}"
        found = _file_sizes(step_dir)
        for name, size in expected.items():
            if name not in found:
                return f"missing file {name}"
            if found[name] != size:
                return f"{name} has {found[name]} bytes, {size} when saved"
        return None

    def restore_latest(self, state: Any) -> tuple[int, Any, dict[str, Any] | None]:
        """Restore the newest intact checkpoint into the structure of ``state``.

        Newer damaged steps (files not matching their integrity record, or a failing restore)
        are logged as warnings, named by step and file, and moved aside to
        ``<directory>_damaged/<step>`` so that the resumed run can save those steps again. When
        none is intact nothing is moved: a second attempt fails the same way instead of
        starting from scratch.

        Returns:
          ``(0, state, None)`` when there is no checkpoint at all, else ``(step, restored
          state, host document)`` of the newest intact step.

        Raises:
          CheckpointError: there are checkpoints, but none is intact.
        """
        damaged: list[tuple[int, str]] = []
        for step in sorted(self._manager.all_steps(), reverse=True):
            problem = self.damage(step)
            if problem is None:
                try:
                    restored, host = self.restore(step, state)
                except Exception as e:  # Orbax / TensorStore raise plain Exception
                    problem = f"restore failed: {str(e).splitlines()[0][:200]}"
            if problem is None:
                for bad, why in damaged:
                    log.warning(
                        "checkpoint %s is damaged (%s): resuming from step %d instead; "
                        "the damaged step is moved to %s",
                        self._step_dir(bad),
                        why,
                        step,
                        self._move_aside(bad),
                    )
                return step, restored, host
            damaged.append((step, problem))
        if damaged:
            listed = "; ".join(f"step {step}: {why}" for step, why in damaged)
            raise CheckpointError(
                f"{self.directory}: no intact checkpoint to resume from ({listed})"
            )
        return 0, state, None

    def _move_aside(self, step: int) -> Path:
        target = self.directory.with_name(self.directory.name + "_damaged") / str(step)
        if jax.process_index() == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                shutil.rmtree(target)
            self._step_dir(step).rename(target)
        self._manager.reload()
        return target

    def save(
        self,
        step: int,
        state: Any,
        host: dict[str, Any],
        metrics: dict[str, float] | None = None,
    ) -> None:
        """Start saving ``state`` and the JSON ``host`` document as ``step`` (asynchronous)."""
        metrics = {k: float(v) for k, v in (metrics or {}).items()}
        # The previous save has committed once this returns (Orbax saves one step at a time).
        self._manager.wait_until_finished()
        self._record_committed()
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
        """Block until pending asynchronous saves are committed (and recorded)."""
        self._manager.wait_until_finished()
        self._record_committed()

    def close(self) -> None:
        self.wait()
        self._manager.close()
