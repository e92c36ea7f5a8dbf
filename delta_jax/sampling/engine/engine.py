"""Continuous-batching rollout engine over a paged KV cache.

The static sampler runs a batch until its longest row ends and attends over every cache slot at
every step; with ragged RL lengths most of that work is spent on finished rows and empty slots.
This engine keeps ``decode_slots`` sequences running instead:

1. every ``(prompt, sample)`` pair is a *sequence*; they wait in a queue, longest
   ``max_new_tokens`` first (so that no long sequence is left running alone at the end);
2. a free slot takes the next sequence. Its prompt, if not resident yet, is *prefilled* once into
   pages of the pool (all but its last token, in chunks of a bucketed length); the ``n`` samples
   of a prompt share those pages read-only. A sample owns the pages from the prompt's last
   (partially filled) page on: that page is copied into the sample's own page when it joins, so
   no sample ever writes into a shared page;
3. the *decode program* runs ``k`` steps on device (``lax.while_loop``): every live slot feeds its
   last token (first the prompt's last token), writes its K/V into its pages and draws the next
   token, written with its log-probs (and hidden state) straight into the request's output
   buffers on device, at the sequence's row and token index. The host then reads back only the
   slots' status (one small array: which ended, stop token or their own ``max_new_tokens``),
   frees their pages, refills the slots and allocates pages for the next ``k`` steps. Once
   every queue is empty (no slot can be refilled), the next chunk runs all that is left
   (the chunk length is a traced value); the buffers are read once, at the end;
4. when the pool runs out, the youngest running sequence is preempted (pages freed, put back at
   the front of the queue, recomputed later) instead of failing;
5. multi-turn requests (:class:`Turns`): a sequence that ends a turn leaves its slot but keeps
   its pages while the host answers (a tool runs, in a pool of its own); the observation's ids
   are written into its output row and prefilled into its own pages from where the turn ended,
   and it re-joins a free slot. The history is prefilled once; only a sequence preempted after
   a hand-over prefills its context again (from the host's copy). Sequences waiting on the
   host are preempted last.
6. partial rollouts: with a ``quota`` the call stops once that many prompts have all their
   samples ended (after that chunk), and the sequences left come back unfinished, their pages
   freed; a later call continues such *carried* rows (their tokens written into their output
   rows, prompt and tokens prefilled into their own pages as after a multi-turn preemption),
   each drawing with the RNG identity (seed, prompt, sample) of the call that started it.

On a mesh the engine is data parallel: the ``decode_slots`` slots and the pool's pages split
evenly over the *data groups* (the row shards of the sampling mesh, e.g. 4 groups of 8 chips for
Qwen3-8B on v5p-64), and every group is an engine of its own: its slot set, its page allocator
(group-local page indices) and its queue. Each prompt goes to one group, with all its ``n``
samples (they share its pages), prompts spread by work (:func:`assign_groups`); a group's
programs read and write only its own pages and attend for its own slots (``shard_map``). One
device call still serves every group at once, so the host rounds stay in step.

Every sequence draws token ``t`` with the key ``fold_in(fold_in(fold_in(key(seed), prompt),
sample), t)``, so its tokens do not depend on the slot count, the slot order or preemptions.
Programs have fixed shapes: slots (``decode_slots`` capped at the request's rows), the output
buffers and the pool are fixed per request bucket, the chunk length is traced; the XLA
path's flat page list has one length per request bucket (it stops reading at the last real
entry, so attention work follows the actual lengths), the Pallas and dense (CPU) paths' page
tables are as wide as the request's longest sequence (the kernels read a row's pages up to its
length), a decode chunk runs one of at most five slot buckets and prefill lengths are
power-of-two buckets; each program compiles once.

The engine is cut along its seams: :mod:`~delta_jax.sampling.engine.scheduler` is the host side
(requests, slots, pages, turns, stats; NumPy only), :mod:`~delta_jax.sampling.engine.chunk` and
:mod:`~delta_jax.sampling.engine.decode` the device programs as pure functions,
:mod:`~delta_jax.sampling.engine.programs` compiles them and owns their state,
:mod:`~delta_jax.sampling.attention.paged` is the paged forward pass and its attention paths,
and :mod:`~delta_jax.sampling.speculation.decoding` how a request's chunks decode (plain decode
steps, or verify steps of drafts), one object whichever way. This module puts them together for
one request.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax.models import Transformer
from delta_jax.sampling.attention.backends import backend_for
from delta_jax.sampling.attention.paged import Groups
from delta_jax.sampling.buckets import RequestArrays
from delta_jax.sampling.engine.decode import RequestInputs
from delta_jax.sampling.engine.programs import EnginePrograms, ProgramCache
from delta_jax.sampling.engine.protocol import DevicePrograms
from delta_jax.sampling.engine.requests import (
    EngineRows,
    EngineSpec,
    EngineStats,
    Prompt,
    Seq,
    Turns,
    assign_groups,
    output_rows,
    turn_stops,
    validate_engine_request,
)
from delta_jax.sampling.engine.scheduler import Scheduler
from delta_jax.sampling.output import SamplerOutput
from delta_jax.sampling.speculation.decoding import PLAIN, Speculation

__all__ = ["EngineSetup", "generate_continuous", "run_engine"]


@functools.partial(jax.jit, static_argnames="pad_id")
def _assemble(buffers, index, lengths, prompt_ids, prompt_mask, repeat, *, pad_id):
    """The request's rows of the output buffers in row order (positions at or after a row's
    length hold ``pad_id`` / 0: a preempted sequence's first run may have written there), its
    lengths and longest length, and each row's prompt (``repeat``: its prompt's index); one
    call for everything the output holds."""
    G = buffers["tokens"].shape[1]
    valid = jnp.arange(G)[None, :] < lengths[:, None]
    out = {}
    for name, buf in buffers.items():
        rows = jnp.take(buf, index, axis=0)
        mask = valid.reshape(valid.shape + (1,) * (rows.ndim - 2))
        out[name] = jnp.where(mask, rows, pad_id if name == "tokens" else 0)
    out["lengths"], out["steps"] = lengths, jnp.max(lengths)
    out["prompt_ids"] = jnp.take(prompt_ids, repeat, axis=0)
    out["prompt_mask"] = jnp.take(prompt_mask, repeat, axis=0)
    return out


def run_engine(
    spec: EngineSpec,
    rows: EngineRows,
    programs: DevicePrograms,
    on_done=None,
    turns: Turns | None = None,
    read=None,
    speculation: Speculation = PLAIN,
    quota: int | None = None,
) -> tuple[list[Seq], EngineStats]:
    """Runs every (prompt, sample) sequence of ``rows`` to its end (or until ``quota`` prompts
    have all their samples ended); returns them in row order and stats.

    ``on_done(seqs)``, when given, is called with the sequences that ended in each host round
    (their outputs are final), while the others are still being decoded.

    ``programs`` runs the device programs on the pool and the output buffers, which it owns
    (:class:`DevicePrograms`); the host sends the page layout of ``spec.attention``'s backend
    (its host half, which no mesh changes).

    ``turns`` (multi-turn requests, :class:`Turns`) needs ``read(seqs)``: the sequences'
    output tokens ``[:length]`` as lists, read when their turns end.

    ``speculation``: how the chunks decode
    (:class:`~delta_jax.sampling.speculation.decoding.Speculation`: plain decode steps, or verify
    steps of drafts, ``spec.draft_tokens > 0``); it learns of the request's start here and of its
    end (a drafter's texts join its history).

    Partial rollouts: ``rows.carried`` continues rows of an earlier call (their tokens written
    into their output rows, prompt and tokens prefilled into their own pages, drawing on with
    their own RNG identity; rows that had ended are returned as they are), and ``quota`` stops
    the call once that many prompts have all their samples ended (the sequences left are
    returned unfinished, ``Seq.unfinished``).
    """
    prompts, n, max_new = rows.prompts, rows.n, rows.max_new
    owner = assign_groups(prompts, n, max_new, spec.groups)
    local, _ = output_rows(owner, n, spec.groups)
    records = [Prompt(ids=p, group=owner[i], left=n) for i, p in enumerate(prompts)]
    seed = int(np.uint32(rows.seed).view(np.int32))
    carried = rows.carried or (None,) * (len(prompts) * n)
    seqs = [
        _sequence(r, n, int(max_new[r]), rows.stop_ids[r], int(local[r]), seed, carried[r])
        for r in range(len(prompts) * n)
    ]
    done = [s for s in seqs if carried[s.index] is not None and carried[s.index].finished]
    for seq in done:
        records[seq.prompt].left -= 1
    # Longest budget first: a long sequence admitted last would run on alone while the other
    # slots idle. The order changes no token (each sequence has its own RNG stream).
    queued = sorted((s for s in seqs if s not in done), key=lambda s: -s.max_new)
    groups = [[s for s in queued if owner[s.prompt] == g] for g in range(spec.groups)]
    backend = backend_for(spec.attention)
    speculation.begin(prompts, n)
    for seq in seqs:
        if seq.history:  # a carried row's text goes on from its tokens
            speculation.extend(seq.index, seq.history)
    scheduler = Scheduler(
        spec, records, groups, programs, backend, on_done, turns, read, speculation, quota
    )
    done = scheduler.run(done)
    speculation.finish()
    done.sort(key=lambda s: (s.prompt, s.sample))
    return done, scheduler.stats


def _sequence(r: int, n: int, max_new: int, stops, row: int, seed: int, carry) -> Seq:
    """Request row ``r``'s sequence: fresh (its RNG identity the request's ``seed`` and its own
    prompt and sample), or continuing ``carry`` (a :class:`Carry`: its tokens so far, its
    identity)."""
    seq = Seq(prompt=r // n, sample=r % n, max_new=max_new, stops=stops, row=row, index=r)
    seq.rng = (seed, r // n, r % n)
    if carry is not None:
        tokens = np.asarray(carry.tokens, np.int32)
        seq.carried = (tokens, np.asarray(carry.logprobs), np.asarray(carry.untruncated))
        seq.rng = (int(np.uint32(carry.seed).view(np.int32)), carry.prompt, carry.sample)
        seq.length = tokens.size
        seq.history = tokens.tolist() or None
        seq.observed, seq.turns = [tuple(r) for r in carry.observed], carry.turns
    return seq


@dataclasses.dataclass(frozen=True)
class EngineSetup:
    """What the sampler hands the engine for one call: the call's static configuration
    (``Sampler.engine_spec``), its :class:`ProgramCache`, the KV pages' dtype and how its
    chunks decode (:class:`~delta_jax.sampling.speculation.decoding.Speculation`: plain decode
    steps, or, with ``spec.draft_tokens > 0``, verify steps of the drafts of a
    :class:`~delta_jax.sampling.speculation.decoding.Drafting`, kept across requests: its
    history)."""

    spec: EngineSpec
    programs: ProgramCache
    cache_dtype: Any
    speculation: Speculation = PLAIN


def generate_continuous(
    model: Transformer,
    request: RequestArrays,
    rows: EngineRows,
    strategy,
    params,
    *,
    setup: EngineSetup,
    on_sample_done=None,
    turns: Turns | None = None,
    quota: int | None = None,
) -> tuple[SamplerOutput, EngineStats]:
    """The engine behind ``Sampler(engine="continuous").generate``; same output as the static one.

    The sampler hands over what the engine needs (:class:`EngineSetup`) and the request's rows
    (:class:`EngineRows`: its prompts, samples, seed and carried rows; ``request`` holds their
    arrays). ``params``: the parameters to sample with (None: the model's own).
    ``on_sample_done(row, tokens)`` gets each request row's generated ids as soon as it ends,
    while the others decode. ``turns``: a multi-turn request (:class:`Turns`); the output's
    ``action_mask_array`` then marks the sampled tokens. ``quota``: partial rollouts, see
    :func:`run_engine`.

    Returns:
      ``(SamplerOutput, EngineStats)``.
    """
    spec, programs = setup.spec, setup.programs
    prompts, n = rows.prompts, rows.n
    validate_engine_request(spec, prompts, n, request.max_new)
    # The attention path, picked once, for programs on the sampler's mesh.
    backend = backend_for(spec.attention, Groups(programs.mesh, model.config.num_kv_heads))
    if refusal := backend.refusal(spec):
        raise ValueError(refusal)
    stop_ids = request.stop_ids
    turn_ids, stop_sequences = turn_stops(turns)
    if turns is not None:  # a turn's end stops the sequence too; the host tells them apart
        extra = np.broadcast_to(turn_ids, (len(stop_ids), turn_ids.size))
        stop_ids = np.concatenate([stop_ids, extra], axis=1)
    owner = assign_groups(prompts, n, request.max_new, spec.groups)
    local, block = output_rows(owner, n, spec.groups)
    inputs = RequestInputs(strategy, np.bool_(turns is not None), stop_sequences)
    device = EnginePrograms(
        programs,
        model,
        spec,
        backend,
        params,
        inputs,
        cache_dtype=setup.cache_dtype,
        width=stop_ids.shape[1],
        rows=spec.groups * block,
        gen_len=request.gen_len,
    )

    def read(seqs: list[Seq]) -> list[list[int]]:
        at = np.array([owner[s.prompt] * block + local[s.index] for s in seqs], np.int32)
        tokens = device.peek(at)
        return [tokens[i, : s.length].tolist() for i, s in enumerate(seqs)]

    on_done = None
    if on_sample_done is not None:

        def on_done(seqs: list[Seq]) -> None:  # one read of the rows that ended this round
            for seq, tokens in zip(seqs, read(seqs), strict=True):
                on_sample_done(seq.index, tokens)

    rows = dataclasses.replace(rows, max_new=request.max_new, stop_ids=stop_ids)
    seqs, stats = run_engine(spec, rows, device, on_done, turns, read, setup.speculation, quota)
    # Global buffer row of each request row: its group's block, then its row in the block.
    index = np.array([owner[r // n] * block + local[r] for r in range(len(seqs))], np.int32)
    return _output(device.results(), seqs, index, request, n, spec.pad_id, turns), stats


def _unsigned(bits: int) -> int:
    """The uint32 seed of its int32 bits."""
    return int(np.int32(bits).view(np.uint32))


def _output(buffers, seqs: list[Seq], index, request, n: int, pad_id: int, turns):
    """The :class:`SamplerOutput` of the finished sequences, in row order."""
    rows = len(seqs)
    lengths = np.array([s.length for s in seqs], np.int32)
    repeat = np.repeat(np.arange(rows // n), n).astype(np.int32)
    out = _assemble(
        buffers,
        index,
        lengths,
        request.prompt_ids,
        request.prompt_mask,
        repeat,
        pad_id=pad_id,
    )
    output = SamplerOutput(
        token_array=out["tokens"],
        logprob_array=out["logprobs"],
        untruncated_logprob_array=out["untruncated"],
        length_array=out["lengths"],
        hidden_array=out.get("hidden"),
        prompt_array=out["prompt_ids"],
        prompt_mask_array=out["prompt_mask"],
        num_steps=out["steps"],
        num_rows=rows,
        drafted_array=out.get("drafted"),
        finished_array=np.array([not s.unfinished for s in seqs]),
        key_array=np.array([[_unsigned(s.rng[0]), *s.rng[1:]] for s in seqs], np.int64),
    )
    if turns is not None:
        actions = np.arange(request.gen_len)[None, :] < lengths[:, None]
        for r, seq in enumerate(seqs):
            for start, end in seq.observed:
                actions[r, start:end] = False
        turns_done = np.array([s.turns for s in seqs], np.int64)
        output = dataclasses.replace(
            output, action_mask_array=jnp.asarray(actions), turns_array=turns_done
        )
    return output
