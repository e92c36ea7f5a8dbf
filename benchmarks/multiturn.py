"""Multi-turn rollouts: continuing in place vs re-prefilling the history every turn.

Episodes of ``--turns`` model turns on the continuous engine (greedy, a random model of the
``tiny`` or ``small`` benchmark size). The "host" answers a turn at once with ``--observation``
ids derived from it (no tool latency: only the engine's cost is compared); the last turn gets
no observation.

A random model's greedy text soon cycles through a few ids (attention over a long random
prompt is nearly uniform, so each id follows from the last one): a turn-end id among them ends
every later turn at its first ids, one outside them never ends a turn. Its attention is made
sharp (the query norm's weights scaled, :data:`SHARPEN`: about 170 distinct ids in 192 greedy
ones, against 1 or 2 in 128 without); then turn-end ids are chosen before the runs
(:func:`choose_stops`) so that every episode has ``--turns`` turns of at most ``--turn-len``
ids.

* **in place** (``Sampler.generate(turns=...)``): one engine call; a sequence whose turn ends
  keeps its pages, its observation is prefilled into them, it re-joins a slot.
* **re-prefill**: one engine call per turn, every live episode's whole history (prompt, turns,
  observations) as the prompt, as a loop around a single-turn sampler does.

Both produce the same tokens (checked). Reported: the turns per episode and ids per turn the
in-place run got; per mode, the ids prefilled, and the wall time of a second run (the first
compiles every program it needs).

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

# Query-norm scale of the benchmark's random model: attention logits 8x sharper.
SHARPEN = 8.0


def observation(turn: list[int], size: int, vocab: int) -> list[int]:
    s = sum(turn)
    return [(s * 31 + 7 * i) % (vocab - 2) + 1 for i in range(size)]


def answered(value) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(value)
    return future


def in_place(sampler, prompts, args, stops, vocab):
    turns_of = collections.Counter()  # turns handed over, per episode

    def submit(row, turn):
        turns_of[row] += 1
        return answered(observation(turn, args.observation, vocab))

    turns = Turns(stop_ids=tuple(stops), max_turns=args.turns, submit=submit)
    out = sampler.generate(prompts, max_new_tokens=args.budget, temperature=0.0, turns=turns)
    stats = out.engine_stats
    prefilled = sum(len(p) - 1 for p in prompts) + stats.resumed_tokens
    # The last turn is never handed over.
    episode_turns = [turns_of[row] + 1 for row in range(len(prompts))]
    return out.tokens, prefilled, (stats, episode_turns)


def choose_stops(sampler, prompts, args, vocab) -> list[int]:
    """Turn-end ids giving each episode ``args.turns`` turns of at most ``args.turn_len`` ids.

    Turn by turn, every episode's next ``turn_len`` greedy ids (its history as the prompt: the
    same ids the engine draws in place) are read; an episode whose turn meets no turn-end id
    there adds the id that first appears latest in it, unless that id occurs in a finished
    turn (it would end that turn earlier and change what follows).
    """
    stops: set[int] = set()
    finished: set[int] = set()  # ids of the finished turns
    history = [[] for _ in prompts]
    for turn in range(args.turns):
        contexts = [p + h for p, h in zip(prompts, history, strict=True)]
        out = sampler.generate(contexts, max_new_tokens=args.turn_len, temperature=0.0)
        for new in out.tokens:
            if stops.isdisjoint(new):
                first = {t: i for i, t in reversed(list(enumerate(new)))}
                fresh = [t for t in sorted(first, key=first.get) if t not in finished]
                stops.update(fresh[-1:])
        for i, new in enumerate(out.tokens):
            end = next((j for j, t in enumerate(new) if t in stops), None)
            if end is None:  # no id of it may end it: it runs on past turn_len
                continue
            new = new[: end + 1]
            finished.update(new)
            history[i] += new
            if turn + 1 < args.turns:
                history[i] += observation(new, args.observation, vocab)
    return sorted(stops)


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
    parser.add_argument("--turn-len", type=int, default=64, help="most ids of a model turn")
    parser.add_argument("--slots", type=int, default=8)
    args = parser.parse_args()

    config = dataclasses.replace(bench_config(args.config), max_position_embeddings=4096)
    model = Transformer(config, rngs=nnx.Rngs(0))
    model.blocks.q_norm[...] = model.blocks.q_norm[...] * SHARPEN
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(1, config.vocab_size, args.prompt_len).tolist() for _ in range(args.episodes)
    ]
    sampler = Sampler(model, engine="continuous", stop_token_ids=(), decode_slots=args.slots)
    stops = choose_stops(sampler, prompts, args, config.vocab_size)

    results = {}
    for name, fn in (("in place", in_place), ("re-prefill", re_prefill)):
        fn(sampler, prompts, args, stops, config.vocab_size)  # compiles
        start = time.perf_counter()
        result = fn(sampler, prompts, args, stops, config.vocab_size)
        results[name] = (time.perf_counter() - start, *result)
    (t_in, tokens_in, pre_in, (stats, turns)), (t_re, tokens_re, pre_re) = results.values()
    if tokens_in != tokens_re:
        raise SystemExit("the two modes produced different tokens")
    lengths = [len(t) for t in tokens_in]
    sampled = sum(lengths) - stats.observation_tokens
    print(
        f"{args.config}, {args.episodes} episodes, prompt {args.prompt_len}, budget "
        f"{args.budget}, {args.turns} turns of at most {args.turn_len} ids, observations of "
        f"{args.observation} ids, {args.slots} slots, {len(stops)} turn-end ids"
    )
    print(
        f"turns per episode: mean {np.mean(turns):.2f} (min {min(turns)}), ids per turn: mean "
        f"{sampled / sum(turns):.1f}; response ids per episode: mean {np.mean(lengths):.0f}; "
        f"hand-overs {stats.handovers}, observation ids {stats.observation_tokens}, "
        f"preemptions {stats.preemptions}"
    )
    print(f"{'mode':<12}{'prefilled ids':>14}{'wall s':>9}")
    print(f"{'in place':<12}{pre_in:>14}{t_in:>9.2f}")
    print(f"{'re-prefill':<12}{pre_re:>14}{t_re:>9.2f}")
    print(f"in place / re-prefill: prefill {pre_in / pre_re:.2f}x, wall {t_in / t_re:.2f}x")


if __name__ == "__main__":
    main()
