"""Shared prompts (``algo.share_prompts``) against unshared packed rows: one RL update's CPU wall
time at ``configs/smollm2_arith.yaml``'s shapes.

SmolLM2-135M's shapes with random weights (``bench_models``: ``smollm2``), 6 prompts x 8
samples, prompts of ``--prompt`` tokens (54: the chat template's system turn included, as the
real config's), responses uniform in ``[--min-response, --max-response]`` (the real runs' 14 on
average), DelTA's coefficients in the loss (one micro-batch), AdamW; the rows built by the
trainer's own stages (``plan_rows`` + ``assemble``). Both programs are compiled first (compile
time printed apart), then calls alternate, the median of ``--repeats`` each.

    python benchmarks/shared_prompts.py [--repeats 3] [--prompt 54]
"""

from __future__ import annotations

import argparse
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
from delta_jax.rl.train_step import make_train_step
from delta_jax.rl.update_plan import UpdatePlan

PROMPTS, N, P_MAX, G_MAX = 6, 8, 192, 32  # configs/smollm2_arith.yaml


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=54)
    parser.add_argument("--min-response", type=int, default=6)
    parser.add_argument("--max-response", type=int, default=22)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    config = bench_config("smollm2")
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
    B = PROMPTS * N
    plens = np.full(B, args.prompt, np.int32)
    glens = rng.integers(args.min_response, args.max_response + 1, B).astype(np.int32)
    seqs = np.zeros((B, P_MAX + G_MAX), np.int32)
    for i in range(B):
        if i % N == 0:
            prompt = rng.integers(3, config.vocab_size, args.prompt)
        seqs[i, P_MAX - args.prompt : P_MAX] = prompt
        seqs[i, P_MAX : P_MAX + glens[i]] = rng.integers(3, config.vocab_size, glens[i])
    rollout = (
        jnp.asarray(seqs),
        jnp.asarray(-rng.uniform(size=(B, G_MAX)).astype(np.float32)),
        jnp.asarray(rng.normal(size=B).astype(np.float32)),
    )
    print(
        f"smollm2 shapes, {PROMPTS} prompts x {N} samples, prompt {args.prompt} tokens, "
        f"responses mean {glens.mean():.1f} (max {glens.max()})",
        flush=True,
    )
    programs = {}
    for share in (False, True):
        cfg = load_config(
            "configs/smollm2_arith.yaml", [f"algo.share_prompts={str(share).lower()}"]
        )
        plan = UpdatePlan.from_config(cfg)
        optimizer = make_optimizer(cfg.optim, 10)
        index, stats = plan_rows(plan, np.arange(B), plens, glens, shards=1)
        batch = jax.tree.map(lambda x: x[0], make_assemble(plan)(*rollout, None, None, index))
        state = init_train_state(params, optimizer)
        t0 = time.perf_counter()
        step = make_train_step(graphdef, optimizer, plan, donate=False)
        step = step.lower(state, batch).compile()
        name = "shared" if share else "unshared"
        print(
            f"{name}: {stats['batch/packed_rows']} rows x {plan.row_len}, "
            f"{stats['batch/positions']:.0f} positions run, "
            f"{stats['batch/scored_positions']} scored slots; compiled in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        programs[name] = functools.partial(step, state, batch)
    medians = alternate(programs, args.repeats)
    unshared, shared = medians["unshared"], medians["shared"]
    print(f"update: unshared {unshared:.2f} s, shared {shared:.2f} s (median of {args.repeats})")
    print(f"unshared / shared update time: {unshared / shared:.2f}x")


if __name__ == "__main__":
    main()
