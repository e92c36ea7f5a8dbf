"""One whole RL step on the tiny config: median seconds in rollout / reward / update.

8 prompts x 4 samples, prompts of 64 tokens, exactly 128 new tokens (the random-init model is
given no stop token), math-verify reward in the process pool, DelTA update, through the public
``Trainer`` and its default path (continuous engine, packed update). The first step
(compilation, pool start) is reported apart.

    python benchmarks/rl_step.py --steps 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile

from bench_models import bench_config
from flax import nnx

from delta_jax import Trainer
from delta_jax.demo import build_char_tokenizer
from delta_jax.models import Transformer


def _rows(n: int, prompt_len: int) -> list[dict]:
    """Addition problems padded with spaces to exactly ``prompt_len`` characters (= tokens)."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append({"prompt": f"{a}+{b}=".rjust(prompt_len), "answer": str(a + b)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    tokenizer = build_char_tokenizer()
    tokenizer.eos_token = None  # no stop token: every row runs --new-tokens
    config = {
        "algo.loss": "delta",
        "optim.lr": 1e-5,
        "data.max_prompt_length": args.prompt_len,
        "rollout.max_new_tokens": args.new_tokens,
        "rollout.prompts_per_step": args.prompts,
        "rollout.samples_per_prompt": args.samples,
        "rollout.dynamic_sampling_rounds": 0,
        "reward.num_workers": args.workers,
        "run.steps": args.steps + 1,
        "run.save_every": 0,
        "run.eval_every": 0,
        "run.progress": False,
        "run.tensorboard": False,
    }
    rows = []
    with tempfile.TemporaryDirectory() as run_dir:
        config["run.dir"] = run_dir
        with Trainer(
            config,
            model=Transformer(bench_config("tiny"), rngs=nnx.Rngs(0)),
            tokenizer=tokenizer,
            train_dataset=_rows(4 * args.prompts, args.prompt_len),
            reward_fns=["math"],
        ) as trainer:
            for step in range(args.steps + 1):
                m = trainer.step()
                assert m["response_length_mean"] == args.new_tokens
                row = dict(
                    rollout=m["time/rollout"],
                    reward=m["time/reward_tail"],
                    update=m["time/update"],
                    total=m["time/step"],
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
