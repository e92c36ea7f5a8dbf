"""Packed vs padded rows for one RL update: CPU wall time, and the TPU compiler's FLOP count.

1. *Update time* (this machine): one DelTA update of the ``small`` benchmark model
   (``bench_models``) on a rollout whose response lengths are log-normal with mean 25% of the
   maximum (capped at it, default 2,048), prompts of 64 tokens; the same rollout laid out padded
   (one sequence per row of ``P + G - 1`` positions) and packed (first-fit-decreasing into rows
   of the same length, bucketed row count). Both programs are compiled first (compile time
   printed apart), then timed calls alternate; the median of ``--repeats`` each. Rows cost the
   same FLOPs whatever they hold, so the ratio follows the row counts. Micro-batches are a
   token budget, the same in both layouts: by default one row (``P + G - 1`` tokens) per
   micro-batch (``--micro`` = ``--sequences``), each block recomputed in the backward pass,
   which bounds the small model's update to about 5.5 GB on CPU (XLA's memory analysis: 2.4 GB
   temporaries, 1.5 GB state in and out; the whole run peaked at 7.7 GB resident) where the
   padded 8-row micro-batch of ``--micro 1`` needs more than 14 GB of host memory.
2. *TPU FLOPs* (``--tpu``, compile-only, no TPU needed): the train step of Qwen3-8B at the
   paper's lengths (prompt 2,048, response 20,480; 512 sequences per update, 16 micro-batches)
   lowered for a ``v5p:2x2x1`` topology; ``cost_analysis()`` of one micro-batch program, times
   the micro-batches, for the padded rows and for the packed rows of the same length
   distribution. Attention is ``auto`` (splash on TPU); the TPU compiler refuses programs that
   need more HBM than the chip has (it says so and how much), as 32 rows of 22.5k tokens per
   micro-batch do: ``--tpu-micro 128 --tpu-remat full`` (one row per chip, blocks recomputed)
   fits.

    python benchmarks/packing.py [--model small] [--sequences 8] [--max-len 2048] [--repeats 2]
    python benchmarks/packing.py --tpu --no-timing [--tpu-micro 128 --tpu-remat full]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_models import alternate, bench_config
from flax import nnx

from delta_jax.config import load_config
from delta_jax.models import Transformer
from delta_jax.rl.packing import make_assemble, plan_rows
from delta_jax.rl.state import init_train_state, make_optimizer
from delta_jax.rl.train_step import abstract_batch, make_train_step
from delta_jax.rl.update_plan import UpdatePlan


def response_lengths(n: int, max_len: int, rng) -> np.ndarray:
    """Log-normal (sigma 1) with mean 25% of ``max_len`` before the cap; at least 1 token."""
    sigma = 1.0
    mu = np.log(0.25 * max_len) - sigma**2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, max_len).astype(np.int32)


def _config(prompt, gen, rows, packing, *extra):
    return load_config(
        None,
        [
            f"data.max_prompt_length={prompt}",
            f"rollout.max_new_tokens={gen}",
            f"rollout.prompts_per_step={rows // 2}",
            "rollout.samples_per_prompt=2",
            f"algo.packing={str(packing).lower()}",
            "algo.loss=delta",
            *extra,
        ],
    )


def update_time(args) -> None:
    rng = np.random.default_rng(0)
    P, G, B = 64, args.max_len, args.sequences
    micro = args.micro or B  # one padded row per micro-batch
    # Each block recomputed in the backward pass, so that a padded micro-batch's activations
    # fit a small machine's memory. Same in both layouts.
    config = dataclasses.replace(bench_config(args.model), remat="full")
    model = Transformer(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    glens = response_lengths(B, G, rng)
    plens = np.full(B, P, np.int32)
    seqs = rng.integers(3, config.vocab_size, (B, P + G)).astype(np.int32)
    rollout = (
        jnp.asarray(seqs),
        jnp.asarray(-rng.uniform(size=(B, G)).astype(np.float32)),
        jnp.asarray(rng.normal(size=B).astype(np.float32)),
    )
    # With micro-batches DelTA's coefficients are an input (from the sampler's hidden states).
    coefficients = jnp.asarray(rng.uniform(0.5, 1.5, (B, G)).astype(np.float32))
    print(
        f"model {args.model}, {B} sequences, {micro} micro-batches; response lengths: "
        f"mean {glens.mean():.0f}, max {glens.max()}, cap {G}",
        flush=True,
    )
    programs = {}
    for packing in (False, True):
        cfg = _config(P, G, B, packing, f"algo.micro_batches={micro}")
        plan = UpdatePlan.from_config(cfg)
        optimizer = make_optimizer(cfg.optim, 10)
        index, stats = plan_rows(plan, np.arange(B), plens, glens, shards=1)
        coef = coefficients if plan.coefficients == "sampler" else None
        batch = jax.tree.map(lambda x: x[0], make_assemble(plan)(*rollout, coef, None, index))
        state = init_train_state(params, optimizer)
        t0 = time.perf_counter()
        step = (
            make_train_step(graphdef, optimizer, plan, donate=False).lower(state, batch).compile()
        )
        name = "packed" if packing else "padded"
        print(
            f"{name}: {stats['batch/packed_rows']} rows x {plan.row_len} positions in "
            f"{stats['batch/micro_batches']} micro-batches, pad "
            f"fraction {stats['batch/pad_fraction']:.3f}, compiled in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        programs[name] = functools.partial(step, state, batch)
    medians = alternate(programs, args.repeats)
    padded, packed = medians["padded"], medians["packed"]
    print(f"update: padded {padded:.2f} s, packed {packed:.2f} s (median of {args.repeats})")
    print(f"packed / padded update time: {packed / padded:.3f}")


def tpu_flops(args) -> None:
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from delta_jax import sharding as sh
    from delta_jax.plan import known_model_config

    P, G, per_update = 2048, args.tpu_max_len, 512
    rng = np.random.default_rng(0)
    glens = response_lengths(per_update, G, rng)
    plens = np.clip(rng.normal(300, 150, per_update), 32, P).astype(np.int32)
    topo = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu")
    devices = np.array(topo.devices).reshape(1, -1, 1)
    mesh = Mesh(devices, sh.AXES)
    mc = known_model_config("Qwen3-8B", scan_layers=True, remat=args.tpu_remat)
    # The paper configs: bf16 compute, float32 parameters.
    abstract = nnx.eval_shape(lambda: Transformer(mc, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    for packing in (False, True):
        cfg = _config(P, G, per_update, packing, f"algo.micro_batches={args.tpu_micro}")
        plan = UpdatePlan.from_config(cfg)
        _, stats = plan_rows(plan, np.arange(per_update), plens, glens, sh.batch_divisor(mesh))
        micro = stats["batch/micro_batches"]
        rows = stats["batch/packed_rows"] // micro
        optimizer = make_optimizer(cfg.optim, 10)
        state = jax.eval_shape(lambda p, o=optimizer: init_train_state(p, o), params)
        state_sh = sh.state_shardings(state, mesh)
        state = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, state_sh
        )
        rows_sh = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp")))
        plan1 = dataclasses.replace(plan, micro_batches=1)  # one micro-batch's program
        batch = abstract_batch(plan1, rows, rows_sh)
        step = make_train_step(graphdef, optimizer, plan1, mesh=mesh)
        with sh.use_mesh(mesh):
            lowered = step.lower(state, batch)
        name = "packed" if packing else "padded"
        head = (
            f"{name}: {stats['batch/packed_rows']} rows x {plan.row_len} per update "
            f"({rows} per micro-batch, pad fraction {stats['batch/pad_fraction']:.3f})"
        )
        try:
            flops = lowered.compile().cost_analysis()["flops"]
        except jax.errors.JaxRuntimeError as e:  # e.g. dense attention beyond the chip's HBM
            print(f"{head}; TPU compiler refused: {str(e).splitlines()[0][:200]}", flush=True)
            continue
        print(f"{head}; {micro} x {flops:.4g} = {micro * flops:.4g} FLOPs per update", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", choices=("tiny", "small"), default="small")
    parser.add_argument(
        "--micro", type=int, default=0, help="algo.micro_batches (timing; 0: --sequences)"
    )
    parser.add_argument("--tpu", action="store_true", help="also the TPU FLOP count (slow)")
    parser.add_argument("--tpu-max-len", type=int, default=20480, help="response cap (TPU)")
    parser.add_argument("--tpu-micro", type=int, default=16, help="algo.micro_batches (TPU)")
    parser.add_argument("--tpu-remat", default="block", help="model.remat (TPU)")
    parser.add_argument("--no-timing", action="store_true", help="only the TPU FLOP count")
    args = parser.parse_args()
    if not args.no_timing:
        update_time(args)
    if args.tpu:
        tpu_flops(args)


if __name__ == "__main__":
    main()
