"""Multi-turn rollouts: continuing in place vs re-prefilling the history every turn.

Episodes of up to ``--turns`` model turns on the continuous engine (greedy, a random model of
the ``tiny`` or ``small`` benchmark size). A turn ends at one of the ids the model writes most
(so that turns end); the "host" answers at once with ``--observation`` ids derived from the turn
(no tool latency: only the engine's cost is compared); the last turn gets no observation.

* **in place** (``Sampler.generate(turns=...)``): one engine call; a sequence whose turn ends
  keeps its pages, its observation is prefilled into them, it re-joins a slot.
* **re-prefill**: one engine call per turn, every live episode's whole history (prompt, turns,
  observations) as the prompt, as a loop around a single-turn sampler does.

Both produce the same tokens (checked). Reported per mode: the ids prefilled, and the wall
time of a second run (the first compiles every program it needs).

Run: ``python benchmarks/multiturn.py`` (about 5 minutes on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import time

import numpy as np
from bench_models import bench_config
from flax import nnx

from delta_jax.models import Transformer
from delta_jax.sampling import Sampler, Turns


def observation(turn: list[int], size: int, vocab: int) -> list[int]:
    s = sum(turn)
    return [(s * 31 + 7 * i) % (vocab - 2) + 1 for i in range(size)]


def answered(value) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(value)
    return future


def in_place(sampler, prompts, args, stops, vocab):
    def submit(row, turn):
        return answered(observation(turn, args.observation, vocab))

    turns = Turns(stop_ids=tuple(stops), max_turns=args.turns, submit=submit)
    out = sampler.generate(prompts, max_new_tokens=args.budget, temperature=0.0, turns=turns)
    stats = out.engine_stats
    prefilled = sum(len(p) - 1 for p in prompts) + stats.resumed_tokens
    return out.tokens, prefilled, stats


def re_prefill(sampler, prompts, args, stops, vocab):
    """Each turn, one engine call over the live episodes' whole histories."""
    history = [[] for _ in prompts]
    live = list(range(len(prompts)))
    prefilled = 0
    for turn in range(args.turns):
        if not live:
            break
        contexts = [prompts[i] + history[i] for i in live]
        budgets = [args.budget - len(history[i]) for i in live]
        prefilled += sum(len(c) - 1 for c in contexts)
        out = sampler.generate(
            contexts,
            max_new_tokens=budgets,
            temperature=0.0,
            stop_token_ids=list(stops),
        )
        still = []
        for i, budget, new in zip(live, budgets, out.tokens, strict=True):
            history[i] += new
            if new[-1] not in stops or len(new) >= budget or turn + 1 == args.turns:
                continue
            obs = observation(new, args.observation, vocab)
            if len(obs) >= args.budget - len(history[i]):
                continue
            history[i] += obs
            still.append(i)
        live = still
    return history, prefilled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument(
        "--budget", type=int, default=512, help="ids per episode (observations included)"
    )
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--observation", type=int, default=64, help="ids per observation")
    parser.add_argument("--stop-ids", type=int, default=32, help="turn-end ids")
    parser.add_argument("--slots", type=int, default=8)
    args = parser.parse_args()

    config = dataclasses.replace(bench_config(args.config), max_position_embeddings=4096)
    model = Transformer(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(1, config.vocab_size, args.prompt_len).tolist() for _ in range(args.episodes)
    ]
    sampler = Sampler(model, engine="continuous", stop_token_ids=(), decode_slots=args.slots)
    # Turn ends: the ids greedy decoding writes most in the episodes' first 64 tokens.
    probe = sampler.generate(prompts, max_new_tokens=64, temperature=0.0)
    counts = collections.Counter(t for row in probe.tokens for t in row)
    stops = sorted(t for t, _ in counts.most_common(args.stop_ids))

    results = {}
    for name, fn in (("in place", in_place), ("re-prefill", re_prefill)):
        fn(sampler, prompts, args, stops, config.vocab_size)  # compiles
        start = time.perf_counter()
        result = fn(sampler, prompts, args, stops, config.vocab_size)
        results[name] = (time.perf_counter() - start, *result)
    (t_in, tokens_in, pre_in, stats), (t_re, tokens_re, pre_re) = results.values()
    if tokens_in != tokens_re:
        raise SystemExit("the two modes produced different tokens")
    lengths = [len(t) for t in tokens_in]
    print(
        f"{args.config}, {args.episodes} episodes, prompt {args.prompt_len}, budget "
        f"{args.budget}, up to {args.turns} turns, observations of {args.observation} ids, "
        f"{args.slots} slots, {len(stops)} turn-end ids"
    )
    print(
        f"response ids per episode: mean {np.mean(lengths):.0f}, hand-overs "
        f"{stats.handovers} ({stats.handovers / args.episodes:.2f} per episode), observation "
        f"ids {stats.observation_tokens}, preemptions {stats.preemptions}"
    )
    print(f"{'mode':<12}{'prefilled ids':>14}{'wall s':>9}")
    print(f"{'in place':<12}{pre_in:>14}{t_in:>9.2f}")
    print(f"{'re-prefill':<12}{pre_re:>14}{t_re:>9.2f}")
    print(f"in place / re-prefill: prefill {pre_in / pre_re:.2f}x, wall {t_in / t_re:.2f}x")


if __name__ == "__main__":
    main()
