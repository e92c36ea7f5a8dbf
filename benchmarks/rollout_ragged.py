"""Static sampler vs the continuous-batching engine on a ragged RL-like workload, in one run.

Workload (fixed seed): ``--prompts`` prompts x ``--n`` samples, prompt lengths uniform in
[32, 256], per-row ``max_new_tokens`` log-normal (sigma 1) with mean ``--mean-new`` capped at
``--cap``, no stop ids (every row runs to its own limit), temperature 1, on the ``tiny`` config of
``bench_models``. Reported per engine: useful (generated, non-padding) tokens/s with the
compilation time taken out (XLA's backend-compile events, summed, are subtracted from the call's
wall time and reported apart), and the slot occupancy (useful tokens / slot-steps run).

``--tpu`` adds the TPU compiler's view (compile-only, libtpu) for Qwen3-8B in bfloat16 on a v5p
2x2x1 slice (tensor parallel over its 4 chips) at the paper's lengths (prompt bucket 2,048,
responses capped at 20,480, the same log-normal shape scaled to the cap): HBM bytes accessed by
one decode step of each engine (``cost_analysis()['bytes accessed']`` summed over the chips), per
useful token. The static step attends over the full ``P + G`` cache of every row and runs until
the longest row ends (steps = longest length, useful tokens = sum of lengths); the engine step is
its XLA paged path over a flat page list of the mean live length (a power-of-two bucket of the
pages in use) with a pool of that many pages, at the slot occupancy measured on CPU. The TPU cost
analysis counts a scatter into the pool as a read and write of the whole pool (the K/V writes
and the join copies are scatters), so the engine figure is an upper bound.

Usage::

    python benchmarks/rollout_ragged.py                       # 64 x 8, cap 1024, CPU only
    python benchmarks/rollout_ragged.py --prompts 16 --tpu    # reduced CPU run + TPU figures
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


def cpu_table(args) -> float:
    cfg = bench_config("tiny")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    prompts, budgets = workload(args.prompts, args.n, args.mean_new, args.cap, cfg.vocab_size)
    print(
        f"tiny config, {args.prompts} prompts x {args.n} samples, prompts 32-256 tokens, "
        f"max_new_tokens log-normal mean {np.mean(budgets):.0f} (max {max(budgets)}, cap "
        f"{args.cap}), {jax.devices()[0].platform}"
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
    return results["engine"]["occupancy"]


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


def tpu_bytes(args, occupancy: float) -> None:
    from jax.experimental import topologies
    from jax.sharding import Mesh

    from delta_jax.plan import known_model_config
    from delta_jax.sampling import SAMPLING_RULES
    from delta_jax.sampling.engine import lower_decode, pages_for

    cfg = known_model_config("Qwen3-8B")
    topo = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu")
    mesh = Mesh(np.array(topo.devices).reshape(1, 4), ("data", "tensor"))
    rules = SAMPLING_RULES
    P, cap, rows, page = 2048, 20480, args.tpu_rows, 16
    _, budgets = workload(1, 4096, args.mean_new * cap / args.cap, cap, 2, seed=1)
    budgets = np.asarray(budgets)
    mean_len, longest = float(budgets.mean()), int(budgets.max())
    # A slot-step of the engine holds a sequence at a uniformly drawn step of it, so long
    # sequences are seen more often: the mean attended length is sum_t (P + t) / sum L.
    live_len = P + float((budgets * (budgets - 1) / 2).sum() / budgets.sum())
    list_pages = 1 << (rows * pages_for(int(live_len), page) - 1).bit_length()
    static = _static_step_bytes(cfg, mesh, rules, rows, P + cap)
    engine = lower_decode(
        cfg,
        mesh,
        rules,
        slots=rows,
        steps=1,
        page_size=page,
        num_pages=list_pages + 1,  # a pool sized to the live pages, not to the capacity
        table_pages=1,
        list_pages=list_pages,
        attention="xla",
    )
    engine = float(engine.compile().cost_analysis()["bytes accessed"]) * mesh.size
    static_per_token = static * longest / (rows * mean_len)
    engine_per_token = engine / (rows * occupancy)
    print(
        f"Qwen3-8B bf16 on v5p 2x2x1 (tensor 4), {rows} rows/slots, prompt bucket {P}, "
        f"responses mean {mean_len:.0f} max {longest} (cap {cap}); TPU cost analysis of one "
        "decode step (bytes accessed, all chips):"
    )
    print(
        f"  static: {static / 2**30:7.1f} GiB/step x {longest} steps / {rows} x {mean_len:.0f} "
        f"useful = {static_per_token / 2**20:8.1f} MiB per useful token"
    )
    print(
        f"  engine: {engine / 2**30:7.1f} GiB/step (page list {list_pages} pages, mean live "
        f"length {live_len:.0f}) / occupancy {occupancy:.3f} = "
        f"{engine_per_token / 2**20:8.1f} MiB per useful token"
    )
    print(
        f"  static / engine HBM bytes per useful token: {static_per_token / engine_per_token:.2f}x"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--mean-new", type=float, default=200.0)
    ap.add_argument("--cap", type=int, default=1024)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--tpu", action="store_true", help="add the TPU compile-only figures")
    ap.add_argument("--tpu-rows", type=int, default=64)
    ap.add_argument("--skip-cpu", action="store_true")
    args = ap.parse_args()
    occupancy = 1.0 if args.skip_cpu else cpu_table(args)
    if args.tpu:
        tpu_bytes(args, occupancy)


if __name__ == "__main__":
    main()
