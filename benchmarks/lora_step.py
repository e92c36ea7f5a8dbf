"""Update time and optimiser-state bytes: LoRA vs full fine-tuning, same model and batch.

With LoRA the train step differentiates only the adapters (``delta_jax.models.lora``): no
weight gradients for the base (the backward pass still runs through it for the activations),
AdamW moments for the adapters only. Figures: optimiser-state bytes (exact, from the state), and
the median update time of each compiled step, run interleaved (full, lora, full, ...) on the
same inputs; the first call of each (compilation) is timed apart.

    python benchmarks/lora_step.py                     # the "small" benchmark model, rank 16
    python benchmarks/lora_step.py --repeats 3 --rows 2 --gen 32   # quick check
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
from delta_jax.models import Transformer, lora
from delta_jax.rl.state import init_train_state, make_optimizer
from delta_jax.rl.train_step import TrainBatch, make_train_step
from delta_jax.rl.update_plan import UpdatePlan


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8, help="responses in the mini-batch")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    s = args.prompt + args.gen
    ids = rng.integers(3, SIZES["small"]["vocab_size"], (1, args.rows, s)).astype(np.int32)
    lengths = rng.integers(args.gen // 2, args.gen + 1, args.rows)
    response = np.arange(args.gen)[None, None] < lengths[None, :, None]
    mask = np.concatenate([np.ones((1, args.rows, args.prompt), bool), response], axis=-1)
    advantages = rng.standard_normal((1, args.rows, 1)).astype(np.float32)
    segment_ids = mask[..., :-1].astype(np.int32)  # padded layout: one sequence per row
    batch = jax.tree.map(
        jnp.asarray,
        TrainBatch(
            tokens=ids[..., :-1],
            targets=ids[..., 1:],
            segment_ids=segment_ids,
            loss_mask=response,
            advantages=np.where(response, advantages, 0).astype(np.float32),
            rollout_logprobs=np.zeros(response.shape, np.float32),
        ),
    )
    optimizer = make_optimizer(load_config(None).optim, 100)
    plan = UpdatePlan.padded("delta", args.prompt, args.gen, args.rows)
    steps, states, first, opt_bytes = {}, {}, {}, {}
    for kind in ("full", "lora"):
        model = Transformer(bench_config("small"), rngs=nnx.Rngs(0))
        if kind == "lora":
            lora.add_adapters(model, rank=args.rank, alpha=2.0 * args.rank)
        graphdef, params = nnx.split(model, nnx.Param)
        steps[kind] = make_train_step(graphdef, optimizer, plan)
        states[kind] = init_train_state(params, optimizer)
        opt_bytes[kind] = _bytes(states[kind].opt_state)
        t = time.perf_counter()
        states[kind], m = steps[kind](states[kind], batch)
        jax.block_until_ready(m)
        first[kind] = time.perf_counter() - t

    times = {k: [] for k in steps}
    for _ in range(args.repeats):
        for kind in steps:
            t = time.perf_counter()
            states[kind], m = steps[kind](states[kind], batch)
            jax.block_until_ready(m)
            times[kind].append(time.perf_counter() - t)

    print(f"model 'small' ({SIZES['small']}), {args.rows} rows x {s} tokens, rank {args.rank}")
    print(f"devices: {jax.devices()[0].platform} x{jax.device_count()}")
    for kind in steps:
        print(
            f"{kind:>5}: optimiser state {opt_bytes[kind] / 2**20:9.2f} MiB   update median "
            f"{statistics.median(times[kind]) * 1e3:8.1f} ms   (first call {first[kind]:.1f} s)"
        )
    ratio = statistics.median(times["lora"]) / statistics.median(times["full"])
    print(
        f"lora / full: optimiser state {opt_bytes['lora'] / opt_bytes['full']:.4f}, "
        f"update time {ratio:.3f}"
    )


if __name__ == "__main__":
    main()
