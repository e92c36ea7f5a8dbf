"""Prompt data given as Python objects: a ``datasets.Dataset``, a list of dicts, a reasoning-gym
data set, or a stream.

The same adapters as files turn rows into :class:`~delta_jax.data.PromptRecord`; with the
``generic`` adapter every column it does not map is kept in ``record.extra``, so that batched
reward functions receive the data set's other fields (``fn(prompts, completions, **columns)``).

* A **map-style** object (``datasets.Dataset``, a list or tuple of dicts) is read whole, like a
  file, and drawn by the checkpointable :class:`~delta_jax.data.PromptPipeline`: resume is exact.
  So is a reasoning-gym data set (``reasoning_gym.create_dataset(...)``, sized and indexed
  although it is not a ``Sequence``), whose entries become records without an adapter
  (:func:`delta_jax.data.gym.records_from_gym_dataset`).
* A **stream** (``datasets.IterableDataset``, or any iterable of dicts that is not a sequence)
  is read as it goes by :class:`StreamPrompts`. Its state is the epoch and the number of rows
  read in it; a resume re-reads the epoch from its start and skips those rows. That is exact
  when the stream yields the same rows in the same order every time it is read (a local or
  hub data set, shuffled or not: an ``IterableDataset``'s shuffle is seeded and follows
  ``set_epoch``); a stream that changes between reads (a live feed, an unseeded generator)
  resumes at the same count of rows, not at the same rows. When a stream ends it starts its
  next epoch, as a map-style data set does.

Bad rows follow ``on_bad_row`` as in files: ``"error"`` raises :class:`BadRowError` naming the
data set, the row and the field; ``"skip"`` drops the row and counts it by reason (a row that is
not a dict, a row without a column the adapter reads, a prompt that is missing, empty, of the
wrong type, or not valid Unicode). A column that no row has is a schema error either way
(``ValueError`` naming the data set and the column), found before any row is converted: from
the object's ``column_names``, the keys of all rows of a list, or a stream's first row. A
stream's skips are counted as it is read (:meth:`StreamPrompts.take_skipped`, the trainer's
``data/skipped``) and the first of each reason is logged once, on one line.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import datasets

from delta_jax.data.adapters import Adapter, BadRowError, resolve_adapter
from delta_jax.data.gym import is_gym_dataset, records_from_gym_dataset
from delta_jax.data.sources import LoadResult, PromptRecord

Encoder = Callable[[list[PromptRecord]], Any]  # records -> EncodedPrompts

log = logging.getLogger(__name__)


def is_stream(data: Any) -> bool:
    """A data object read as it goes: an ``IterableDataset`` or a non-sequence iterable."""
    if isinstance(data, datasets.IterableDataset):
        return True
    if is_gym_dataset(data):  # iterable, not a Sequence, but sized and indexed
        return False
    return not isinstance(data, datasets.Dataset | Sequence | Mapping) and isinstance(
        data, Iterable
    )


def _check_object(data: Any, what: str) -> None:
    if isinstance(data, str | bytes | Mapping) or not isinstance(data, datasets.Dataset | Iterable):
        raise TypeError(
            f"{what} must be a datasets.Dataset, a datasets.IterableDataset or a list of dicts, "
            f"got {type(data).__name__}"
        )


class RowConverter:
    """One row (a dict) -> a :class:`PromptRecord`, with the generic adapter's extra columns."""

    def __init__(
        self, adapter: str | Adapter, fields: Mapping[str, str] | None, label: str, on_bad_row: str
    ):
        if on_bad_row not in ("error", "skip"):
            raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
        self.adapter = resolve_adapter(adapter, fields)
        self.label, self.on_bad_row = label, on_bad_row
        self.reasons: dict[str, int] = {}
        self.first: dict[str, str] = {}  # reason -> the first skipped row's message (one line)
        self.last: tuple[str, str] = ("", "")  # the last skipped row's (reason, message)
        self._columns: list[str] | None = None

    def schema(self, available: Iterable[Any]) -> None:
        """Checks the data set's columns once: one the adapter needs and none has is an error.

        Raises:
          ValueError: (one line) naming the data set, the adapter and the column.
        """
        self._columns = self.adapter.columns(list(available), self.label)

    def __call__(self, row: Any, index: int) -> PromptRecord | None:
        """The record of row ``index``, or None for a bad row skipped (``on_bad_row="skip"``)."""
        if not isinstance(row, Mapping):
            if self.on_bad_row == "error":
                raise TypeError(f"{self.label}: row {index} is a {type(row).__name__}, not a dict")
            return self._skip(BadRowError("row", "wrong type", f"a {type(row).__name__}"), index)
        if self._columns is None:  # No schema given: the first row's (module docstring).
            self.schema(row)
        try:
            out = self.adapter.convert({c: row[c] for c in self._columns if c in row})
        except KeyError as e:  # a column other rows have: this row's own fault
            return self._skip(BadRowError(str(e.args[0]), "missing", f"no column {e}"), index)
        except BadRowError as e:
            return self._skip(e, index)
        if self.adapter.name == "generic":
            kept = {k: v for k, v in row.items() if k not in self._columns}
            out["extra"] = {**kept, **out.get("extra", {})}
        return PromptRecord(source=self.label, row=index, **out)

    def _skip(self, error: BadRowError, index: int) -> None:
        """Raises ``error`` with the row named, or counts it (``on_bad_row="skip"``)."""
        error = BadRowError(error.field, error.kind, error.detail, source=self.label, row=index)
        if self.on_bad_row == "error":
            raise error from None
        self.reasons[error.reason] = self.reasons.get(error.reason, 0) + 1
        self.first.setdefault(error.reason, str(error))
        self.last = error.reason, str(error)
        return None


def records_from_object(
    data: Any,
    *,
    adapter: str | Adapter = "generic",
    fields: Mapping[str, str] | None = None,
    on_bad_row: str = "error",
    limit: int | None = None,
    label: str = "train_dataset",
) -> LoadResult:
    """Records of a map-style data object (or the first ``limit`` rows of a stream).

    Args:
      data: a ``datasets.Dataset``, a list of dicts, a reasoning-gym data set (its entries,
        whatever ``adapter`` says), or a stream (then ``limit`` rows are read; all of them
        when ``limit`` is None, so a stream must end).
      adapter, fields, on_bad_row, limit: as for :func:`~delta_jax.data.load_records`.
      label: the name given to the rows' source in records and messages.

    Returns:
      A :class:`~delta_jax.data.LoadResult`.
    """
    if is_gym_dataset(data):
        return LoadResult(records_from_gym_dataset(data, label=label, limit=limit), 0, {})
    _check_object(data, label)
    convert = RowConverter(adapter, fields, label, on_bad_row)
    rows = iter(data) if limit is None else itertools.islice(iter(data), limit)
    if not is_stream(data):
        rows = list(rows)
        names = getattr(data, "column_names", None)
        if names is None:  # a list of dicts: the columns of all its rows
            names = dict.fromkeys(k for row in rows if isinstance(row, Mapping) for k in row)
        if names:  # (none: no row is a dict, which the first row says)
            convert.schema(names)
    records = [r for i, row in enumerate(rows) if (r := convert(row, i)) is not None]
    if limit is not None:
        records = records[:limit]
    return LoadResult(
        records, sum(convert.reasons.values()), dict(convert.reasons), dict(convert.first)
    )


class StreamPrompts:
    """Prompt batches drawn from a stream as it is read, with a resumable (epoch, rows) state.

    Args:
      data: an ``IterableDataset`` or an iterable of dicts that can be iterated again.
      batch_size: prompts per batch.
      encode: records -> :class:`~delta_jax.data.EncodedPrompts` (the run's template and
        length policy; prompts it drops are skipped, so a batch is always full).
      convert: a :class:`RowConverter`.
      seed, shuffle: an ``IterableDataset`` is shuffled with ``seed`` (a buffer of
        ``shuffle_buffer`` rows) and told its epoch; another iterable is read in its own order.
    """

    def __init__(
        self,
        data: Any,
        *,
        batch_size: int,
        encode: Encoder,
        convert: RowConverter,
        seed: int,
        shuffle: bool,
        shuffle_buffer: int = 1000,
    ):
        _check_object(data, convert.label)
        if isinstance(data, Iterator) and not isinstance(data, datasets.IterableDataset):
            raise TypeError(
                f"{convert.label}: an iterator can be read only once; pass an iterable that can "
                "be read again (a datasets.IterableDataset, or a list)"
            )
        names = getattr(data, "column_names", None)  # a stream's schema: its features, else
        if names is None:  # its first row
            first = next(iter(data), None)
            names = list(first) if isinstance(first, Mapping) else None
        if names is not None:
            convert.schema(names)
        if isinstance(data, datasets.IterableDataset) and shuffle:
            data = data.shuffle(seed=seed, buffer_size=shuffle_buffer)
        self.data, self.batch_size, self.encode, self.convert = data, batch_size, encode, convert
        self.epoch, self.rows = 0, 0
        self._rows: Iterator | None = None
        self._skipped, self._logged = 0, set()

    def _open(self) -> None:
        if hasattr(self.data, "set_epoch"):
            self.data.set_epoch(self.epoch)
        self._rows = itertools.islice(iter(self.data), self.rows, None)
        self._whole_epoch, self._kept = self.rows == 0, 0

    def _next_row(self) -> Any:
        if self._rows is None:
            self._open()
        row = next(self._rows, StopIteration)
        if row is StopIteration:  # The epoch ends: the next one starts from its first row.
            if self.rows == 0:
                raise ValueError(f"{self.convert.label}: the stream yielded no rows")
            if self._whole_epoch and not self._kept:
                raise ValueError(f"{self.convert.label}: a whole pass gave no usable prompt")
            self.epoch, self.rows = self.epoch + 1, 0
            self._open()
            row = next(self._rows, StopIteration)
            if row is StopIteration:
                raise ValueError(f"{self.convert.label}: the stream yielded no rows")
        return row

    def __next__(self) -> list[tuple[list[int], PromptRecord]]:
        batch: list[tuple[list[int], PromptRecord]] = []
        while len(batch) < self.batch_size:
            row, index = self._next_row(), self.rows
            self.rows += 1
            record = self.convert(row, index)
            if record is None:
                self._skip(*self.convert.last)
                continue
            enc = self.encode([record])  # One at a time: a pass that keeps nothing is seen.
            self._kept += len(enc.ids)
            batch.extend(zip(enc.ids, enc.records, strict=True))
            if enc.dropped:
                self._skip(
                    "prompt: too long",
                    f"{self.convert.label}: row {index}: the prompt is longer than the maximum "
                    "prompt length (data.max_prompt_length) with data.truncation=drop",
                )
        return batch

    def _skip(self, reason: str, message: str) -> None:
        self._skipped += 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning(
                "%s (skipped, counted in data/skipped; further rows skipped for %r are not logged)",
                message,
                reason,
            )

    def take_skipped(self) -> int:
        """Rows skipped (bad, or prompts too long) since the last call."""
        skipped, self._skipped = self._skipped, 0
        return skipped

    def __iter__(self) -> StreamPrompts:
        return self

    def get_state(self) -> dict[str, Any]:
        return {"stream": {"epoch": self.epoch, "rows": self.rows}}

    def set_state(self, state: dict[str, Any]) -> None:
        saved = state.get("stream") if isinstance(state, dict) else None
        if not isinstance(saved, dict):
            raise ValueError(
                f"{self.convert.label}: the checkpoint's data state is not a stream's ({state!r}):"
                " it was saved by a run with another kind of train_dataset"
            )
        self.epoch, self.rows = int(saved["epoch"]), int(saved["rows"])
        self._rows = None
