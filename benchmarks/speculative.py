"""Speculative rollouts on the real model: tokens per verify step and draft acceptance by source,
and the wall time with and without speculation at several batch sizes.

The workload is ``configs/smollm2_arith.yaml``'s rollout: SmolLM2-135M-Instruct (the GGUF file
from the package index), reasoning-gym ``chain_sum`` prompts in its chat template, temperature
0.7, up to ``--max-new`` tokens. An *epoch* samples the same ``--prompts`` prompts again with a
new seed, as RL's steps come back to a prompt; epoch 1 fills the drafter's history and is not
counted. The policy does not change between epochs here (no update): history drafts are at their
best, where a training run's policy drifts from one epoch to the next.

Per batch size (the engine's ``decode_slots``), the samplers ``--paths`` names run the same
epochs in turn (interleaved, so the machine's drift hits each alike): ``dense`` (the CPU
default, one token per step), ``xla`` (one token per step on the XLA path), and ``dense+k`` /
``xla+k`` (up to ``k`` drafted tokens per verify step: one line of them), ``dense+NxD`` (a
trie of up to ``N`` drafted tokens at most ``D`` deep, ``draft_depth``; not the TPU kernel's path),
and ``dense+auto`` / ``xla+auto`` (``speculate="auto"``: on CPU, never). A batch of 1 runs
one sample per prompt (a prompt's samples must fit the slots), so its drafts come from the
sequence's own text and the history. Speculation changes no token (checked here: every
epoch's tokens are compared with the plain path's on the same attention path).

Acceptance is also split by the kind of token at each drafted index (the output's
``drafted_array``): tokens whose text holds a digit (the numbers: the problem's own content)
against the rest (words, punctuation, the template's markers and the end of turn).

``--set KEY=VALUE`` overrides the config (e.g. ``data.template=...`` for longer answers).

    python benchmarks/speculative.py --prompts 8 --epochs 3 --batches 1,8,32
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from delta_jax.config import load_config
from delta_jax.rl.setup import load_model, prompt_sets, special_token_ids
from delta_jax.sampling import Sampler
from delta_jax.sampling.speculation.drafts import SOURCES
from delta_jax.sampling.speculation.speculate import DRAFT_OUTCOMES

CONFIG = "configs/smollm2_arith.yaml"


def _samplers(model, pad_id, stops, slots: int, args) -> dict[str, Sampler]:
    kw = dict(engine="continuous", pad_token_id=pad_id, stop_token_ids=stops, decode_slots=slots)
    samplers = {}
    for name in args.paths.split(","):
        attention, _, drafts = name.partition("+")
        if drafts:  # "+auto": rollout.speculate=auto, else true; "+NxD": a trie
            when = "auto" if drafts == "auto" else True
            k, _, depth = (str(args.k) if drafts == "auto" else drafts).partition("x")
            spec = dict(draft_tokens=int(k), draft_depth=int(depth or 0), speculate=when)
            spec.update(decode_chunk=args.verify_chunk)
            samplers[name] = Sampler(model, attention=attention, **spec, **kw)
        else:
            samplers[name] = Sampler(model, attention=attention, **kw)
    return samplers


def _by_kind(outs, digits) -> dict[str, list[int]]:
    """``{kind: [drafted, accepted]}`` over the speculative outputs' drafted indices, the kind
    of the token emitted there (``digits[id]``: its text holds a digit)."""
    counts = {"numbers": [0, 0], "other": [0, 0]}
    for out in outs:
        outcome = np.asarray(out.drafted_array)
        for r, row in enumerate(out.tokens):
            for t, token in enumerate(row):
                if outcome[r, t] != DRAFT_OUTCOMES["none"]:
                    c = counts["numbers" if digits[token] else "other"]
                    c[0] += 1
                    c[1] += int(outcome[r, t] == DRAFT_OUTCOMES["accepted"])
    return counts


def run_batch(model, prompts, pad_id, stops, args, slots: int, digits) -> None:
    n = min(args.n, slots)
    samplers = _samplers(model, pad_id, stops, slots, args)
    walls = {name: [] for name in samplers}
    tokens = {name: 0 for name in samplers}
    speculative = {name: [] for name in samplers}  # the measured calls that speculated
    changed, differ = dict.fromkeys(samplers, 0), 0
    for epoch in range(args.epochs):
        outs = {}
        for name, sampler in samplers.items():
            start = time.perf_counter()
            out = sampler.generate(
                prompts, max_new_tokens=args.max_new, n=n, temperature=args.temperature,
                seed=1000 + epoch,
            )  # fmt: skip
            wall = time.perf_counter() - start
            outs[name] = out
            if epoch == 0:
                continue  # compiles, and fills the history
            walls[name].append(wall)
            tokens[name] += sum(out.lengths)
            if out.engine_stats.verify_steps:
                speculative[name].append(out)
        # Speculation changes no token in exact arithmetic (tested in float64); in float32 a
        # verify step's attention sums in another order than a decode step's, and a sampled
        # draw that falls within that rounding of a boundary between two tokens goes the other
        # way (counted against the plain run on its attention path, not asserted), as the dense
        # path's rows may differ from the XLA path's.
        for name, out in outs.items():
            attention, _, drafts = name.partition("+")
            if drafts and attention in outs and epoch:
                pairs = zip(out.tokens, outs[attention].tokens, strict=True)
                changed[name] += sum(a != b for a, b in pairs)
        if "dense" in outs and "xla" in outs:
            pairs = zip(outs["dense"].tokens, outs["xla"].tokens, strict=True)
            differ += sum(a != b for a, b in pairs)
    rows = len(prompts) * n
    print(f"\nbatch {slots} ({len(prompts)} prompts x {n} samples = {rows} rows, "
          f"{args.epochs - 1} measured epochs)")  # fmt: skip
    first = next(iter(samplers))
    print(f"{'path':>8} | {'wall s':>7} {'tok/s':>7} | vs {first}")
    base = {name: statistics.median(w) for name, w in walls.items()}
    for name in samplers:
        rate = tokens[name] / sum(walls[name])
        print(f"{name:>8} | {base[name]:7.2f} {rate:7.1f} | {base[first] / base[name]:7.2f}x")
    if "dense" in samplers and "xla" in samplers:
        print(f"rows whose dense-path tokens differ from the XLA path's: {differ}")
    for name in samplers:
        if "+" in name and name.partition("+")[0] in samplers:
            print(f"rows whose {name} tokens differ from the plain path's (float32): "
                  f"{changed[name]} of {rows * (args.epochs - 1)}")  # fmt: skip
    if not any(speculative.values()):
        print("no call speculated")
        return
    lengths = [len(t) for outs in speculative.values() for out in outs for t in out.tokens]
    per_row = statistics.mean(lengths)
    print(f"response length: {per_row:.1f} tokens on average")
    for name, outs in speculative.items():
        if outs:
            _report(name, outs, digits)


def _report(name: str, outs, digits) -> None:
    """One speculative path's tokens per verify step, drafts by source and acceptance by kind
    of token, over its measured calls ``outs``."""
    stats = [out.engine_stats for out in outs]
    useful, steps = sum(s.useful_steps for s in stats), sum(s.verify_steps for s in stats)
    print(f"{name}: tokens per verify step {useful / steps:.2f} ({useful} tokens, "
          f"{steps} verify steps); drafts by source:")  # fmt: skip
    for source in SOURCES:
        d = sum(s.drafted.get(source, 0) for s in stats)
        a = sum(s.accepted.get(source, 0) for s in stats)
        print(
            f"  {source:>8}: {d:6d} drafted, {a:6d} accepted ({a / d if d else float('nan'):.2f})"
        )
    print(f"{name}: acceptance by the kind of token at the drafted index:")
    for kind, (d, a) in _by_kind(outs, digits).items():
        print(f"  {kind:>8}: {d:6d} drafted, {a:6d} accepted ({a / d if d else float('nan'):.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (at most the batch)")
    ap.add_argument("--epochs", type=int, default=3, help="the first fills the history")
    ap.add_argument("--batches", default="1,8,32", help="decode slots")
    ap.add_argument("--k", type=int, default=4, help="drafted tokens per verify step")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument(
        "--paths",
        default="dense,dense+k",
        help="samplers: dense, xla, dense+k, xla+k, dense+NxD (a trie), dense+auto, xla+auto",
    )
    ap.add_argument(
        "--verify-chunk",
        type=int,
        default=16,
        help="verify steps per decode chunk (drafts are "
        "renewed every chunk); plain decoding keeps the default chunk of 16 steps",
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config")
    args = ap.parse_args()
    args.paths = args.paths.replace("+k", f"+{args.k}")
    if args.epochs < 2:
        ap.error("--epochs must be >= 2 (the first is not measured)")
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [f"run.dir={run_dir}", "run.eval_every=0", "data.extra_eval_sources=null"]
        overrides += args.set
        config = load_config(CONFIG, overrides)
        model, tokenizer = load_model(config, Path(run_dir))
        pad_id, stops = special_token_ids(tokenizer, model)
        train, _ = prompt_sets(config, tokenizer)
        prompts = [list(map(int, ids)) for ids in train.ids[: args.prompts]]
        vocab = range(model.config.vocab_size)
        digits = [any(c.isdigit() for c in tokenizer.decode([i])) for i in vocab]
    print(f"{CONFIG} {' '.join(args.set)}: {len(prompts)} prompts, k={args.k}, "
          f"verify chunk {args.verify_chunk}, "
          f"temperature {args.temperature}, up to {args.max_new} new tokens")  # fmt: skip
    for slots in map(int, args.batches.split(",")):
        run_batch(model, prompts, pad_id, stops, args, slots, digits)


if __name__ == "__main__":
    main()
