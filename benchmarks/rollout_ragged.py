"""Static sampler vs the continuous-batching engine on a ragged RL-like workload, in one run.

Workload (fixed seed): ``--prompts`` prompts x ``--n`` samples, prompt lengths uniform in
[32, 256], per-row ``max_new_tokens`` log-normal (sigma 1) with mean ``--mean-new`` capped at
``--cap``, no stop ids (every row runs to its own limit), temperature 1, on the ``tiny`` config of
``bench_models``. Reported per engine: useful (generated, non-padding) tokens/s with the
compilation time taken out (XLA's backend-compile events, summed, are subtracted from the call's
wall time and reported apart), and the slot occupancy (useful tokens / slot-steps run).

``--tpu`` adds the TPU compiler's view (compile-only, libtpu) for Qwen3-8B in bfloat16 on the
whole of v5p-64 (``--tpu-topology`` v5p:4x4x2, 32 chips) regrouped as the sampler runs it,
``sharding.sampling_mesh``: data 4 x tensor 8 (tensor = gcd(KV heads, chips)), at the paper's
lengths: HBM bytes accessed per useful token over the whole decode of one workload
(``--tpu-prompts`` x ``--n`` rows per data group, prompts 256-2,048 tokens, responses the same
log-normal scaled by 20, capped at 20,480):

* static: the compiler's bytes for one decode step of every row (rows split over the data
  groups) over a 2,048 + 20,480 cache, times the steps it runs (the longest row);
* engine: ``--tpu-slots`` slots per data group, each group over its own share of the pool; the
  steps its own scheduler runs on this workload (run on the host with a stand-in for the
  device; prompts spread over the groups as the engine does), each charged the compiler's
  bytes for one decode program of one step (its once-per-chunk work included, so an upper
  bound) with the part that grows with the pool taken out (from two pool sizes), plus what the
  cost model does not see: the pages the ragged paged attention kernel copies (each slot's
  pages up to its length, in whole kernel blocks, by its own group's chips only; the custom
  call is charged nothing for them), the K/V rows written and the page each joining sequence
  copies.

Usage::

    python benchmarks/rollout_ragged.py                       # 64 x 8, cap 1024, CPU only
    python benchmarks/rollout_ragged.py --skip-cpu --tpu      # TPU figures only
    python benchmarks/rollout_ragged.py --equal --prompts 16 --cap 128  # equal lengths
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_models import bench_config
from flax import nnx
from jax._src.dispatch import BACKEND_COMPILE_EVENT

from delta_jax.models import Transformer
from delta_jax.sampling import Buckets, Sampler


def workload(prompts: int, n: int, mean_new: float, cap: int, vocab: int, seed: int = 0):
    """Prompt id lists and per-row budgets (log-normal, sigma 1, the given mean, capped)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(32, 257, prompts)
    ids = [rng.integers(1, vocab, size).tolist() for size in lengths]
    sigma = 1.0
    budgets = rng.lognormal(np.log(mean_new) - sigma**2 / 2, sigma, prompts * n)
    return ids, np.clip(np.round(budgets), 1, cap).astype(int).tolist()


class CompileTime:
    """Seconds spent in XLA backend compilation while active."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self, event, duration, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            self.seconds += duration

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def run(sampler: Sampler, prompts, budgets, n: int) -> dict:
    with CompileTime() as compile_time:
        start = time.perf_counter()
        out = sampler.generate(prompts, max_new_tokens=budgets, n=n, temperature=1.0, seed=0)
        out.length_array.block_until_ready()
        wall = time.perf_counter() - start
    useful = int(sum(out.lengths))
    if out.engine_stats is None:
        slot_steps = out.token_array.shape[0] * int(out.num_steps)
    else:
        slot_steps = out.engine_stats.decode_steps
    assert out.lengths == budgets  # no stop ids: every row runs to its own limit
    return dict(
        wall=wall,
        compile=compile_time.seconds,
        useful=useful,
        tok_s=useful / (wall - compile_time.seconds),
        occupancy=useful / slot_steps,
    )


def cpu_table(args) -> None:
    cfg = bench_config("tiny")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    prompts, budgets = workload(args.prompts, args.n, args.mean_new, args.cap, cfg.vocab_size)
    shape = f"log-normal mean {np.mean(budgets):.0f} (max {max(budgets)}, cap {args.cap})"
    if args.equal:  # the static sampler's best case: no row waits for a longer one
        budgets, shape = [args.cap] * len(budgets), f"all {args.cap} (--equal)"
    print(
        f"tiny config, {args.prompts} prompts x {args.n} samples, prompts 32-256 tokens, "
        f"max_new_tokens {shape}, {jax.devices()[0].platform}"
    )
    # The tiny config's 512 positions are too few for 256 + 1024 tokens (random weights anyway).
    buckets = Buckets(max_cache_length=256 + args.cap)
    rows = {
        "static": Sampler(model, stop_token_ids=(), buckets=buckets),
        "engine": Sampler(
            model,
            stop_token_ids=(),
            buckets=buckets,
            engine="continuous",
            decode_slots=args.slots,
            page_size=args.page_size,
            decode_chunk=args.chunk,
        ),
    }
    results = {name: run(s, prompts, budgets, args.n) for name, s in rows.items()}
    print(f"{'':8s} {'wall s':>8s} {'compile s':>10s} {'useful tok':>11s} {'tok/s':>9s} occupancy")
    for name, r in results.items():
        print(
            f"{name:8s} {r['wall']:8.1f} {r['compile']:10.1f} {r['useful']:11d} "
            f"{r['tok_s']:9.0f} {r['occupancy']:9.3f}"
        )
    ratio = results["engine"]["tok_s"] / results["static"]["tok_s"]
    print(f"engine / static useful tokens/s: {ratio:.2f}x")


def _abstract_params(cfg, mesh, rules):
    from delta_jax.sharding import param_shardings

    bf16 = jnp.bfloat16
    abstract = nnx.eval_shape(lambda: Transformer(cfg, dtype=bf16, param_dtype=bf16))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    shardings = param_shardings(params, mesh, rules)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings
    )
    return graphdef, params, rest


def _static_step_bytes(cfg, mesh, rules, rows: int, slots: int) -> float:
    """TPU bytes accessed by one static decode step: ``rows`` rows over a ``slots`` cache."""
    from flax.core import spmd
    from jax.sharding import NamedSharding

    from delta_jax.models import KVCache
    from delta_jax.models.axes import logical_to_mesh
    from delta_jax.models.transformer import KEY_CACHE_AXES, VALUE_CACHE_AXES

    def spec(shape, dtype, names):
        sharding = NamedSharding(mesh, logical_to_mesh(names, rules, mesh, shape))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    graphdef, params, rest = _abstract_params(cfg, mesh, rules)
    c, bf16 = cfg, jnp.bfloat16
    k_shape = (rows, c.num_kv_heads, c.head_dim, slots)
    v_shape = (rows, c.num_kv_heads, slots, c.head_dim)
    cache = KVCache(
        k=tuple(spec(k_shape, bf16, KEY_CACHE_AXES) for _ in range(c.num_layers)),
        v=tuple(spec(v_shape, bf16, VALUE_CACHE_AXES) for _ in range(c.num_layers)),
        mask=spec((rows, slots), jnp.bool_, ("batch", None)),
        index=spec((), jnp.int32, ()),
    )

    def step(params, rest, cache, last, positions):
        model = nnx.merge(graphdef, params, rest)
        out = model(last[:, None], positions=positions[:, None], cache=cache)
        return out.logits, out.cache

    row = spec((rows,), jnp.int32, ("batch",))
    with jax.set_mesh(mesh), spmd.logical_axis_rules(rules):
        lowered = jax.jit(step, donate_argnums=(2,)).lower(params, rest, cache, row, row)
    return float(lowered.compile().cost_analysis()["bytes accessed"]) * mesh.size


class StandInPrograms:
    """The device programs' stand-in (``sampling.engine.protocol.DevicePrograms``) for running
    the engine's host scheduler alone: every program but ``decode`` (which a subclass runs on
    the slots' host state) does nothing."""

    def prefill(self, *arrays):
        return None

    def write(self, *arrays):
        return None

    def compile_decode(self, *arrays):
        return None

    def compile_prefill(self, *arrays):
        return None


def _engine_schedule(prompts, budgets, n: int, slots: int, chunk: int, page: int, groups: int):
    """Runs the engine's host scheduler on the workload with a stand-in for the device programs.

    Returns one entry per decode step the engine would run, the K/V lengths of the rows its
    chunk runs (0 for an idle slot; a chunk runs its slot bucket's rows, fewer in the tail),
    and the number of sequences that joined (one page copied each). ``slots`` counts every
    data group's.
    """
    from delta_jax.sampling.attention import pages_for
    from delta_jax.sampling.engine import EngineRows, EngineSpec, run_engine
    from delta_jax.sampling.engine.requests import SLOT_FIELDS

    longest = pages_for(max(map(len, prompts)) + max(budgets), page)
    spec = EngineSpec(
        slots=slots,
        steps=chunk,
        page_size=page,
        num_pages=slots * longest + groups,
        seq_pages=longest,
        max_table=1 << (longest - 1).bit_length(),
        prefill_len=2048,
        min_len=16,
        prefill_rows=8 * groups,
        groups=groups,
        attention="pallas",
        return_hidden=False,
        pad_id=0,
    )
    lengths: list[np.ndarray] = []

    class Programs(StandInPrograms):
        def decode(self, packed, pages, steps_left, refill=0):
            assert refill == 0  # no quota: no refill exit
            return step(packed, steps_left)

    def step(packed, steps_left):
        st = {name: packed[:, i] for i, name in enumerate(SLOT_FIELDS)}
        count, pos, active = st["count"].copy(), st["pos"].copy(), st["active"] > 0
        steps = 0
        while steps < steps_left and active.any():
            lengths.append(np.where(active, pos + 1, 0))
            count, pos = count + active, pos + active
            active &= count < st["max_new"]
            steps += 1
        return np.stack([st["last"], pos, count, active.astype(np.int32)], axis=1)

    arrays = [np.asarray(p, np.int32) for p in prompts]
    stops = np.full((len(budgets), 1), -1, np.int32)
    rows = EngineRows(arrays, n, np.asarray(budgets), stops)
    _, stats = run_engine(spec, rows, Programs())
    assert stats.useful_steps == sum(budgets)
    return lengths, len(budgets) + stats.preemptions, stats


def _pool_slope(cfg, mesh, rules, slots: int, table: int, page: int, sizes):
    """The TPU compiler's bytes for one engine decode step (all chips) at two pool sizes
    (pages in total, every data group's share).

    Returns the intercept (bytes that do not grow with the pool: weights, activations, the
    LM head, sampling), the slope in whole pools (how many times the cost model charges the
    whole pool per step, where the kernel and the K/V scatter touch only a few of its pages)
    and the step's FLOPs (all chips, at the first size).
    """
    from delta_jax.plan.lowering import lower_decode
    from delta_jax.sampling.engine.requests import EngineSpec
    from delta_jax.sharding import batch_divisor

    figures, flops = [], []
    for pages in sizes:
        spec = EngineSpec(
            slots=slots,
            steps=1,
            page_size=page,
            num_pages=pages,
            seq_pages=table,
            max_table=table,
            prefill_len=page,
            min_len=page,
            prefill_rows=slots,
            groups=batch_divisor(mesh, rules),
            attention="pallas",
            return_hidden=False,
            pad_id=0,
        )
        lowered = lower_decode(cfg, mesh, rules, spec)
        cost = lowered.compile().cost_analysis()
        figures.append(float(cost["bytes accessed"]) * mesh.size)
        flops.append(float(cost["flops"]) * mesh.size)
    pool_bytes = [p * page * _token_kv_bytes(cfg) for p in sizes]
    slope = (figures[1] - figures[0]) / (pool_bytes[1] - pool_bytes[0])
    return figures[0] - slope * pool_bytes[0], slope, flops[0]


def _token_kv_bytes(cfg) -> int:
    """K and V of one token, every layer, bfloat16."""
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2


def tpu_bytes(args) -> None:
    """HBM bytes per useful token from the TPU compiler, static vs engine, same workload.

    The whole slice on the sampling mesh (data groups x tensor), the paper's lengths:
    ``args.tpu_prompts`` prompts x ``args.n`` samples per data group, prompts of 256-2,048
    tokens, responses log-normal (the CPU workload's shape scaled by 20) capped at 20,480. Both
    totals count decode only (each prompt is prefilled once by both) and divide by the same
    useful tokens.
    """
    from jax.experimental import topologies
    from jax.sharding import Mesh

    from delta_jax import sharding as sh
    from delta_jax.plan import known_model_config
    from delta_jax.sampling import SAMPLING_RULES
    from delta_jax.sampling.attention import pages_for
    from delta_jax.sampling.attention.paged import PALLAS_KV_PAGES_PER_BLOCK

    cfg = known_model_config("Qwen3-8B")
    topo = topologies.get_topology_desc(topology_name=args.tpu_topology, platform="tpu")
    devices = np.array(topo.devices)
    mesh = sh.sampling_mesh(Mesh(devices.reshape(1, devices.size, 1), sh.AXES), cfg.num_kv_heads)
    groups = sh.batch_divisor(mesh, SAMPLING_RULES)
    rules, page, scale = SAMPLING_RULES, args.page_size, 20
    prompt_bucket, cap = 2048, args.cap * scale
    num_prompts, slots = args.tpu_prompts * groups, args.tpu_slots * groups
    prompts, budgets = workload(num_prompts, args.n, args.mean_new * scale, cap, 2, seed=1)
    rng = np.random.default_rng(1)
    prompts = [[1] * int(rng.integers(256, prompt_bucket + 1)) for _ in prompts]
    rows, useful, longest = len(budgets), sum(budgets), max(budgets)
    token_kv = _token_kv_bytes(cfg)

    # Static: one batch of every row over a prompt + generation cache (a generation bucket at
    # the cap, the smallest one), for as many steps as the longest row.
    static_step = _static_step_bytes(cfg, mesh, rules, rows, prompt_bucket + cap)
    static_total = static_step * longest

    # Engine: the steps its scheduler runs, each at the compiler's pool-independent bytes plus
    # the pages the ragged paged attention kernel copies (every slot's pages up to its length,
    # in blocks of PALLAS_KV_PAGES_PER_BLOCK pages, an idle slot one block of scratch pages),
    # the K/V row each slot writes, and one page read and written per joining sequence.
    lengths, joins, stats = _engine_schedule(prompts, budgets, args.n, slots, 16, page, groups)
    table = 1 << (pages_for(prompt_bucket + cap, page) - 1).bit_length()
    sizes = (2049 * groups, 4097 * groups)
    fixed, slope, _ = _pool_slope(cfg, mesh, rules, slots, table, page, sizes)
    block = PALLAS_KV_PAGES_PER_BLOCK * page
    rows_run = np.concatenate(lengths)
    copied = np.ceil(np.maximum(rows_run, 1) / block).sum() * block * token_kv
    written = rows_run.size * token_kv + joins * 2 * page * token_kv
    engine_total = fixed * len(lengths) + copied + written

    print(
        f"Qwen3-8B bf16, {args.tpu_topology} ({devices.size} chips) as the sampling mesh "
        f"{dict(mesh.shape)}, {rows} rows ({num_prompts} prompts x {args.n}; {groups} data "
        f"groups), prompts 256-{prompt_bucket}, responses mean "
        f"{useful / rows:.0f} max {longest} (cap {cap}), {useful} useful tokens; TPU compiler "
        "cost analysis, bytes accessed summed over the chips:"
    )
    print(
        f"  static: {static_step / 2**30:8.1f} GiB/step x {longest} steps = "
        f"{static_total / 2**40:8.1f} TiB -> {static_total / useful / 2**20:8.1f} MiB per "
        "useful token"
    )
    print(
        f"  engine: {groups} groups x {args.tpu_slots} slots, each over its own pages, "
        f"{len(lengths)} steps (occupancy "
        f"{stats.occupancy:.3f}); compiler {fixed / 2**30:.1f} GiB/step without the pool (the "
        f"pool adds {slope:.3f} pools to it), + "
        f"{copied / 2**40:.1f} TiB of pages copied by the kernel + {written / 2**30:.1f} GiB "
        f"written = {engine_total / 2**40:8.1f} TiB -> {engine_total / useful / 2**20:8.1f} MiB "
        "per useful token"
    )
    print(f"  static / engine HBM bytes per useful token: {static_total / engine_total:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--mean-new", type=float, default=200.0)
    ap.add_argument("--cap", type=int, default=1024)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--equal", action="store_true", help="every row runs --cap new tokens")
    ap.add_argument("--tpu", action="store_true", help="add the TPU compile-only figures")
    ap.add_argument("--tpu-topology", default="v5p:4x4x2", help="v5p:4x4x2 is v5p-64")
    ap.add_argument("--tpu-prompts", type=int, default=8, help="per data group (x --n rows)")
    ap.add_argument("--tpu-slots", type=int, default=32, help="per data group")
    ap.add_argument("--skip-cpu", action="store_true")
    args = ap.parse_args()
    if not args.skip_cpu:
        cpu_table(args)
    if args.tpu:
        tpu_bytes(args)


if __name__ == "__main__":
    main()
