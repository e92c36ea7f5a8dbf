"""Prompt batches from a grain pipeline: seeded shuffle per epoch, process shards, exact resume.

The pipeline is a chain of grain ``MapDataset`` transformations over the N records (or indices
``0..N-1``), P processes and batch size B:

1. ``shuffle(seed)``: grain folds the epoch number into the seed, so every epoch is a different,
   reproducible permutation;
2. ``[: (N // P) * P]`` then ``[process_index :: P]``: the first ``N mod P`` records of each
   shuffled epoch are left out so that every process gets exactly ``N // P`` records and the
   same number of batches (processes step in lock-step; one extra batch on one host would hang
   the others). The P shards of an epoch are disjoint and, when P divides N, cover it;
3. ``batch(B)`` within the epoch (``drop_remainder`` drops its last short batch);
4. ``repeat(num_epochs)`` (``None``: forever).

The iterator is a grain ``DatasetIterator``, so grain's Orbax handler
(``grain.checkpoint.CheckpointSave(pipeline)``) saves it as JSON; its state is grain's own
``{"next_index": step}`` plus the pipeline settings, which :meth:`set_state` checks before
restoring so that a checkpoint is never resumed into a different data order.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import grain

from delta_jax.data.sources import PromptRecord


class PromptPipeline(grain.DatasetIterator):
    """Iterator over prompt batches with checkpointable state.

    Each ``next()`` returns a list: of :class:`PromptRecord` when built from records, of ``int``
    record indices when built from a length.

    Args:
      records_or_len: the records (any sequence) or their number N.
      batch_size: B, prompts per batch and per process.
      seed: shuffle seed in ``[0, 2**32)``.
      shuffle: shuffle each epoch (otherwise file order).
      num_epochs: epochs before ``StopIteration``; ``None`` repeats forever.
      process_index: this process, in ``[0, process_count)``.
      process_count: P, the number of data-loading processes (``jax.process_count()``).
      drop_remainder: drop each epoch's last batch when shorter than B.

    Example::

      pipe = PromptPipeline(records, batch_size=64, seed=0,
                            process_index=jax.process_index(), process_count=jax.process_count())
      batch = next(pipe)            # list of 64 PromptRecord
      state = pipe.get_state()      # JSON-serialisable
      fresh = PromptPipeline(records, batch_size=64, seed=0, ...); fresh.set_state(state)
    """

    def __init__(
        self,
        records_or_len: Sequence[PromptRecord] | int,
        *,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        num_epochs: int | None = None,
        process_index: int = 0,
        process_count: int = 1,
        drop_remainder: bool = True,
    ):
        # grain's __del__ closes the iterator, so the base state must exist even when the
        # argument checks below raise; the parent iterator is attached at the end.
        super().__init__()
        if isinstance(records_or_len, numbers.Integral):
            n = int(records_or_len)
            ds = grain.MapDataset.range(max(n, 0))
        else:
            n, ds = len(records_or_len), grain.MapDataset.source(records_or_len)
        if n <= 0:
            raise ValueError(f"records_or_len must be non-empty, got {n} records")
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
        if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs <= 0):
            raise ValueError(f"num_epochs must be a positive int or None, got {num_epochs!r}")
        if not isinstance(process_count, int) or process_count <= 0:
            raise ValueError(f"process_count must be a positive int, got {process_count!r}")
        if not isinstance(process_index, int) or not 0 <= process_index < process_count:
            raise ValueError(
                f"process_index must be in [0, {process_count}), got {process_index!r}"
            )
        shard_len = n // process_count
        per_epoch = shard_len // batch_size if drop_remainder else math.ceil(shard_len / batch_size)
        if per_epoch == 0:
            raise ValueError(
                f"no full batch per epoch: {n} records over {process_count} processes gives "
                f"{shard_len} per process, fewer than batch_size={batch_size}"
            )
        self._config = {
            "num_records": n,
            "batch_size": batch_size,
            "seed": seed,
            "shuffle": bool(shuffle),
            "num_epochs": num_epochs,
            "process_index": process_index,
            "process_count": process_count,
            "drop_remainder": bool(drop_remainder),
        }
        self._batches_per_epoch = per_epoch
        if shuffle:
            ds = ds.shuffle(seed)
        ds = ds[: shard_len * process_count][process_index::process_count]
        ds = ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=list)
        ds = ds.repeat(num_epochs)
        # Prompt batches are cheap to build: read synchronously so the state is simply the
        # index of the next batch, with no prefetch threads to drain.
        options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        super().__init__(ds.to_iter_dataset(options).__iter__())

    @property
    def batches_per_epoch(self) -> int:
        """Batches this process yields per epoch."""
        return self._batches_per_epoch

    @property
    def step(self) -> int:
        """Batches returned so far."""
        return self._parent.get_state()["next_index"]

    @property
    def epoch(self) -> int:
        """Epoch (0-based) of the next batch."""
        return self.step // self._batches_per_epoch

    def __next__(self) -> list:
        return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable state: grain's ``next_index``, the epoch (informative), settings."""
        step = self.step
        return {
            "next_index": step,
            "epoch": step // self._batches_per_epoch,
            "config": dict(self._config),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a state from :meth:`get_state` of a pipeline with the same settings."""
        if not isinstance(state, dict) or not isinstance(state.get("next_index"), int):
            raise ValueError(f"state must be a dict from get_state(), got {state!r}")
        saved = state.get("config", {})
        diff = {k: (saved.get(k), v) for k, v in self._config.items() if saved.get(k) != v}
        if diff:
            raise ValueError(
                "state was saved by a pipeline with other settings, (saved, current): "
                + ", ".join(f"{k}={v}" for k, v in diff.items())
            )
        self._parent.set_state({"next_index": state["next_index"]})

    def __str__(self) -> str:
        return f"PromptPipeline({self._config})"
