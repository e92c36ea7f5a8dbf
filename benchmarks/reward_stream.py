"""Streaming rewards: the reward time a step still waits for after its last token, in one run.

A ragged rollout (``--prompts`` x ``--n`` rows of the ``small`` model, up to ``--new-tokens``
each, ended by any of ``--stop-ids`` stop ids so lengths are geometric-like, as EOS makes them)
scored by a reward whose sandboxed program takes about 1 s per item
(``bench_models:one_second_program``, in the reward pool of ``--workers`` processes):

* **after the last token** (what the rollout did before streaming): the whole batch is scored
  once sampling has ended; the step waits for all of it;
* **streaming** (``collect_rollout``, the trainer's path): each row is scored as soon as it
  ends (a per-item reward; a batched one takes a prompt's rows once they all have), while the
  others decode, and the pool takes each submission as soon as a worker is free; the step
  waits only for ``time/reward_tail``.

Both score the same responses (asserted equal).

    python benchmarks/reward_stream.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from bench_models import bench_config
from flax import nnx

from delta_jax.data import PromptRecord
from delta_jax.models import Transformer
from delta_jax.rewards import RewardScorer
from delta_jax.rl.rollout import RolloutSpec, collect_rollout
from delta_jax.sampling import Sampler


class IdText:
    """Decodes ids as their decimal text (the reward reads nothing of it)."""

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--stop-ids", type=int, default=300, help="stop ids (of the vocabulary)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    config = bench_config(args.model)
    model = Transformer(config, rngs=nnx.Rngs(0))
    sampler = Sampler(
        model, pad_token_id=0, engine="continuous", decode_slots=args.prompts * args.n
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, config.vocab_size, 32).tolist() for _ in range(args.prompts)]
    batch = [(p, PromptRecord(prompt=f"q{i}", answer="0")) for i, p in enumerate(prompts)]
    stops = tuple(range(config.vocab_size - args.stop_ids, config.vocab_size))
    spec = RolloutSpec(
        n=args.n,
        prompt_len=32,
        gen_len=args.new_tokens,
        sampling=dict(temperature=1.0, top_p=1.0, top_k=0, stop_token_ids=stops),
        advantage="grpo",
        overlong=None,
        dynamic_rounds=0,
        return_hidden=False,
    )
    kw = dict(sampler=sampler, params=None, tokenizer=IdText(), spec=spec)
    with RewardScorer("bench_models:one_second_program", num_workers=args.workers) as scorer:
        scorer.wait_ready()
        collect_rollout(scorer=scorer, prompt_batches=iter([batch]), seed=0, **kw)  # compile
        ro = collect_rollout(scorer=scorer, prompt_batches=iter([batch]), seed=1, **kw)
        t0 = time.perf_counter()
        after = scorer.score([r.prompt for r in ro.records], ro.responses, [{}] * len(ro.records))
        after_s = time.perf_counter() - t0
    np.testing.assert_array_equal(after.rewards, ro.rewards)
    tail = ro.stats["time/reward_tail"]
    print(
        f"{args.model} model, {args.prompts} prompts x {args.n}, lengths {int(ro.lengths.min())}"
        f"-{int(ro.lengths.max())} (mean {ro.lengths.mean():.0f}), {args.workers} reward workers, "
        f"~1 s sandboxed program per item"
    )
    print(f"  sampling (streaming run)           {ro.stats['time/rollout']:.2f} s")
    print(f"  rewards after the last token       {after_s:.2f} s")
    print(f"  streaming: left after the last token {tail:.2f} s  ({tail / after_s:.2f}x)")


if __name__ == "__main__":
    main()
