"""Base rates of the real model on reasoning-gym tasks, with and without a reasoning instruction:
what a chain-of-thought config is chosen from.

The model is ``configs/smollm2_arith.yaml``'s (SmolLM2-135M-Instruct, the GGUF file from the
package index, its chat template). For each task (``--tasks``: ``name`` or
``name:{yaml options}``) and each instruction (``--instructions``, of :data:`INSTRUCTIONS`:
``direct``, "Answer with only the final number."; ``reasoning``, the reasoning step by step,
then "The final answer is <number>."; ``working``, the working, then the final number),
``--prompts`` held-out problems are sampled ``--n`` times at the config's temperature (0.7)
with a budget of ``--cap`` tokens. A response to an instruction other than ``direct`` is scored
as ``reward.kind: reasoning_gym`` with ``data.answer_marker: --marker`` scores it (the task's own
verifier on the text after the marker's last occurrence, on that line; 0 without the marker);
a ``direct`` response as ``reward.kind: reasoning_gym`` scores it.

Printed per task and instruction: accuracy, the groups all right / all wrong / mixed, the
fraction of responses with the marker, response lengths (mean, median, p90, at the cap) and
the seconds the sampling took. The band a config wants: accuracy about 0.15-0.50, about half
the groups mixed, responses of roughly 60-250 tokens. With ``--min-working W ...`` each marked
instruction's samples are scored once per ``W`` as ``data.min_working_words: W`` scores them
(fewer words before the marker: 0), one row each (the sampling is shared; ``s`` repeats).

    python benchmarks/cot_base_rates.py --prompts 16 --n 4
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from delta_jax.config import load_config
from delta_jax.rewards.gym import GYM_ENTRY, score_gym
from delta_jax.rl.setup import load_model, prompt_sets, special_token_ids
from delta_jax.sampling import Sampler

CONFIG = "configs/smollm2_arith.yaml"
MARKER = "final answer is"
INSTRUCTIONS = {
    "direct": "{prompt} Answer with only the final number.",
    "working": "{prompt} Show your working step by step, then give the final number.",
    "reasoning": "{prompt} Explain your reasoning step by step, then end with 'The final answer "
    "is <number>.'",
}
TASKS = (
    "chain_sum:{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}",
    "chain_sum:{min_terms: 3, max_terms: 3, min_digits: 1, max_digits: 2}",
    "products:{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}",
    "leg_counting:{min_animals: 2, max_animals: 3, max_instances: 3}",
    "basic_arithmetic:{min_terms: 2, max_terms: 3, min_digits: 1, max_digits: 1}",
)


def parse_task(spec: str) -> tuple[str, dict]:
    """``name`` or ``name:{yaml options}``."""
    name, _, options = spec.partition(":")
    return name, (yaml.safe_load(options) if options else {})


def held_out(task: str, options: dict, template: str, prompts: int, tokenizer, run_dir: str):
    """The task's first ``prompts`` held-out problems in the chat template: (ids, records)."""
    overrides = [
        f"run.dir={run_dir}",
        f"data.source=reasoning_gym:{task}",
        f"data.gym_options={yaml.safe_dump(options, default_flow_style=True).strip()}",
        f"data.template={template}",
        "data.extra_eval_sources=null",
        f"run.eval_prompts={prompts}",
    ]
    _, evals = prompt_sets(load_config(CONFIG, overrides), tokenizer)
    return [list(map(int, ids)) for ids in evals.ids[:prompts]], evals.records[:prompts]


def sample(sampler, ids, args, decode) -> tuple[list[str], np.ndarray, float]:
    """``--n`` responses per prompt: (texts, lengths in tokens, seconds)."""
    start = time.perf_counter()
    out = sampler.generate(ids, n=args.n, max_new_tokens=args.cap, temperature=0.7, seed=0)
    seconds = time.perf_counter() - start
    texts = [decode(tokens) for tokens in out.tokens]
    for row in range(min(args.show, len(texts))):
        print(f"  [{row}] {texts[row]!r}")
    return texts, np.asarray(out.lengths), seconds


def figures(texts, lengths, records, args, marker, min_working: int) -> dict:
    """The figures of one table row: the samples scored with ``marker`` and ``min_working``."""
    scored = [
        score_gym(text, records[row // args.n].extra[GYM_ENTRY], marker, min_working)
        for row, text in enumerate(texts)
    ]
    right = np.asarray([s >= 1.0 for s, _ in scored]).reshape(len(records), args.n)
    marked = [reason != "no_marker" for _, reason in scored]
    per_group = right.sum(1)
    return dict(
        accuracy=right.mean(),
        all_right=np.mean(per_group == args.n),
        all_wrong=np.mean(per_group == 0),
        mixed=np.mean((per_group > 0) & (per_group < args.n)),
        marked=np.mean(marked) if marker else float("nan"),
        mean=lengths.mean(),
        median=np.median(lengths),
        p90=np.percentile(lengths, 90),
        at_cap=np.mean(lengths >= args.cap),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS))
    parser.add_argument("--instructions", nargs="+", default=["direct", "reasoning"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--cap", type=int, default=320)
    parser.add_argument("--marker", default=MARKER)
    parser.add_argument("--show", type=int, default=0, help="responses printed per row")
    parser.add_argument("--min-working", type=int, nargs="+", default=[0], metavar="W")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(CONFIG, [f"run.dir={run_dir}"])
        model, tokenizer = load_model(config, Path(run_dir))
        pad_id, stops = special_token_ids(tokenizer, model)
        sampler = Sampler(
            model,
            engine="continuous",
            pad_token_id=pad_id,
            stop_token_ids=stops,
            decode_slots=config.rollout.decode_slots,
        )
        decode = lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True)
        print(
            f"{args.prompts} held-out prompts x {args.n} samples, temperature 0.7, cap "
            f"{args.cap}; marker {args.marker!r} for 'reasoning'"
        )
        print(
            "| task | options | instruction | min working | accuracy | all right / all wrong / "
            "mixed | marked | length mean / median / p90 | at cap | s |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for spec in args.tasks:
            task, options = parse_task(spec)
            for name in args.instructions:
                ids, records = held_out(
                    task, options, INSTRUCTIONS[name], args.prompts, tokenizer, run_dir
                )
                marker = None if name == "direct" else args.marker
                texts, lengths, seconds = sample(sampler, ids, args, decode)
                for w in args.min_working if marker else [0]:
                    f = figures(texts, lengths, records, args, marker, w)
                    print(
                        f"| {task} | {options} | {name} | {w} | {f['accuracy']:.3f} | "
                        f"{f['all_right']:.2f} / {f['all_wrong']:.2f} / {f['mixed']:.2f} | "
                        f"{f['marked']:.2f} | {f['mean']:.0f} / {f['median']:.0f} / "
                        f"{f['p90']:.0f} | {f['at_cap']:.2f} | {seconds:.0f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
