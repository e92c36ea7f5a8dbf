"""Run metrics: ``metrics.jsonl`` (one object per step), TensorBoard, optional W&B.

Only the writing process (``jax.process_index() == 0``) creates a :class:`MetricsLog` with
``enabled=True``; the others get a silent one, so call sites need no rank checks.

Every JSONL line is flushed and fsync'ed as it is written: a crash or ``kill -9`` loses no step
that finished. On resume from a checkpoint at step ``s``, lines of steps ``> s`` (written after
that checkpoint, and about to be recomputed identically) are dropped, so the file never holds a
step twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from delta_jax import extras

log = logging.getLogger(__name__)


def _plain(value: Any) -> Any:
    """JSON-safe scalar: numpy/jax scalars to Python, non-finite floats to None."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read a ``metrics.jsonl`` file (a torn last line from a crash is ignored)."""
    rows = []
    path = Path(path)
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class MetricsLog:
    """Append-only per-step metrics with TensorBoard and W&B mirrors."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool = True,
        tensorboard: bool = True,
        wandb: bool = False,
        resume_step: int | None = None,
        config: dict[str, Any] | None = None,
    ):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        self._file = open(self.path, "a")  # noqa: SIM115 — lives as long as the run
        if tensorboard:  # lazy: tensorboardX (and protobuf) only for a run that writes events
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if wandb:
            wandb_lib = extras.require("wandb", "run.wandb=true")
            self._wandb = wandb_lib.init(
                dir=str(run_dir), config=config, resume="allow", name=Path(run_dir).name
            )

    def _truncate_after(self, step: int | None) -> None:
        if not self.path.exists():
            return
        rows = read_metrics(self.path)
        keep = rows if step is None else [r for r in rows if r.get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Write one step's metrics; returns the JSON-safe row."""
        row = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        if not self.enabled:
            return row
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        for key, value in row.items():
            if key != "step" and isinstance(value, int | float):
                if self._tb is not None:
                    self._tb.add_scalar(key, value, step)
        if self._tb is not None:
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        return row

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
