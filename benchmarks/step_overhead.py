"""Train-step time with ``loss=delta`` vs ``loss=dapo`` on the same model and batch.

DelTA's coefficients are computed inside the jitted loss from the hidden states of the forward
pass the update makes anyway, so the only extra work is O(B*T*H*(K+2)) projections and weighted
sums. The reference recipe instead pays K+2 extra forward passes (10.2% of a step in the paper's
measurement). Target: median(delta) / median(dapo) <= 1.02.

The two compiled steps run interleaved in one process (delta, dapo, delta, ...) on identical
inputs; the first call of each (compilation) is timed apart. Each step is timed twice: wall
time, and this process's CPU time (all its threads), which other jobs on a shared machine slow
far less than the wall clock: on a loaded machine, quote the CPU-time ratio.

    python benchmarks/step_overhead.py                 # the sampler issue's "small" model
    python benchmarks/step_overhead.py --repeats 3 --rows 2 --gen 32   # quick check
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_models import SIZES, bench_config
from flax import nnx

from delta_jax.config import load_config
from delta_jax.models import Transformer
from delta_jax.rl.packing import make_assemble, plan_rows
from delta_jax.rl.state import init_train_state, make_optimizer
from delta_jax.rl.train_step import make_train_step
from delta_jax.rl.update_plan import UpdatePlan


def update_plan(loss: str, args) -> UpdatePlan:
    """One update of ``args.rows`` padded rows (the layout of this benchmark's figures)."""
    overrides = [
        f"algo.loss={loss}",
        "algo.packing=false",
        f"data.max_prompt_length={args.prompt}",
        f"rollout.max_new_tokens={args.gen}",
        f"rollout.prompts_per_step={args.rows // 2}",
        "rollout.samples_per_prompt=2",
    ]
    return UpdatePlan.from_config(load_config(None, overrides))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8, help="responses in the mini-batch")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    model = Transformer(bench_config("small"), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(0)
    s = args.prompt + args.gen
    ids = rng.integers(3, SIZES["small"]["vocab_size"], (args.rows, s)).astype(np.int32)
    lengths = rng.integers(args.gen // 2, args.gen + 1, args.rows)
    rollout = (
        jnp.asarray(ids),
        jnp.zeros((args.rows, args.gen), jnp.float32),
        jnp.asarray(rng.standard_normal(args.rows).astype(np.float32)),
        None,  # coefficients
        None,  # action mask: single-turn
    )
    prompts = np.full(args.rows, args.prompt)
    optimizer = make_optimizer(load_config(None).optim, 100)
    steps, states, first = {}, {}, {}
    for loss in ("delta", "dapo"):
        plan = update_plan(loss, args)
        index, _ = plan_rows(plan, np.arange(args.rows), prompts, lengths, shards=1)
        batch = jax.tree.map(lambda x: x[0], make_assemble(plan)(*rollout, index))
        steps[loss] = make_train_step(graphdef, optimizer, plan)
        states[loss] = init_train_state(jax.tree.map(jnp.copy, params), optimizer)
        t = time.perf_counter()
        states[loss], m = steps[loss](states[loss], batch)
        jax.block_until_ready(m)
        first[loss] = time.perf_counter() - t
    times: dict[str, list[float]] = {"delta": [], "dapo": []}
    cpu: dict[str, list[float]] = {"delta": [], "dapo": []}
    for _ in range(args.repeats):
        for loss in ("delta", "dapo"):
            t, c = time.perf_counter(), time.process_time()
            states[loss], m = steps[loss](states[loss], batch)
            jax.block_until_ready((states[loss], m))
            times[loss].append(time.perf_counter() - t)
            cpu[loss].append(time.process_time() - c)
    tokens = args.rows * s
    print(
        f"model: small (params {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.1f}M), "
        f"batch {args.rows} x {s} tokens ({tokens}), {args.repeats} interleaved repeats"
    )
    print(f"{'loss':6} {'first call s':>13} {'median s':>9} {'min s':>7} {'median CPU s':>13}")
    for loss in ("delta", "dapo"):
        print(
            f"{loss:6} {first[loss]:13.2f} {statistics.median(times[loss]):9.3f} "
            f"{min(times[loss]):7.3f} {statistics.median(cpu[loss]):13.3f}"
        )
    for name, t in (("wall", times), ("CPU", cpu)):
        ratio = statistics.median(t["delta"]) / statistics.median(t["dapo"])
        print(f"ratio median(delta)/median(dapo), {name} time = {ratio:.4f}  (target <= 1.02)")


if __name__ == "__main__":
    main()
