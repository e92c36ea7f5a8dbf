"""Partial rollouts against synchronous rollouts on the real model, in one run.

Workload: ``configs/smollm2_arith.yaml``'s model (SmolLM2-135M-Instruct, the GGUF file from the
package index) and task (reasoning-gym ``chain_sum``, the chat template), with a template that
asks the model to show its working (``--template``), so that responses have a natural,
long-tailed length; temperature 1; EOS as the stop; a response cap ``--cap`` several times the
mean length (the lengths are reported, so the tail can be seen). The parameters never change
(no update runs): the policy version passed to the buffer is the step number, as if each step
were followed by one update, so that the staleness a run would see is reported.

Pod regime: ``decode_slots`` = the rows of one synchronous step (``--groups`` x ``--n``), every
sequence of a synchronous step in a slot at once. Per step, interleaved (the arm that runs
first alternates, so that the machine's drift hits both alike):

* synchronous: ``--groups`` new prompts, ``quota=None``: the step waits for its longest row;
* partial: the request :class:`~delta_jax.rl.partial.PartialRollouts` plans
  (``--groups`` + ``--extra`` groups: the groups carried from the last step first, then new
  prompts) with ``quota=--groups``: the step returns ``--groups`` finished groups and carries
  the rest.

Both arms draw their new prompts from the same list in the same order. Reported per arm, over
the steps (the rollout phase's wall time with XLA's backend-compile events taken out, as
``benchmarks/rollout_ragged.py`` does):

* useful tokens/s: the tokens of the rows of the groups a step returns (for the partial arm,
  their tokens drawn in earlier steps included) per second;
* generated tokens/s: the tokens the engine drew in the step (``EngineStats.useful_steps``:
  the returned groups' tokens drawn in this step plus those of rows carried on) per second;
* occupancy: generated tokens / slot-steps run (``EngineStats``);
* groups per step, tokens carried at the end (drawn, not yet returned), and the response
  lengths of the returned rows (mean, percentiles, the fraction at the cap).

    python benchmarks/partial_rollout.py --steps 6
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from rollout_ragged import CompileTime

from delta_jax.config import load_config
from delta_jax.rl.partial import PartialRollouts
from delta_jax.rl.setup import load_model, prompt_sets, special_token_ids
from delta_jax.sampling import Sampler

CONFIG = "configs/smollm2_arith.yaml"
TEMPLATE = "{prompt} Show your working step by step, then give the final number."


def load(args):
    """The model, its stop ids and the task's training prompts as ``(ids, record)`` pairs."""
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [
            f"run.dir={run_dir}",
            "run.eval_every=0",
            "data.extra_eval_sources=null",
            f"data.template={args.template}",
        ]
        config = load_config(CONFIG, overrides)
        model, tokenizer = load_model(config, Path(run_dir))
        pad_id, stops = special_token_ids(tokenizer, model)
        train, _ = prompt_sets(config, tokenizer)
    pairs = [
        (list(map(int, ids)), record) for ids, record in zip(train.ids, train.records, strict=True)
    ]
    return model, pad_id, stops, pairs


def timed(sampler: Sampler, prompts, **kw):
    """One call: ``(output, wall seconds, compile seconds)``."""
    with CompileTime() as compile_time:
        start = time.perf_counter()
        out = sampler.generate(prompts, **kw)
        out.length_array.block_until_ready()
        wall = time.perf_counter() - start
    return out, wall, compile_time.seconds


def step_figures(out, wall: float, compile_s: float, lengths: list[int]) -> dict:
    """A step's figures: ``lengths`` are the returned rows' response lengths."""
    stats = out.engine_stats
    return dict(
        wall=wall,
        compile=compile_s,
        groups=0,
        useful=int(sum(lengths)),
        generated=stats.useful_steps,
        slot_steps=stats.decode_steps,
        prefilled=stats.resumed_tokens,
        lengths=lengths,
        carried=0,
        staleness={},
    )


def sync_step(sampler, pairs, args, seed: int) -> dict:
    """``--groups`` new prompts, every row to its end."""
    kw = dict(max_new_tokens=args.cap, n=args.n, temperature=1.0, seed=seed)
    out, wall, compile_s = timed(sampler, [ids for ids, _ in pairs], **kw)
    figures = step_figures(out, wall, compile_s, out.lengths)
    figures["groups"] = len(pairs)
    return figures


def partial_step(sampler, buffer: PartialRollouts, fresh, args, version: int, seed: int) -> dict:
    """The buffer's planned request, quota ``--groups``."""
    plan = buffer.plan(fresh, version=version, seed=seed)
    kw = dict(max_new_tokens=args.cap, temperature=1.0, **plan.generate_kwargs())
    out, wall, compile_s = timed(sampler, plan.prompts, **kw)
    groups, stats = buffer.take(plan, out)
    figures = step_figures(out, wall, compile_s, [n for g in groups for n in g.lengths])
    figures.update(groups=len(groups), carried=stats.carried_tokens, staleness=stats.staleness)
    return figures


def summary(name: str, steps: list[dict], cap: int) -> dict:
    """An arm's totals over its steps, printed; returns its rates."""
    seconds = sum(s["wall"] - s["compile"] for s in steps)
    useful, generated = sum(s["useful"] for s in steps), sum(s["generated"] for s in steps)
    slot_steps = sum(s["slot_steps"] for s in steps)
    occupancy = generated / slot_steps
    lengths = np.asarray([n for s in steps for n in s["lengths"]])
    percentiles = " ".join(f"p{q} {np.percentile(lengths, q):.0f}" for q in (50, 90, 99))
    print(
        f"{name:>7}: {useful / seconds:6.1f} useful tok/s, {generated / seconds:6.1f} generated "
        f"tok/s, occupancy {occupancy:.3f}, {np.mean([s['groups'] for s in steps]):.1f} groups "
        f"per step; {seconds:.0f} s without {sum(s['compile'] for s in steps):.0f} s of "
        f"compiles; {useful} useful and {generated} generated tokens"
    )
    print(
        f"{'':>7}  returned rows' lengths: mean {lengths.mean():.1f}, {percentiles}, max "
        f"{lengths.max()}, at the cap {np.mean(lengths >= cap):.3f} ({len(lengths)} rows)"
    )
    print(
        f"{'':>7}  {slot_steps / seconds:.0f} slot-steps/s; "
        f"{sum(s['prefilled'] for s in steps)} carried tokens prefilled again"
    )
    return dict(useful=useful / seconds, generated=generated / seconds, occupancy=occupancy)


def print_step(step: int, name: str, s: dict) -> None:
    staleness = " ".join(f"{age}:{count}" for age, count in s["staleness"].items()) or "-"
    print(
        f"{step:4d} {name:>7} | {s['wall']:7.1f} {s['compile']:6.1f} | {s['groups']:3d} "
        f"{s['useful']:6d} {s['generated']:6d} {s['generated'] / s['slot_steps']:6.3f} | "
        f"{s['carried']:6d} {s['prefilled']:6d} {staleness}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=4, help="groups a step trains on (B)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--extra", type=int, default=None, help="over-provision (default: B)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cap", type=int, default=512, help="max_new_tokens")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=16, help="decode steps per engine call")
    ap.add_argument("--template", default=TEMPLATE)
    ap.add_argument("--seed", type=int, default=0, help="offsets every call's seed")
    args = ap.parse_args()
    extra = args.groups if args.extra is None else args.extra
    model, pad_id, stops, pairs = load(args)
    slots = args.groups * args.n
    sampler = Sampler(
        model,
        engine="continuous",
        pad_token_id=pad_id,
        stop_token_ids=stops,
        decode_slots=slots,
        page_size=args.page_size,
        decode_chunk=args.chunk,
    )
    buffer = PartialRollouts(args.n, args.groups, extra)
    print(
        f"{CONFIG}: SmolLM2-135M-Instruct, chain_sum, template {args.template!r}, temperature 1, "
        f"cap {args.cap}, stop ids {list(stops)}; {args.groups} groups x {args.n} samples a "
        f"step on {slots} slots (decode chunk {args.chunk}, page {args.page_size}); partial "
        f"asks {args.groups} + {extra} groups with quota {args.groups}; {args.steps} steps, "
        f"interleaved; seed {args.seed}"
    )
    print("step     arm |  wall s compile | grp useful   gen   occ | carried refill staleness")
    arms = {"sync": [], "partial": []}
    taken = {"sync": 0, "partial": 0}  # prompts each arm has drawn from the shared list
    base = 10_000 * args.seed
    for step in range(args.steps):
        order = ["sync", "partial"] if step % 2 == 0 else ["partial", "sync"]
        for name in order:
            if name == "sync":
                fresh = pairs[taken[name] : taken[name] + args.groups]
                figures = sync_step(sampler, fresh, args, seed=base + 1000 + step)
            else:
                fresh = pairs[taken[name] : taken[name] + buffer.fresh_needed]
                seed = base + 2000 + step
                figures = partial_step(sampler, buffer, fresh, args, step, seed=seed)
            taken[name] += len(fresh)
            arms[name].append(figures)
            print_step(step, name, figures)
    print("useful: tokens of the rows of the groups a step returned; generated: tokens drawn")
    rates = {name: summary(name, steps, args.cap) for name, steps in arms.items()}
    held = sum(len(c.tokens) for g in buffer.held for c in g.rows)
    useful = sum(s["useful"] for s in arms["partial"])
    print(
        f"partial: {len(buffer.held)} groups held at the end with {held} tokens drawn (drawn, "
        f"not returned: not counted as useful); useful + held = {useful + held}"
    )
    ratio = rates["partial"]["useful"] / rates["sync"]["useful"]
    print(f"partial / sync useful tok/s: {ratio:.2f}x")


if __name__ == "__main__":
    main()
