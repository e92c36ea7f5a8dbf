"""Every program a run compiles, known from its config (``delta-jax plan --programs``).

A run's shapes follow its config, not its lengths (``docs/cli.md``, Compiled programs): the
train step has one program (micro-batches of ``algo.micro_batch_rows``; or, ``bucketed``, one
per bucket of rows in a micro-batch: :func:`~delta_jax.rl.packing.row_buckets`; its window is a
row wide whatever the responses),
the engine's page tables one width per request shape. The engine adds its decode chunk at each
slot bucket (:meth:`~delta_jax.sampling.engine.requests.EngineSpec.chunk_slots`: a power of two from
an eighth of a group's slots up to all of them, so the ragged tail of a rollout stops paying for
idle slots) and its prefill chunk at each length bucket
(:meth:`~delta_jax.sampling.engine.requests.EngineSpec.prefill_length`). This module lists that set
for the plan's request and compiles each member, so the report gives the compile time of every
program a step can meet (the TPU compiler's, compile-only, on a TPU topology).
"""

from __future__ import annotations

from collections.abc import Callable

from delta_jax import sharding as sh
from delta_jax.plan.programs import Planner
from delta_jax.plan.report import ProgramMemory
from delta_jax.rl.packing import row_buckets


def engine_buckets(spec) -> tuple[list[int], list[int]]:
    """``(decode chunk slots per group, prefill lengths)`` of an engine of ``spec``: what it
    compiles at the first request of that shape (``Scheduler._compile_chunks``)."""
    S, longest = spec.group_slots, spec.seq_pages * spec.page_size
    slots = sorted({spec.chunk_slots(occupied) for occupied in range(1, S + 1)})
    lengths = sorted({spec.prefill_length(n) for n in range(1, longest + 1)})
    return slots, lengths


def compile_buckets(
    planner: Planner, spec, train: dict[int, ProgramMemory], log: Callable[[str], None]
) -> list[tuple[str, ProgramMemory]]:
    """Compiles every program of the set and returns ``(name, its memory and compile time)``
    per program: the train step at each bucket of rows (``train``: those the plan compiled
    already, by rows; empty: the train step is left out) and the engine's programs."""
    programs = []
    if train:
        divisor = sh.batch_divisor(planner.mesh)
        buckets = row_buckets(planner.update_plan, divisor)
        log(f"compiling the train step at {buckets} rows per micro-batch")
        for rows in buckets:
            memory = train.get(rows) or planner.train(rows)
            programs.append((f"train step, {rows} rows per micro-batch", memory))
    slots, lengths = engine_buckets(spec)
    log(f"compiling the engine's decode chunks at {slots} slots per group")
    for per_group in slots:
        memory = planner.decode(spec, per_group * spec.groups)
        programs.append((f"decode chunk, {per_group} slots per group", memory))
    log(f"compiling the engine's prefill chunks of {lengths} tokens")
    for length in lengths:
        memory = planner.prefill(spec, length)
        programs.append((f"prefill chunk, {length} tokens per row", memory))
    return programs
