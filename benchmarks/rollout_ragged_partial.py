"""Partial rollouts against synchronous rollouts on the ragged workload, pod regime, in one run.

The workload of ``benchmarks/rollout_ragged.py`` (prompts of 32-256 tokens, per-row budgets
log-normal with sigma 1, no stop ids: a row ends at its own budget) over ``--steps`` RL steps,
with ``decode_slots`` = the rows of one synchronous step (``--groups`` B x ``--n``): every
sequence of a synchronous step is in a slot at once, nothing refills the slots while the tail
finishes. Both arms draw their new prompts from one list in the same order; a prompt's rows keep
their budgets wherever they run (a carried row's tokens count against its own budget).

* sync: each step one call of B new groups, every row to its end (``quota=None``);
* partial: :class:`~delta_jax.rl.partial.PartialRollouts` with ``extra`` groups of
  over-provision (``--over`` times B, default 1; several values may be given): each step its
  planned call (the carried groups first, then new prompts) with ``quota=B``; useful tokens are
  the tokens of the returned groups' rows, those drawn in earlier steps included. The tokens
  the buffer holds when the steps end are drawn but not counted; the "+held" ratio counts them
  (the long-run rate, where the buffer keeps its size and every drawn token is returned).

CPU (``tiny`` config of ``bench_models``, real ``Sampler(engine="continuous")`` calls,
temperature 1): useful tokens/s with XLA's compile events taken out, occupancy (generated
tokens / slot-steps, ``EngineStats``). On a CPU a decode step costs about in proportion to the
rows it runs, which flatters the synchronous arm's sparse tail (its chunks shrink to fewer rows).

TPU (``--tpu``, compile-only, libtpu): the same schedule at the paper's lengths (Qwen3-8B bf16 on
v5p-64 as the sampling mesh, ``--tpu-prompts`` groups per data group a step, prompts 256-2,048
tokens, budgets x20 capped at 20,480) run through the engine's host scheduler with a stand-in for
the device programs; each decode step charged as ``rollout_ragged.tpu_bytes`` charges the
engine's (the compiler's pool-independent bytes per step, at its slot bucket on the line between
the smallest bucket and all slots; the kernel's pages copied, the K/V written, a page per joining
sequence; as long as its busiest data group's), each prefill call (prompts, and for partial
the carried rows' prompts and tokens prefilled again) the compiler's figures for the prefill
program on the TPU engine's path (a call of fewer rows, or of a shorter chunk, on the line
through the compiled call and one of half its tokens) plus what its ragged paged attention
kernel does, which the
compiler does not see (each block of a row's queries reads the row's K/V up to its last
position and attends to all of it, masked: 4 L N_q D FLOPs per query and key), and both turned
into time at v5p's peak FLOP/s and HBM bandwidth (``delta_jax.plan.roofline.CHIPS``, a bound
per program: ``max(FLOPs / peak, bytes / bw)``).

    python benchmarks/rollout_ragged_partial.py --steps 8 --groups 4 --n 8 --mean-new 100 --cap 512
    python benchmarks/rollout_ragged_partial.py --skip-cpu --tpu --over 1 2 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np
from bench_models import bench_config
from flax import nnx
from rollout_ragged import (
    CompileTime,
    StandInPrograms,
    _pool_slope,
    _token_kv_bytes,
    workload,
)

from delta_jax.data import PromptRecord
from delta_jax.models import Transformer
from delta_jax.rl.partial import PartialRollouts
from delta_jax.sampling import Buckets, Carry, Sampler
from delta_jax.sampling.attention.paged import PALLAS_PREFILL_QUERIES_PER_BLOCK


def stream(args, groups: int, vocab: int, scale: int = 1, seed: int = 0):
    """Enough prompts for every arm (``steps`` x B + the largest over-provision) and per-row
    budgets (log-normal, mean ``--mean-new`` x ``scale``, capped at ``--cap`` x ``scale``)."""
    count = args.steps * groups + max(args.over) * groups
    return workload(count, args.n, args.mean_new * scale, args.cap * scale, vocab, seed)


def cpu_call(sampler: Sampler, prompts, budgets, **kw):
    """One timed call: ``(output, seconds without compiles, compile seconds)``."""
    with CompileTime() as compile_time:
        start = time.perf_counter()
        out = sampler.generate(prompts, max_new_tokens=budgets, temperature=1.0, **kw)
        out.length_array.block_until_ready()
        wall = time.perf_counter() - start
    return out, wall - compile_time.seconds, compile_time.seconds


class CpuArm:
    """One arm's state over the steps (``extra`` None: synchronous) and its totals."""

    def __init__(self, n: int, groups: int, extra: int | None):
        self.n, self.groups, self.taken = n, groups, 0
        self.buffer = PartialRollouts(n, groups, extra) if extra else None
        self.total = dict(useful=0, generated=0, slot_steps=0, seconds=0.0, compile=0.0)

    def step(self, sampler: Sampler, prompts, budgets, step: int) -> None:
        n, buffer = self.n, self.buffer
        count = self.groups if buffer is None else buffer.fresh_needed
        batch = list(range(self.taken, self.taken + count))
        self.taken += count
        if buffer is None:
            kw, ids = dict(n=n, seed=1000 + step), [prompts[i] for i in batch]
        else:
            fresh = [(prompts[i], PromptRecord(prompt="", answer=None, row=i)) for i in batch]
            plan = buffer.plan(fresh, version=step, seed=2000 + step)
            kw, ids = plan.generate_kwargs(), plan.prompts
            batch = [record.row for record in plan.records]  # carried groups first
        rows = [budgets[i * n + j] for i in batch for j in range(n)]
        out, seconds, compile_s = cpu_call(sampler, ids, rows, **kw)
        if buffer is None:
            useful = sum(out.lengths)
        else:
            useful = sum(sum(g.lengths) for g in buffer.take(plan, out)[0])
        stats, total = out.engine_stats, self.total
        total["useful"] += useful
        total["generated"] += stats.useful_steps
        total["slot_steps"] += stats.decode_steps
        total["seconds"] += seconds
        total["compile"] += compile_s


def cpu_table(args) -> None:
    """The arms interleaved step by step (the order rotating), on the CPU."""
    cfg = bench_config("tiny")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    B, n = args.groups, args.n
    prompts, budgets = stream(args, B, cfg.vocab_size)
    sampler = Sampler(
        model,
        stop_token_ids=(),
        buckets=Buckets(max_cache_length=256 + args.cap),
        engine="continuous",
        decode_slots=B * n,
        page_size=args.page_size,
        decode_chunk=args.chunk,
    )
    print(
        f"CPU: tiny config, {args.steps} steps of {B} groups x {n} samples on {B * n} slots, "
        f"prompts 32-256 tokens, budgets log-normal mean {np.mean(budgets):.0f} (cap {args.cap}), "
        f"decode chunk {args.chunk}, arms interleaved, {jax.devices()[0].platform}"
    )
    arms = {"sync": CpuArm(n, B, None)} | {f"partial +{k}B": CpuArm(n, B, k * B) for k in args.over}
    names = list(arms)
    for step in range(args.steps):
        for name in names[step % len(names) :] + names[: step % len(names)]:
            arms[name].step(sampler, prompts, budgets, step)
    print(
        f"{'arm':12s} {'s':>7s} {'compile':>8s} {'useful':>7s} {'gen':>7s} {'tok/s':>7s} "
        f"{'occ':>5s} {'x sync':>6s} (+held)"
    )
    base = arms["sync"].total["useful"] / arms["sync"].total["seconds"]
    for name, arm in arms.items():
        r = arm.total
        rate = r["useful"] / r["seconds"]
        print(
            f"{name:12s} {r['seconds']:7.1f} {r['compile']:8.1f} {r['useful']:7d} "
            f"{r['generated']:7d} {rate:7.0f} {r['generated'] / r['slot_steps']:5.3f} "
            f"{rate / base:5.2f}x {r['generated'] / r['seconds'] / base:6.2f}x"
        )


@dataclasses.dataclass
class Standin(StandInPrograms):
    """The device programs' stand-in (``sampling.engine.protocol.DevicePrograms``): runs the
    decode steps on the slots' host state (a row ends at its budget) and records what each
    program call touches; tokens are never drawn (only lengths price a call)."""

    block: int  # tokens per block of the ragged paged attention kernel's page copies
    groups: int  # data groups (a decode step is as long as its busiest group's)
    # per decode step: (rows, kernel tokens copied, the same for the busiest group x groups)
    steps: list = dataclasses.field(default_factory=list)
    # per prefill call: (rows x chunk length, tokens, the kernel's K/V tokens read, query x key
    # pairs): the ragged paged attention kernel runs a row's queries in blocks of ``queries``
    # (a block spans rows when they are shorter), and each block reads, and attends to, its rows'
    # K/V up to the row's last position in blocks of ``block`` tokens, masked
    prefills: list = dataclasses.field(default_factory=list)
    joins: int = 0  # sequences that copied the partial last page of their prompt
    chunks: int = 0  # decode calls (host round trips)
    queries: int = PALLAS_PREFILL_QUERIES_PER_BLOCK

    def prefill(self, ids, positions, valid, pages):
        T = ids.shape[1]
        kv_len = np.where(valid[:, 0], positions[:, -1] + 1, T)  # an empty row: its scratch
        keys = -(-kv_len // self.block) * self.block
        visits = -(-T // self.queries)  # query blocks per row
        reads, pairs = int(visits * keys.sum()), int(T * keys.sum())
        self.prefills.append((ids.size, int(valid.sum()), reads, pairs))

    def decode(self, packed, pages, steps_left, refill=0):
        from delta_jax.sampling.attention.pages import SCRATCH_PAGE
        from delta_jax.sampling.engine.requests import SLOT_FIELDS

        st = {name: packed[:, i] for i, name in enumerate(SLOT_FIELDS)}
        self.joins += int((st["copy_dst"] != SCRATCH_PAGE).sum())
        count, pos, active = st["count"].copy(), st["pos"].copy(), st["active"] > 0
        live, steps = active.copy(), 0
        self.chunks += 1
        while steps < steps_left and active.any():
            if refill and (live & ~active).sum() >= refill:  # as the engine's chunk does
                break
            kv = np.where(active, pos + 1, 0)  # an idle row: one block of scratch pages
            blocks = np.ceil(np.maximum(kv, 1) / self.block).reshape(self.groups, -1).sum(1)
            self.steps.append((kv.size, blocks.sum(), blocks.max() * self.groups))
            count, pos = count + active, pos + active
            active &= count < st["max_new"]
            steps += 1
        return np.stack([st["last"], pos, count, active.astype(np.int32)], axis=1)


def carry_of(seq) -> Carry:
    """A stand-in call's sequence as a carried row: its length and identity (zeros for ids)."""
    zeros = (0,) * seq.length
    seed = int(np.int32(seq.rng[0]).view(np.uint32))
    return Carry(zeros, zeros, zeros, seed, seq.rng[1], seq.rng[2], finished=not seq.unfinished)


def pod_arm(spec, prompts, budgets, args, groups: int, extra: int | None, block: int):
    """``--steps`` RL steps of one arm through the engine's host scheduler (``extra`` None:
    synchronous; else the buffer's plan and take as :class:`PartialRollouts` does them: the
    carried groups first, the first ``groups`` finished ones returned, the others kept).

    Returns the stand-in (what the programs touched) and the useful and generated tokens."""
    from delta_jax.sampling.engine import EngineRows, run_engine

    n, device, held = args.n, Standin(block, spec.groups), []
    taken = useful = generated = 0
    for _ in range(args.steps):
        fresh = list(range(taken, taken + groups + (extra or 0) - len(held)))
        taken += len(fresh)
        batch = [g for g, _ in held] + fresh
        carried = [c for _, rows in held for c in rows] + [None] * (len(fresh) * n)
        rows = EngineRows(
            [np.asarray(prompts[i], np.int32) for i in batch],
            n,
            np.asarray([budgets[i * n + j] for i in batch for j in range(n)]),
            np.full((len(batch) * n, 1), -1, np.int32),
            carried=tuple(carried) if held else None,
        )
        seqs, stats = run_engine(spec, rows, device, quota=groups if extra else None)
        generated += stats.useful_steps
        returned, held = 0, []
        for g, prompt in enumerate(batch):
            group = seqs[g * n : (g + 1) * n]
            if returned < groups and not any(s.unfinished for s in group):
                returned += 1
                useful += sum(s.length for s in group)
            else:
                held.append((prompt, tuple(carry_of(s) for s in group)))
    return device, useful, generated


def pod_figures(cfg, mesh, rules, spec, cap_tokens: int, path: str | None) -> dict:
    """The TPU compiler's figures, all chips: one decode step at ``spec.slots`` slots and at the
    smallest slot bucket (bytes without the pool, as ``rollout_ragged.tpu_bytes`` takes them,
    and FLOPs; a chunk of the rows between is priced on the line between), and one prefill
    call of ``spec.prefill_rows`` rows x ``spec.prefill_len`` tokens on the TPU engine's path
    (the kernel's page tables; its attention is not in the compiler's figures: ``price`` adds
    it) with the part that grows with the pool taken out (two compiles, two pools). Read from
    ``path`` when it holds them (else compiled and written there)."""
    from delta_jax.plan.lowering import lower_prefill
    from delta_jax.sampling.attention import pages_for

    fig = json.loads(Path(path).read_text()) if path and Path(path).exists() else {}
    page, groups = spec.page_size, spec.groups
    table = 1 << (pages_for(cap_tokens, page) - 1).bit_length()
    sizes = (2049 * groups, 4097 * groups)
    if "decode_bytes" not in fig:
        fixed, slope, flops = _pool_slope(cfg, mesh, rules, spec.slots, table, page, sizes)
        fig.update(decode_bytes=fixed, decode_pool_slope=slope, decode_flops=flops)
    if "decode_small_bytes" not in fig:  # the smallest slot bucket a decode chunk runs
        small = spec.groups * spec.chunk_slots(1)
        fixed, _, flops = _pool_slope(cfg, mesh, rules, small, table, page, sizes)
        fig.update(decode_small_slots=small, decode_small_bytes=fixed, decode_small_flops=flops)
    if "prefill_token_bytes" not in fig:
        short = spec.prefill_rows // groups * pages_for(spec.prefill_len, page)
        runs = []
        for pool, T in ((8 * short, spec.prefill_len), (16 * short, spec.prefill_len),
                        (8 * short, spec.prefill_len // 2)):  # fmt: skip
            lower_spec = dataclasses.replace(spec, num_pages=groups * (pool + 1))
            lowered = lower_prefill(
                cfg, mesh, rules, lower_spec, length=T, list_pages=short, attention=spec.attention
            )
            cost = lowered.compile().cost_analysis()
            runs.append([float(cost[k]) * mesh.size for k in ("flops", "bytes accessed")])
        (f0, b0), (_, b2), (_, b1) = runs
        pool_bytes = 8 * short * groups * page * _token_kv_bytes(cfg)
        for key in [k for k in fig if k.startswith("prefill_")]:
            del fig[key]  # figures of another path's prefill program
        tokens = spec.prefill_rows * spec.prefill_len
        fig.update(
            prefill_attention=spec.attention,
            prefill_flops=f0,
            prefill_bytes=b0 - (b2 - b0),  # the 8-short pool's charge taken out
            prefill_pool_slope=(b2 - b0) / pool_bytes,  # whole pools charged per call
            # a line in the call's tokens (rows x chunk length): half the chunk saves this
            prefill_token_bytes=(b0 - b1) / (tokens / 2),
        )
    if path:
        Path(path).write_text(json.dumps(fig, indent=1) + "\n")
    return fig


def price(device: Standin, fig: dict, cfg, spec, chips: int, peak: float, bw: float) -> dict:
    """An arm's decode and prefill in HBM bytes and seconds (the bound per program call; a
    decode step as long as its busiest data group's, the groups run in step)."""
    kv = _token_kv_bytes(cfg)
    rows, copied, busiest = (np.array(x, float) for x in zip(*device.steps, strict=True))
    share = (rows - fig["decode_small_slots"]) / (spec.slots - fig["decode_small_slots"])
    fixed = fig["decode_small_bytes"] + share * (fig["decode_bytes"] - fig["decode_small_bytes"])
    flops = fig["decode_small_flops"] + share * (fig["decode_flops"] - fig["decode_small_flops"])
    step_bytes = fixed + (copied * device.block + rows) * kv  # weights..., K/V read and written
    step_time = fixed + (busiest * device.block + rows) * kv
    decode_s = np.maximum(flops / peak, step_time / bw).sum() / chips
    join_bytes = device.joins * 2 * spec.page_size * kv
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # FLOPs per query and key
    prefill_s = prefill_bytes = 0.0
    full = spec.prefill_rows * spec.prefill_len  # the compiled call's tokens
    for rows_T, tokens, keys_read, pairs in device.prefills:
        flops = fig["prefill_flops"] * rows_T / full + attention * pairs
        nbytes = fig["prefill_bytes"] - (full - rows_T) * fig["prefill_token_bytes"]
        nbytes += (tokens + keys_read) * kv  # K/V written and read by the kernel
        prefill_s += max(flops / peak, nbytes / bw) / chips
        prefill_bytes += nbytes
    return dict(
        steps=len(device.steps),
        slot_steps=rows.sum(),
        decode_bytes=step_bytes.sum() + join_bytes,
        decode_s=decode_s + join_bytes / bw / chips,
        fixed_s=fixed.sum() / bw / chips,  # the bytes a step reads whatever its rows' lengths
        prefill_calls=len(device.prefills),
        prefilled=sum(p[1] for p in device.prefills),
        prefill_fill=sum(p[1] for p in device.prefills)
        / max(1, sum(p[0] for p in device.prefills)),
        prefill_bytes=prefill_bytes,
        prefill_s=prefill_s,
    )


def tpu_table(args) -> None:
    """The pod-regime schedule at the paper's lengths, priced by the TPU compiler's figures."""
    from jax.experimental import topologies
    from jax.sharding import Mesh

    from delta_jax import sharding as sh
    from delta_jax.plan import known_model_config
    from delta_jax.plan.roofline import CHIPS
    from delta_jax.sampling import SAMPLING_RULES
    from delta_jax.sampling.attention import pages_for
    from delta_jax.sampling.attention.paged import PALLAS_KV_PAGES_PER_BLOCK
    from delta_jax.sampling.engine import EngineSpec

    cfg = known_model_config("Qwen3-8B")
    topo = topologies.get_topology_desc(topology_name=args.tpu_topology, platform="tpu")
    devices = np.array(topo.devices)
    mesh = sh.sampling_mesh(Mesh(devices.reshape(1, devices.size, 1), sh.AXES), cfg.num_kv_heads)
    groups, rules, page, scale = sh.batch_divisor(mesh, SAMPLING_RULES), SAMPLING_RULES, 16, 20
    peak, bw = CHIPS[args.tpu_topology.split(":")[0]]
    B, n, prompt_bucket = args.tpu_prompts * groups, args.n, 2048
    prompts, budgets = stream(args, B, 2, scale, seed=1)
    rng = np.random.default_rng(1)
    prompts = [[1] * int(rng.integers(256, prompt_bucket + 1)) for _ in prompts]
    longest = pages_for(prompt_bucket + args.cap * scale, page)
    spec = EngineSpec(
        slots=B * n,
        steps=args.chunk,
        page_size=page,
        num_pages=B * n * longest + groups,
        seq_pages=longest,
        max_table=1 << (longest - 1).bit_length(),
        prefill_len=prompt_bucket,
        min_len=16,
        prefill_rows=8 * groups,
        groups=groups,
        attention="pallas",
        return_hidden=False,
        pad_id=0,
    )
    block = PALLAS_KV_PAGES_PER_BLOCK * page
    fig = pod_figures(cfg, mesh, rules, spec, prompt_bucket + args.cap * scale, args.tpu_figures)
    print(
        f"TPU: Qwen3-8B bf16, {args.tpu_topology} ({devices.size} chips) as the sampling mesh "
        f"{dict(mesh.shape)}; {args.steps} steps of {B} groups x {n} samples on {B * n} slots "
        f"({groups} data groups x {B * n // groups}); prompts 256-{prompt_bucket}, budgets "
        f"log-normal mean {np.mean(budgets):.0f} (cap {args.cap * scale}); decode chunk "
        f"{args.chunk}. TPU compiler, all chips: decode step {fig['decode_bytes'] / 2**30:.1f} "
        f"GiB without the pool at {spec.slots} slots ({fig['decode_small_bytes'] / 2**30:.1f} at "
        f"{fig['decode_small_slots']}), {fig['decode_flops'] / 1e12:.2f} TFLOP; prefill call "
        f"{spec.prefill_rows} x {prompt_bucket} tokens on the kernel's path "
        f"{fig['prefill_bytes'] / 2**30:.1f} GiB without the pool and the kernel's K/V reads "
        f"(-{fig['prefill_token_bytes'] / 2**20:.2f} MiB a token fewer), "
        f"{fig['prefill_flops'] / 1e12:.1f} TFLOP without its attention; kernel blocks of "
        f"{PALLAS_PREFILL_QUERIES_PER_BLOCK} queries x {block} keys; v5p {peak / 1e12:.0f} "
        f"TFLOP/s, {bw / 1e9:.0f} GB/s per chip"
    )
    print(
        "occ: generated tokens / (decode steps x slots); decode = fixed s (the bytes a step "
        "reads whatever its rows' lengths: weights...) + K/V s (pages read, K/V written); "
        "prefill: the prompts, and "
        "for partial the carried rows' prompts and tokens again (pf fill: tokens / the calls' "
        "rows x chunk length); useful: the returned groups' "
        "tokens (held: drawn and kept in the buffer at the end); x sync: tok/s over sync's"
    )
    print(
        f"{'arm':11s} {'steps':>7s} {'occ':>5s} {'useful M':>8s} {'held M':>6s} "
        f"{'fixed s':>7s} {'K/V s':>6s} {'prefill s':>9s} {'pf Mtok':>7s} {'pf fill':>7s} "
        f"{'MiB/tok':>7s} "
        f"{'us/tok':>6s} {'tok/s':>6s} {'x sync':>6s} {'(+held)':>7s}"
    )
    arms = {"sync": None} | {f"partial +{k}B": k * B for k in args.over}
    base = None
    for name, extra in arms.items():
        device, useful, generated = pod_arm(spec, prompts, budgets, args, B, extra, block)
        p = price(device, fig, cfg, spec, devices.size, peak, bw)
        seconds = p["decode_s"] + p["prefill_s"]
        base = base or useful / seconds
        print(
            f"{name:11s} {p['steps']:7d} {generated / (p['steps'] * B * n):5.3f} "
            f"{useful / 1e6:8.3f} {(generated - useful) / 1e6:6.3f} {p['fixed_s']:7.1f} "
            f"{p['decode_s'] - p['fixed_s']:6.1f} {p['prefill_s']:9.2f} "
            f"{p['prefilled'] / 1e6:7.2f} {p['prefill_fill']:7.3f} "
            f"{(p['decode_bytes'] + p['prefill_bytes']) / useful / 2**20:7.1f} "
            f"{seconds / useful * 1e6:6.2f} {useful / seconds:6.0f} "
            f"{useful / seconds / base:5.2f}x {generated / seconds / base:6.2f}x",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=4, help="CPU: groups a step trains on (B)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--over", type=int, nargs="+", default=[1], help="extra groups / B")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--mean-new", type=float, default=200.0)
    ap.add_argument("--cap", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--tpu", action="store_true", help="add the TPU compile-only figures")
    ap.add_argument("--tpu-topology", default="v5p:4x4x2", help="v5p:4x4x2 is v5p-64")
    ap.add_argument("--tpu-prompts", type=int, default=8, help="groups a step per data group")
    ap.add_argument("--tpu-figures", help="JSON of the compiler's figures (read, or written)")
    ap.add_argument("--skip-cpu", action="store_true")
    args = ap.parse_args()
    if not args.skip_cpu:
        cpu_table(args)
    if args.tpu:
        tpu_table(args)


if __name__ == "__main__":
    main()
