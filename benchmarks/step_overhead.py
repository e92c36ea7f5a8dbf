"""Train-step time with ``loss=delta`` vs ``loss=dapo`` on the same model and batch.

DelTA's coefficients are computed inside the jitted loss from the hidden states of the forward
pass the update makes anyway, so the only extra work is O(B*T*H*(K+2)) projections and weighted
sums. The reference recipe instead pays K+2 extra forward passes (10.2% of a step in the paper's
measurement). Target: median(delta) / median(dapo) <= 1.02.

The two compiled steps run interleaved in one process (delta, dapo, delta, ...) on identical
inputs; the first call of each (compilation) is timed apart.

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
from delta_jax.rl.objectives import resolve_objective
from delta_jax.rl.train_step import TrainBatch, init_train_state, make_optimizer, make_train_step


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
    ids = rng.integers(3, SIZES["small"]["vocab_size"], (1, args.rows, s)).astype(np.int32)
    lengths = rng.integers(args.gen // 2, args.gen + 1, args.rows)
    response = np.arange(args.gen)[None, None] < lengths[None, :, None]
    mask = np.concatenate([np.ones((1, args.rows, args.prompt), bool), response], axis=-1)
    adv = rng.standard_normal((1, args.rows)).astype(np.float32)
    batch = TrainBatch(
        input_ids=jnp.asarray(ids),
        attention_mask=jnp.asarray(mask),
        response_mask=jnp.asarray(response),
        advantages=jnp.asarray(adv),
    )
    optimizer = make_optimizer(load_config(None).optim, 100)
    steps, states, first = {}, {}, {}
    for loss in ("delta", "dapo"):
        objective = resolve_objective(
            load_config(None, [f"algo.loss={loss}"]).algo, max_response_length=args.gen
        )
        steps[loss] = make_train_step(
            graphdef, optimizer, objective, temperature=1.0, gen_len=args.gen
        )
        states[loss] = init_train_state(jax.tree.map(jnp.copy, params), optimizer)
        t = time.perf_counter()
        states[loss], m = steps[loss](states[loss], batch)
        jax.block_until_ready(m)
        first[loss] = time.perf_counter() - t
    times: dict[str, list[float]] = {"delta": [], "dapo": []}
    for _ in range(args.repeats):
        for loss in ("delta", "dapo"):
            t = time.perf_counter()
            states[loss], m = steps[loss](states[loss], batch)
            jax.block_until_ready((states[loss], m))
            times[loss].append(time.perf_counter() - t)
    tokens = args.rows * s
    print(
        f"model: small (params {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.1f}M), "
        f"batch {args.rows} x {s} tokens ({tokens}), {args.repeats} interleaved repeats"
    )
    print(f"{'loss':6} {'first call s':>13} {'median s':>9} {'min s':>7}")
    for loss in ("delta", "dapo"):
        print(
            f"{loss:6} {first[loss]:13.2f} {statistics.median(times[loss]):9.3f} "
            f"{min(times[loss]):7.3f}"
        )
    ratio = statistics.median(times["delta"]) / statistics.median(times["dapo"])
    print(f"ratio median(delta)/median(dapo) = {ratio:.4f}  (target <= 1.02)")


if __name__ == "__main__":
    main()
