"""One whole RL step on the tiny config: median seconds in rollout / reward / update.

8 prompts x 4 samples, prompts of 64 tokens, exactly 128 new tokens (the random-init model is
given no stop token), math-verify reward in the process pool, DelTA update. The first step
(compilation, pool start) is reported apart.

    python benchmarks/rl_step.py --steps 5
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
from delta_jax.data import PromptRecord
from delta_jax.models import Transformer
from delta_jax.rewards import RewardScorer
from delta_jax.rl.packing import make_assemble, plan_rows
from delta_jax.rl.rollout import collect_rollout
from delta_jax.rl.state import init_train_state, make_optimizer
from delta_jax.rl.train_step import make_train_step
from delta_jax.rl.update_plan import UpdatePlan
from delta_jax.sampling import Sampler


class IdText:
    """Decodes ids as decimal text ending in a boxed number, so math-verify parses every one."""

    pad_token_id = 0

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r)) + f" \\boxed{{{r[-1] % 100}}}" for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    model = Transformer(bench_config("tiny"), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    cfg = load_config(
        None,
        [
            "algo.loss=delta",
            "optim.lr=1e-5",
            f"data.max_prompt_length={args.prompt_len}",
            f"rollout.max_new_tokens={args.new_tokens}",
            f"rollout.prompts_per_step={args.prompts}",
            f"rollout.samples_per_prompt={args.samples}",
        ],
    )
    plan = UpdatePlan.from_config(cfg)
    optimizer = make_optimizer(cfg.optim, args.steps)
    step_fn = make_train_step(graphdef, optimizer, plan)
    assemble = make_assemble(plan)
    state = init_train_state(params, optimizer)
    sampler = Sampler(model, pad_token_id=0, stop_token_ids=())
    rng = np.random.default_rng(0)

    def prompt_batches():
        while True:
            yield [
                (
                    rng.integers(3, SIZES["tiny"]["vocab_size"], args.prompt_len).tolist(),
                    PromptRecord(prompt="q", answer=str(rng.integers(0, 100))),
                )
                for _ in range(args.prompts)
            ]

    batches = prompt_batches()
    rows = []
    with RewardScorer("math", num_workers=args.workers) as scorer:
        for step in range(args.steps + 1):
            t0 = time.perf_counter()
            ro = collect_rollout(
                sampler=sampler,
                params=state.params,
                scorer=scorer,
                tokenizer=IdText(),
                prompt_batches=batches,
                n=args.samples,
                prompt_len=args.prompt_len,
                gen_len=args.new_tokens,
                sampling=dict(temperature=1.0, top_p=1.0, top_k=0),
                seed=step,
                advantage="grpo",
                overlong=None,
                dynamic_rounds=0,
                return_hidden=False,
            )
            t1 = time.perf_counter()
            index, _ = plan_rows(plan, np.arange(plan.rows), ro.prompt_lengths, ro.lengths, 1)
            adv = jnp.asarray(ro.advantages)
            batch = assemble(ro.sequences, ro.rollout_logprobs, adv, None, index)
            batch = jax.tree.map(lambda x: x[0], batch)
            state, metrics = step_fn(state, batch)
            jax.block_until_ready((state, metrics))
            t2 = time.perf_counter()
            assert int(ro.lengths.min()) == args.new_tokens
            row = dict(
                rollout=ro.stats["time/rollout"],
                reward=ro.stats["time/reward"],
                update=t2 - t1,
                total=t2 - t0,
            )
            label = "first (compile)" if step == 0 else f"step {step}"
            print(label, {k: round(v, 3) for k, v in row.items()}, flush=True)
            if step:
                rows.append(row)
    print(
        f"tiny config, {args.prompts} prompts x {args.samples} samples, prompt "
        f"{args.prompt_len}, {args.new_tokens} new tokens; median over {len(rows)} steps:"
    )
    for key in ("rollout", "reward", "update", "total"):
        print(f"  {key:8} {statistics.median(r[key] for r in rows):.3f} s")


if __name__ == "__main__":
    main()
