"""Orbax checkpoints of a run: train state plus the host-side state needed for an exact resume.

A checkpoint at step ``s`` holds two items:

* ``state`` — the :class:`~delta_jax.rl.train_step.TrainState` pytree (parameters, optimiser
  state, update counter), saved asynchronously with Orbax's standard (tensorstore, OCDBT)
  format, so multi-host and sharded arrays save and restore in place;
* ``host`` — a JSON document: the data iterator's state, the RNG seed material, the RL step and
  the best metric so far.

Retention is "keep the last N plus the best by a metric" (an Orbax preservation policy). Orbax
commits a step atomically (temporary directory, then rename), so a process killed in the middle
of a save leaves the previous step intact; :meth:`Checkpointer.latest_step` only sees finished
ones, and the next training run deletes the unfinished temporary directory.

Damage after the commit (a truncated or deleted file: a full disk, a bad copy, a half-synced
bucket) is what an integrity check finds, before Orbax reads anything:

* each committed step gets an integrity record, ``integrity.json`` (the size of every file),
  written at the next save or at the end of the run; a file missing or of another size is
  damage. The record holds sizes only: hashing a large checkpoint would cost minutes per save;
* every step, recorded or not (the newest step of a killed run has no record yet), must have
  what a restore reads: Orbax's step metadata, the host document, the state's tree and array
  metadata, and its OCDBT manifest and B-tree nodes, every array chunk they point to lying
  within its data file.

:meth:`Checkpointer.restore_latest` skips damaged steps for the newest intact one, with one
warning line, and moves them aside to ``<directory>_damaged/`` (a read-only checkpointer, as
``export`` uses, leaves them in place); if no step is intact it stops with a
:class:`CheckpointError`. A step that passes the check but whose restore fails (a transient
read error) is retried a few times, then reported as a :class:`CheckpointError`, never moved.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint.checkpoint_managers import preservation_policy as pp

log = logging.getLogger(__name__)
RECORD = "integrity.json"
_RECORD_TMP = "integrity.tmp"  # written, then renamed to RECORD
RESTORE_TRIES = 3
# TensorStore status codes that mean the bytes on disk are wrong, not that reading them failed.
_DAMAGE_CODES = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "INVALID_ARGUMENT")


class CheckpointError(ValueError):
    """No intact checkpoint to resume from, in one line (the CLI prints it as ``error:``)."""


class _Damage(Exception):
    """A step's files are missing or malformed (the message says which)."""


def _test_kill(point: str, step: int) -> None:
    """Test hook: the kill tests set ``DELTA_JAX_TEST_KILL_AT=<point>:<step>`` to SIGKILL this
    process at a chosen moment of a save (``save``: started, not committed; ``record``:
    committed, its integrity record not yet written)."""
    if os.environ.get("DELTA_JAX_TEST_KILL_AT") == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def _file_sizes(step_dir: Path) -> dict[str, int]:
    return {
        str(f.relative_to(step_dir)): f.stat().st_size
        for f in sorted(step_dir.rglob("*"))
        if f.is_file() and f.name not in (RECORD, _RECORD_TMP)
    }


def _read_json(step_dir: Path, name: str, *, required: bool = True) -> Any:
    try:
        return json.loads((step_dir / name).read_bytes())
    except FileNotFoundError:
        if required:
            raise _Damage(f"missing file {name}") from None
        return None
    except ValueError:  # not JSON (truncated, overwritten)
        raise _Damage(f"unreadable {name}") from None


def _check_ocdbt(step_dir: Path, item: str) -> None:
    """The OCDBT database of ``item``: its manifest and B-tree nodes decode, and every node and
    array chunk they point to (``<kind>:<base>:<file>:<offset>:<length>``) lies in its file."""
    base = ts.KvStore.open({"driver": "file", "path": f"{step_dir / item}/"}).result()

    def dump(location: str | None, name: str) -> Any:
        try:
            return ts.ocdbt.dump(base, location).result()
        except ValueError as e:
            if str(e).startswith(_DAMAGE_CODES):  # "CODE: context: ...: what is wrong"
                parts = str(e).splitlines()[0].split(": ")
                raise _Damage(f"unreadable {name} ({parts[0]}: {parts[-1][:120]})") from None
            raise OSError(str(e)) from e  # a failed read, not bad bytes: retried by callers

    def locations(node: Any):
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            for child in node:
                yield from locations(child)
        elif isinstance(node, str) and node.startswith(("btreenode:", "value:")):
            yield node

    pending = [dump(None, f"{item}/manifest.ocdbt")]
    while pending:
        for location in locations(pending.pop()):
            kind, rest = location.split(":", 1)
            rest, offset, length = rest.rsplit(":", 2)
            name = f"{item}/" + "".join(rest.split(":", 1))
            try:
                size = (step_dir / name).stat().st_size
            except FileNotFoundError:
                raise _Damage(f"missing file {name}") from None
            if size < int(offset) + int(length):
                raise _Damage(f"{name} has {size} bytes, {int(offset) + int(length)} needed")
            if kind == "btreenode":
                pending.append(dump(location, name))


def _echo_of_failed_restore(u: Any) -> bool:
    """An unraisable error that only echoes a failed Orbax restore: one of its dropped
    coroutines, or a TensorStore read finishing after Orbax closed the loop awaiting it."""
    code = getattr(u.object, "cr_code", None)
    dropped = code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename
    closed = isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"
    return dropped or closed


_STATUS = re.compile(r"[A-Z][A-Z_]+: ")  # how TensorStore's errors begin: their status code


def _drop_task_echo(record: logging.LogRecord) -> bool:
    """False for asyncio's echo of one of a failed restore's dropped reads: an Orbax task, or a
    TensorStore read's future (no coroutine to name it: its error begins with a status code)."""
    message = record.getMessage()
    if message.startswith("Task exception was never retrieved"):
        return f"{os.sep}orbax{os.sep}" not in message
    if message.startswith("Future exception was never retrieved"):
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, ValueError) and _STATUS.match(str(error)))
    return True


@contextlib.contextmanager
def _quiet_orbax_failure():
    """Orbax restores the arrays as concurrent asyncio tasks; when one fails, the others are
    dropped, and their tracebacks print as they are collected (asyncio's "Task exception was
    never retrieved", "Exception ignored in: <coroutine ...>", "Event loop is closed"), the
    last ones from TensorStore's threads after the restore has returned. The caller reports
    the failure in one line, so these echoes are dropped: during the restore, and after a
    failed one for the rest of the process (the filters match nothing else)."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda u: None if _echo_of_failed_restore(u) else hook(u)
    logging.getLogger("asyncio").addFilter(_drop_task_echo)
    try:
        yield
    except Exception:
        gc.collect()
        raise
    sys.unraisablehook = hook
    logging.getLogger("asyncio").removeFilter(_drop_task_echo)


def _first_cause(e: BaseException) -> str:
    """The first line of the innermost cause of ``e`` (Orbax wraps TensorStore's errors)."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


class Checkpointer:
    """Save and restore run checkpoints under ``directory``.

    Args:
      directory: where step folders go (``<run_dir>/checkpoints``).
      keep_last: number of most recent checkpoints kept.
      best_metric: metric name whose best checkpoint is kept as well (None: none).
      best_mode: ``"max"`` or ``"min"``.
      async_save: write in a background thread while training continues.
      read_only: only restore: nothing under ``directory`` (or beside it) is created, moved,
        deleted or recorded, damaged steps included (``export``, ``compare``).
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        keep_last: int = 2,
        best_metric: str | None = None,
        best_mode: str = "max",
        async_save: bool = True,
        read_only: bool = False,
    ):
        self.directory = Path(directory).absolute()
        self.best_metric = best_metric
        self.read_only = read_only
        if read_only:
            options = ocp.CheckpointManagerOptions(
                read_only=True,
                create=False,
                save_interval_steps=0,
                lightweight_initialize=True,  # no step metadata read up front: no metrics needed
            )
        else:
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
                cleanup_tmp_directories=True,  # a save a killed process left unfinished
            )

        def drop_read_only_notice(record: logging.LogRecord) -> bool:
            return not str(record.msg).startswith("Given directory is read only")

        # Orbax announces read-only use as an absl warning; here it is the caller's choice.
        logging.getLogger("absl").addFilter(drop_read_only_notice)
        try:
            self._manager = ocp.CheckpointManager(
                self.directory, item_names=("state", "host"), options=options
            )
        finally:
            logging.getLogger("absl").removeFilter(drop_read_only_notice)

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
        if self.read_only or jax.process_index() != 0:
            return
        for step in self._manager.all_steps():
            record = self._step_dir(step) / RECORD
            if not record.exists():
                _test_kill("record", step)
                tmp = record.with_name(_RECORD_TMP)
                tmp.write_text(json.dumps(_file_sizes(self._step_dir(step))))
                tmp.rename(record)

    def damage(self, step: int) -> str | None:
        """What is wrong with the files of ``step`` (None: nothing found).

        Against its integrity record, when it has one: a file missing or of another size. In
        every case: Orbax's step metadata, the host document and the state's tree and array
        metadata must be readable JSON, and the state's OCDBT manifest and B-tree nodes must
        decode, every node and array chunk they point to lying within its file.

        Raises:
          OSError: a read failed for another reason than a missing or malformed file (a
            transient error: the step may well be intact).
        """
        step_dir = self._step_dir(step)
        try:
            expected = _read_json(step_dir, RECORD, required=False)
            if expected is not None:
                found = _file_sizes(step_dir)
                for name, size in expected.items():
                    if name not in found:
                        return f"missing file {name}"
                    if found[name] != size:
                        return f"{name} has {found[name]} bytes, {size} when saved"
            _read_json(step_dir, "_CHECKPOINT_METADATA")
            _read_json(step_dir, "host/metadata")
            tree = _read_json(step_dir, "state/_METADATA")
            _read_json(step_dir, "state/_sharding", required=False)
            for f in sorted((step_dir / "state" / "array_metadatas").glob("*")):
                _read_json(step_dir, str(f.relative_to(step_dir)))
            if not isinstance(tree, dict):
                return "unreadable state/_METADATA"
            if tree.get("use_ocdbt"):
                _check_ocdbt(step_dir, "state")
        except _Damage as e:
            return str(e)
        return None

    def restore_latest(self, state: Any) -> tuple[int, Any, dict[str, Any] | None]:
        """Restore the newest intact checkpoint into the structure of ``state``.

        Newer damaged steps (see :meth:`damage`) are named, with what is wrong, in one warning
        line and moved aside to ``<directory>_damaged/<step>`` so that the resumed run can save
        those steps again (left in place when read-only). When none is intact nothing is
        moved: a second attempt fails the same way instead of starting from scratch.

        Returns:
          ``(0, state, None)`` when there is no checkpoint at all, else ``(step, restored
          state, host document)`` of the newest intact step.

        Raises:
          CheckpointError: there are checkpoints, but none is intact; or the newest intact
            one could not be read (see :meth:`restore`).
        """
        damaged: list[tuple[int, str]] = []
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                restored, host = self._read(step, state)
            except _Damage as e:
                damaged.append((step, str(e)))
                continue
            if damaged:
                self._report(damaged, step)
            return step, restored, host
        if damaged:
            listed = "; ".join(f"step {step}: {why}" for step, why in damaged)
            raise CheckpointError(
                f"{self.directory}: no intact checkpoint to resume from ({listed})"
            )
        return 0, state, None

    def _report(self, damaged: list[tuple[int, str]], used: int) -> None:
        """One warning line for the damaged steps skipped, moving them aside unless read-only."""
        paths = ", ".join(str(self._step_dir(step)) for step, _ in damaged)
        if len(damaged) == 1:
            what = f"checkpoint {paths} is damaged ({damaged[0][1]})"
        else:
            why = "; ".join(f"step {step}: {why}" for step, why in damaged)
            what = f"checkpoints {paths} are damaged ({why})"
        if self.read_only:
            log.warning("%s: using step %d instead; nothing is moved (read-only)", what, used)
            return
        moved = [self._move_aside(step) for step, _ in damaged]
        where = moved[0] if len(moved) == 1 else moved[0].parent
        log.warning("%s: resuming from step %d instead; moved to %s", what, used, where)

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
        if self.read_only:
            raise RuntimeError(f"{self.directory}: this Checkpointer is read-only")
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
        _test_kill("save", step)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """Restore ``step`` into the structure, shapes and shardings of ``abstract_state``.

        The step is checked first (:meth:`damage`), so that Orbax never reads a damaged one;
        a read that fails anyway is retried (``RESTORE_TRIES`` tries, short backoff).

        Raises:
          CheckpointError: the step is damaged, or could not be read after the retries; in
            one line, the step left in place.
        """
        try:
            return self._read(step, abstract_state)
        except _Damage as e:
            raise CheckpointError(f"checkpoint {self._step_dir(step)} is damaged ({e})") from None

    def _read(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """:meth:`restore`, raising ``_Damage`` for a damaged step."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), host=ocp.args.JsonRestore()
        )
        tries = 0
        while True:
            try:
                if problem := self.damage(step):
                    raise _Damage(problem)
                with _quiet_orbax_failure():
                    restored = self._manager.restore(step, args=args)
                return restored["state"], restored["host"]
            except _Damage:
                raise
            except Exception as e:  # Orbax / TensorStore raise plain Exception and ValueError
                tries += 1
                if tries == RESTORE_TRIES:
                    raise CheckpointError(
                        f"checkpoint {self._step_dir(step)} could not be read after {tries} "
                        f"tries ({_first_cause(e)}); it passed the integrity check, so it is "
                        "left in place"
                    ) from e
                time.sleep(0.5 * 2 ** (tries - 1))

    def wait(self) -> None:
        """Block until pending asynchronous saves are committed (and recorded)."""
        self._manager.wait_until_finished()
        self._record_committed()

    def close(self) -> None:
        self.wait()
        self._manager.close()
