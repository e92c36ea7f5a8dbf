"""Prompt records from Hugging Face ``datasets`` sources.

A *source* is a local ``.parquet`` / ``.json`` / ``.jsonl`` / ``.arrow`` file, a directory of
such files (or one written by ``Dataset.save_to_disk``), or a hub data set name such as
``"openai/gsm8k"`` (with a subset such as ``"main"`` and a split) loaded through
``datasets.load_dataset`` as every Hugging Face tool does: downloaded on first use, read from the
``datasets`` cache after, cache-only with ``HF_HUB_OFFLINE=1``; one process per host downloads
while the others wait (:func:`delta_jax.hub.download_lock`), and a failure names the data set and
the cause (:func:`delta_jax.hub.hub_error`). Local files are read with the library's offline
switch on (they need no hub), each file on its own so that a bad row can be reported by file
and row index.

An *adapter* turns one row of a known schema into a :class:`PromptRecord`. Rows that cannot be
converted (a missing or empty field, a value of the wrong type) are *bad rows*: by default they
raise :class:`BadRowError` naming the file, the row index (0-based, within that file) and the
field; with ``on_bad_row="skip"`` they are dropped and counted by reason. A column missing from
a file altogether is a schema error and always raises, since skipping a whole file silently
would hide a wrong adapter or field mapping.

Adapters live in :mod:`delta_jax.data.adapters`; this module holds the records and the loader.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import datasets
import huggingface_hub.constants
import huggingface_hub.errors
import pyarrow.parquet as pq

from delta_jax import hub
from delta_jax.data.adapters import Adapter, BadRowError, resolve_adapter

FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}
_READ_BATCH = 1024


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt of an RL data set.

    Attributes:
      prompt: the user message (plain text, no chat template applied).
      answer: the reference final answer as a string (math), or ``None`` (code, or unknown).
      system: an optional system message carried by the data set.
      tests: code test cases as a JSON string (``{"inputs": [...], "outputs": [...]}`` or with a
        ``"fn_name"``), or ``None``.
      source: the file (or ``name[split]``) the row came from.
      row: the row index within ``source`` (0-based), ``-1`` when built by hand.
      extra: metadata columns kept by the adapter (difficulty, subject, ids, ...).
    """

    prompt: str
    answer: str | None
    system: str | None = None
    tests: str | None = None
    source: str = ""
    row: int = -1
    # Left out of the hash so that records stay hashable (a dict is not).
    extra: dict = dataclasses.field(default_factory=dict, hash=False)


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """What :func:`load_records` returns.

    Attributes:
      records: the converted rows, in file order then row order.
      skipped: number of bad rows dropped (always 0 with ``on_bad_row="error"``).
      skip_reasons: counts keyed by ``"<field>: <kind>"``, e.g. ``{"prompt: empty": 2}``.
      first_skips: the first skipped row's message for each reason (file, row, field, what).
    """

    records: list[PromptRecord]
    skipped: int
    skip_reasons: dict[str, int]
    first_skips: dict[str, str] = dataclasses.field(default_factory=dict)

    def skip_summary(self) -> str:
        """The skips on one line: the count, then each reason's count and first row."""
        first = lambda reason: self.first_skips.get(reason, "?")
        parts = [f"{n} x {k!r} (first: {first(k)})" for k, n in self.skip_reasons.items()]
        return f"skipped {self.skipped} bad rows: " + "; ".join(parts)


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    # `datasets` reads HF_HUB_OFFLINE once at import; flipping its config for the duration of the
    # call keeps a local-file load from ever asking the hub anything.
    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


def _local_parts(
    path: Path, split: str, adapter: Adapter, cache_dir: str | None
) -> list[tuple[str, Callable[[], datasets.Dataset]]]:
    """(label, loader) pairs for a local file or directory."""

    def from_file(file: Path) -> tuple[str, Callable[[], datasets.Dataset]]:
        builder = FILE_BUILDERS[file.suffix.lower()]
        kwargs = {}
        if builder == "parquet":
            # Parquet is columnar: read (and cache) only what the adapter uses, never DeepMath's
            # multi-GB R1 solutions. The schema is in the footer, so this costs no data read.
            kwargs["columns"] = adapter.columns(pq.read_schema(file).names, str(file))
        return str(file), lambda: datasets.load_dataset(
            builder, data_files=[str(file)], split="train", cache_dir=cache_dir, **kwargs
        )

    if path.is_file():
        if path.suffix.lower() not in FILE_BUILDERS:
            raise ValueError(
                f"source {str(path)!r}: unsupported file type {path.suffix!r}; "
                f"expected one of {sorted(FILE_BUILDERS)}"
            )
        return [from_file(path)]
    if (path / "dataset_dict.json").exists():
        splits = datasets.load_from_disk(str(path))
        if split not in splits:
            raise ValueError(f"source {str(path)!r}: no split {split!r}, has {sorted(splits)}")
        return [(f"{path}[{split}]", lambda: splits[split])]
    if (path / "state.json").exists():
        return [(str(path), lambda: datasets.load_from_disk(str(path)))]
    # Split files follow the Hub's naming conventions (train-*.parquet, data/test.jsonl, ...); a
    # directory without split names is all "train".
    try:
        patterns = datasets.data_files.get_data_patterns(str(path))
    except datasets.data_files.EmptyDatasetError:
        patterns = {}
    files_by_split = datasets.data_files.DataFilesDict.from_patterns(patterns, base_path=str(path))
    if split not in files_by_split:
        raise ValueError(
            f"source {str(path)!r}: no files for split {split!r} "
            f"(splits found: {sorted(files_by_split)})"
        )
    files = [Path(f) for f in files_by_split[split] if Path(f).suffix.lower() in FILE_BUILDERS]
    if not files:
        raise ValueError(
            f"source {str(path)!r}: no {'/'.join(sorted(FILE_BUILDERS))} files for split {split!r}"
        )
    return [from_file(f) for f in files]


def _hub_part(
    name: str, config: str | None, split: str, cache_dir: str | None
) -> tuple[str, Callable[[], datasets.Dataset]]:
    def load() -> datasets.Dataset:
        try:
            with hub.download_lock("dataset", name):
                return datasets.load_dataset(name, config, split=split, cache_dir=cache_dir)
        except (OSError, huggingface_hub.errors.HfHubHTTPError) as e:
            # (A wrong split or subset is a ValueError whose message lists the valid ones.)
            raise hub.hub_error("data set", name, None, e) from e

    label = f"{name}[{split}]" if config is None else f"{name}/{config}[{split}]"
    return label, load


def load_records(
    source: str | os.PathLike,
    *,
    adapter: str | Adapter = "generic",
    split: str = "train",
    fields: Mapping[str, str] | None = None,
    on_bad_row: str = "error",
    limit: int | None = None,
    config: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> LoadResult:
    """Loads prompt records from a local file, a directory, or a hub data set name.

    Args:
      source: a ``.parquet`` / ``.json`` / ``.jsonl`` / ``.arrow`` file; a directory of such
        files (split chosen by the Hub's file-name conventions) or one written by
        ``save_to_disk``; or a hub data set name (``"org/name"``), downloaded on first use. A
        single file is read whole, whatever ``split`` says.
      adapter: a name in :data:`ADAPTERS` or an :class:`Adapter`.
      split: split of a directory or hub data set.
      fields: for the ``"generic"`` adapter only, ``{"prompt": col, "answer": col, "system": col,
        "tests": col}``; keys left out are not read (default ``{"prompt": "prompt",
        "answer": "answer"}``).
      on_bad_row: ``"error"`` raises :class:`BadRowError` at the first bad row; ``"skip"`` drops
        bad rows and counts them in the result.
      limit: stop after this many records (``None``: all).
      config: the subset (configuration) of a hub data set (e.g. ``"main"`` for GSM8K).
      cache_dir: the ``datasets`` cache directory (default: the library's).

    Returns:
      A :class:`LoadResult`.

    Example::

      res = load_records("gsm8k/test.parquet", adapter="gsm8k")
      res.records[0].answer  # "18"
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")
    adapter = resolve_adapter(adapter, fields)
    cache_dir = None if cache_dir is None else str(cache_dir)
    path = Path(source)
    from_hub = not path.exists()
    if not from_hub:
        with _offline():
            parts = _local_parts(path, split, adapter, cache_dir)
    elif path.suffix.lower() in FILE_BUILDERS or not hub.looks_like_hub_id(str(source)):
        raise FileNotFoundError(f"source {str(source)!r}: no such file or directory")
    else:
        parts = [_hub_part(str(source), config, split, cache_dir)]
    records: list[PromptRecord] = []
    reasons: dict[str, int] = {}
    first: dict[str, str] = {}
    for label, load in parts:
        if limit is not None and len(records) >= limit:
            break
        with contextlib.nullcontext() if from_hub else _offline():
            ds = load()
        _convert_part(label, ds, adapter, on_bad_row, limit, records, reasons, first)
    return LoadResult(records, sum(reasons.values()), reasons, first)


def _convert_part(
    label: str,
    ds: datasets.Dataset,
    adapter: Adapter,
    on_bad_row: str,
    limit: int | None,
    records: list[PromptRecord],
    reasons: dict[str, int],
    first: dict[str, str],
) -> None:
    columns = adapter.columns(ds.column_names, label)
    # Only the needed columns are decoded: DeepMath's three R1 solutions would otherwise dominate.
    ds = ds.select_columns(columns)
    row = 0
    for batch in ds.iter(batch_size=_READ_BATCH):
        for values in zip(*(batch[c] for c in columns), strict=True):
            try:
                out = adapter.convert(dict(zip(columns, values, strict=True)))
            except BadRowError as e:
                bad = BadRowError(e.field, e.kind, e.detail, source=label, row=row)
                if on_bad_row == "error":
                    raise bad from None
                reasons[bad.reason] = reasons.get(bad.reason, 0) + 1
                first.setdefault(bad.reason, str(bad))
            else:
                records.append(PromptRecord(source=label, row=row, **out))
                if limit is not None and len(records) >= limit:
                    return
            row += 1
