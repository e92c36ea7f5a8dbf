"""Learning curves of the real-model config with and without speculative rollouts.

Two training runs of ``configs/smollm2_arith.yaml`` (SmolLM2-135M-Instruct, reasoning-gym
``chain_sum``, DelTA), the same seeds, ``rollout.speculate`` false then true, evaluations off;
then their metrics step by step. Speculation changes how the rollout's tokens come, not which,
so on the same attention path the two runs should be the same run: the same rewards, response
lengths and losses (the table prints the largest differences), in the rollout time it takes.

    python benchmarks/speculative_curves.py --steps 8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = "configs/smollm2_arith.yaml"
COLUMNS = ("reward_mean", "loss", "response_length_mean")


def train(run_dir: Path, steps: int, speculate: str, extra: list[str]) -> list[dict]:
    overrides = [
        f"run.dir={run_dir}", f"run.steps={steps}", "run.eval_every=0",
        "data.extra_eval_sources=null", f"rollout.speculate={speculate}", *extra,
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "delta_jax.cli", "train", "--config", CONFIG, *overrides]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            mode: train(Path(tmp) / mode, args.steps, mode, args.set) for mode in ("false", "true")
        }
    off, on = runs["false"], runs["true"]
    print(f"{CONFIG} {' '.join(args.set)}: {args.steps} steps, rollout.speculate false | true")
    head = " | ".join(f"{c:>22}" for c in COLUMNS)
    print(f"step | {head} | tokens/verify step | rollout s off / on")
    for a, b in zip(off, on, strict=True):
        cells = " | ".join(f"{a[c]:10.5f} {b[c]:10.5f}" for c in COLUMNS)
        rollout = f"{a['time/rollout']:6.1f} / {b['time/rollout']:6.1f}"
        print(f"{a['step']:4d} | {cells} | {b['speculate/tokens_per_step']:18.3f} | {rollout}")
    for c in COLUMNS:
        worst = max(abs(a[c] - b[c]) for a, b in zip(off, on, strict=True))
        print(f"largest |off - on| of {c}: {worst:.3g}")
    total = [sum(r["time/rollout"] for r in run) for run in (off, on)]
    print(f"rollout time, all steps: {total[0]:.1f} s off, {total[1]:.1f} s on "
          f"({total[0] / total[1]:.2f}x the speed)")  # fmt: skip


if __name__ == "__main__":
    main()
