"""A run's prompt sets: the training batches and the held-out prompts.

Records come from a source name (a file or hub data set, ``reasoning_gym:<task>``, the demo's
generated problems) or from a data set object, and are encoded with the run's template and
length policy. Generated sources hold out their own problems, drawn from another seed.

The functions read the ``data`` config section by attribute (``data.source``, ``data.limit``,
...; :class:`~delta_jax.config.DataConfigSection`) and take the run's other values as plain
arguments. A set the configuration cannot build is a one-line :class:`PromptSetError` naming
the key; :mod:`delta_jax.rl.setup` reports it as a configuration error.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from delta_jax.data.gym import (
    ANSWER_MARKER,
    EVAL_SEED_OFFSET,
    MIN_WORKING,
    eval_gym_options,
    gym_records,
    gym_task,
    is_gym_source,
)
from delta_jax.data.objects import RowConverter, StreamPrompts, is_stream, records_from_object
from delta_jax.data.pipeline import PromptPipeline
from delta_jax.data.sources import LoadResult, PromptRecord, load_records
from delta_jax.data.templates import EncodedPrompts, encode_prompts
from delta_jax.demo import arithmetic_records, product_records

log = logging.getLogger(__name__)

DEMO_DATA = "demo:arithmetic"
DEMO_SOURCES = (DEMO_DATA, "demo:products")  # additions; products (the tool-use demo)
DEMO_TRAIN_SIZE = 4096  # problems generated for a demo source's training set

FirstTurn = Callable[[PromptRecord], str]  # a record -> its first user turn (an environment's)


class PromptSetError(ValueError):
    """A prompt set the configuration cannot build; one line, naming the key."""


class IndexedPrompts:
    """Batches of ``(prompt ids, record)`` of an in-memory prompt list, in pipeline order.

    ``skipped``: rows left out when the list was read (bad rows, prompts too long), counted
    with the run's first batch (:meth:`take_skipped`: step 1's ``data/skipped``; not again
    when a process resumes the run past it).
    """

    def __init__(self, pipeline: PromptPipeline, ids: list[list[int]], records, skipped=0):
        self.pipeline, self.ids, self.records = pipeline, ids, records
        self.skipped_at_load, self._skipped = skipped, 0

    def take_skipped(self) -> int:
        """Rows skipped since the last call (the load's, with the run's first batch)."""
        skipped, self._skipped = self._skipped, 0
        return skipped

    def __next__(self) -> list[tuple[list[int], PromptRecord]]:
        if self.pipeline.step == 0:
            self._skipped += self.skipped_at_load
        return [(self.ids[i], self.records[i]) for i in next(self.pipeline)]

    def __iter__(self) -> IndexedPrompts:
        return self

    def get_state(self) -> dict[str, Any]:
        return self.pipeline.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        if isinstance(state, dict) and "stream" in state:
            raise ValueError(
                "the checkpoint's data state is a stream's: it was saved by a run whose "
                "train_dataset was a stream (an IterableDataset)"
            )
        self.pipeline.set_state(state)


def _gym_records(
    data, source: str, *, eval_set: bool, seed: int, eval_prompts: int
) -> list[PromptRecord]:
    """A reasoning-gym task's entries: ``data.gym_size`` for training, ``eval_prompts`` held
    out from a disjoint seed (delta_jax.data.gym), with ``data.gym_options`` for the training
    task; ``data.limit`` caps both, as it does a file's rows."""
    seed = seed if data.gym_seed is None else data.gym_seed
    try:
        if eval_set:
            count, seed = eval_prompts, seed + EVAL_SEED_OFFSET
            options = eval_gym_options(data, source)
        else:
            count, options = data.gym_size, data.gym_options
        size = min(count, data.limit or count)
        records = gym_records(gym_task(source), size=size, seed=seed, options=options)
    except (ValueError, ImportError) as e:
        key = "data.eval_source" if eval_set else "data.source"
        raise PromptSetError(f"{key}={source}: {e}") from None
    if data.answer_marker is None:
        return records
    fields = {ANSWER_MARKER: data.answer_marker}  # what the reasoning_gym reward reads
    if data.min_working_words:
        fields[MIN_WORKING] = data.min_working_words
    return [dataclasses.replace(r, extra={**r.extra, **fields}) for r in records]


def source_records(
    data, source: str, split: str, *, eval_set: bool, seed: int, eval_prompts: int
) -> LoadResult:
    """The records of a source name: a reasoning-gym task, a demo source or a file / hub data
    set (``data.adapter``, ``data.subset``, ``data.on_bad_row``, ``data.limit``).

    Args:
      data: the ``data`` config section.
      source: the source name (``data.source``, ``data.eval_source`` or an extra one).
      split: the split of a data set.
      eval_set: a held-out set: generated sources draw ``eval_prompts`` problems from another
        seed.
      seed: the run's seed.
      eval_prompts: problems in a generated held-out set.
    """
    if is_gym_source(source):
        records = _gym_records(
            data, source, eval_set=eval_set, seed=seed, eval_prompts=eval_prompts
        )
        return LoadResult(records, 0, {})
    if source in DEMO_SOURCES:
        # Disjoint seeds: the held-out problems are drawn independently of the training ones;
        # as many as the evaluation uses.
        count = eval_prompts if eval_set else DEMO_TRAIN_SIZE
        make = arithmetic_records if source == DEMO_DATA else product_records
        return LoadResult(make(data.limit or count, seed=seed + (1 if eval_set else 0)), 0, {})
    result = load_records(
        source,
        adapter=data.adapter,
        split=split,
        config=data.subset,
        on_bad_row=data.on_bad_row,
        limit=data.limit,
    )
    if result.skipped:
        log.warning("%s: %s", source, result.skip_summary())
    return result


def make_encoder(
    data,
    tokenizer,
    *,
    first_turn: FirstTurn | None = None,
    tools: Sequence[Any] | None = None,
    quiet: bool = False,
) -> Callable[[list[PromptRecord]], EncodedPrompts]:
    """records -> :class:`~delta_jax.data.EncodedPrompts` with the ``data`` section's template
    and length policy.

    Args:
      data: the ``data`` config section.
      tokenizer: the policy's tokenizer.
      first_turn: with an environment, a record's prompt is the first user turn this gives.
      tools: the environment's tools, declared to the chat template.
      quiet: do not log the prompts dropped for length (a stream logs its own, once).
    """
    template = data.template
    if data.source in DEMO_SOURCES and template is None:
        template = "{prompt}"  # the demo prompt is already the whole text

    def encode(records: list[PromptRecord]) -> EncodedPrompts:
        if first_turn is not None:
            records = [dataclasses.replace(r, prompt=first_turn(r)) for r in records]
        enc = encode_prompts(
            records,
            tokenizer,
            max_prompt_length=data.max_prompt_length,
            truncation=data.truncation,
            system_prompt=data.system_prompt,
            template=template,
            tools=tools,
        )
        if enc.dropped and not quiet:
            log.warning(
                "dropped %d prompts longer than %d tokens", enc.dropped, data.max_prompt_length
            )
        return enc

    return encode


def _object_records(data, obj, *, label: str, limit: int | None) -> LoadResult:
    result = records_from_object(
        obj, adapter=data.adapter, on_bad_row=data.on_bad_row, limit=limit, label=label
    )
    if result.skipped:
        log.warning("%s: %s", label, result.skip_summary())
    return result


def _train_prompts(data, tokenizer, train_dataset, *, batch_size, seed, first_turn, tools):
    """The training batches: a stream read as it goes, else an indexed list."""
    if train_dataset is not None and is_stream(train_dataset):
        return StreamPrompts(
            train_dataset,
            batch_size=batch_size,
            convert=RowConverter(data.adapter, None, "train_dataset", data.on_bad_row),
            seed=seed,
            encode=make_encoder(data, tokenizer, first_turn=first_turn, tools=tools, quiet=True),
            shuffle=data.shuffle,
        )
    if train_dataset is not None:
        loaded = _object_records(data, train_dataset, label="train_dataset", limit=data.limit)
    else:
        loaded = source_records(
            data, data.source, data.split, eval_set=False, seed=seed, eval_prompts=0
        )
    enc = make_encoder(data, tokenizer, first_turn=first_turn, tools=tools)(loaded.records)
    if len(enc.ids) < batch_size:
        where = "train_dataset" if train_dataset is not None else f"data.source={data.source}"
        raise PromptSetError(
            f"{where}: {len(enc.ids)} usable prompts < rollout.prompts_per_step={batch_size}"
        )
    pipeline = PromptPipeline(
        len(enc.ids),
        batch_size=batch_size,
        seed=seed,
        shuffle=data.shuffle,
        # Host-replicated rollouts: every process draws the same prompts (the sampler's
        # program spans all hosts); each feeds its own rows to the train step.
        process_index=0,
        process_count=1,
    )
    return IndexedPrompts(pipeline, enc.ids, enc.records, loaded.skipped + enc.dropped)


def prompt_sets(
    data,
    tokenizer,
    *,
    batch_size: int,
    seed: int,
    eval_prompts: int,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    first_turn: FirstTurn | None = None,
    tools: Sequence[Any] | None = None,
) -> tuple[IndexedPrompts | StreamPrompts, EncodedPrompts | None]:
    """The training batches and the held-out prompts (None without a held-out source).

    Args:
      data: the ``data`` config section.
      tokenizer: the policy's tokenizer.
      batch_size: prompts per training batch (``rollout.prompts_per_step``).
      seed: the run's seed (shuffle order, generated problems).
      eval_prompts: held-out prompts at most (``run.eval_prompts``).
      train_dataset: a data set object that replaces ``data.source``.
      eval_dataset: a data set object that replaces ``data.eval_source``.
      first_turn: with an environment, a record's prompt is the first user turn this gives.
      tools: the environment's tools, declared to the chat template.

    Raises:
      PromptSetError: too few usable training prompts, or a reasoning-gym source that cannot
        be generated.
    """
    hooks = {"first_turn": first_turn, "tools": tools}
    train = _train_prompts(
        data, tokenizer, train_dataset, batch_size=batch_size, seed=seed, **hooks
    )
    encode = make_encoder(data, tokenizer, **hooks)
    if eval_dataset is not None:
        loaded = _object_records(data, eval_dataset, label="eval_dataset", limit=eval_prompts)
        return train, encode(loaded.records)
    # Generated sources hold out their own problems (another seed) unless told otherwise.
    generated = data.source in DEMO_SOURCES or is_gym_source(data.source)
    eval_source = data.eval_source or (data.source if generated and train_dataset is None else None)
    if not eval_source:
        return train, None
    held_out = source_records(
        data, eval_source, data.eval_split, eval_set=True, seed=seed, eval_prompts=eval_prompts
    ).records
    return train, encode(held_out[:eval_prompts])


def eval_set_name(source: str) -> str:
    """A metric-friendly name of a held-out source: its task, or its file / data set name."""
    raw = gym_task(source) if is_gym_source(source) else Path(source.rstrip("/")).stem
    return "".join(c if c.isalnum() or c == "_" else "_" for c in raw) or "extra"


def extra_eval_sets(
    data,
    tokenizer,
    *,
    seed: int,
    eval_prompts: int,
    first_turn: FirstTurn | None = None,
    tools: Sequence[Any] | None = None,
) -> dict[str, EncodedPrompts]:
    """``data.extra_eval_sources`` by metric name (``eval_<name>/``): encoded held-out sets of
    ``eval_prompts`` prompts at most (arguments as for :func:`prompt_sets`)."""
    encode = make_encoder(data, tokenizer, first_turn=first_turn, tools=tools)
    sets: dict[str, EncodedPrompts] = {}
    for source in data.extra_eval_sources or ():
        name = eval_set_name(source)
        if name in sets:
            raise PromptSetError(f"data.extra_eval_sources: two sets are named {name!r}")
        records = source_records(
            data, source, data.eval_split, eval_set=True, seed=seed, eval_prompts=eval_prompts
        ).records
        sets[name] = encode(records[:eval_prompts])
    return sets
