"""Learning curves of the real-model config with and without speculative rollouts.

Two training runs of ``configs/smollm2_arith.yaml`` (SmolLM2-135M-Instruct, reasoning-gym
``chain_sum``, DelTA), the same seeds, ``rollout.speculate`` false then true, evaluations off;
then their metrics step by step. Speculation changes how the rollout's tokens come, not which,
so on the same attention path the two runs should be the same run: the same rewards, response
lengths and losses (the table prints the largest differences), in the rollout time it takes.

    python benchmarks/speculative_curves.py --steps 8

``--runs OFF ON`` tabulates two runs made before (each directory's ``metrics.jsonl``; their
``config.yaml`` says how they were made) instead of training.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

CONFIG = "configs/smollm2_arith.yaml"
COLUMNS = ("reward_mean", "loss", "response_length_mean")


def train(run_dir: Path, steps: int, speculate: str, extra: list[str]) -> list[dict]:
    overrides = [
        f"run.dir={run_dir}", f"run.steps={steps}", "run.eval_every=0",
        "data.extra_eval_sources=null", f"rollout.speculate={speculate}", *extra,
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "delta_jax.cli", "train", "--config", CONFIG, *overrides]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return _read(run_dir)


def _flat(config: dict, prefix: str = "") -> dict:
    """``{"section.key": value}`` of a nested config."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _read(run_dir: Path) -> list[dict]:
    """A run's per-step metrics."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config")
    ap.add_argument("--runs", nargs=2, metavar=("OFF", "ON"), help="runs made before")
    ap.add_argument("--made", default="", help="with --runs: how and where they were made")
    args = ap.parse_args()
    if args.made:
        print(f"runs: {args.made}")
    if args.runs:
        off, on = (_read(Path(d)) for d in args.runs)
        args.steps = len(off)
        configs = [_flat(yaml.safe_load((Path(d) / "config.yaml").read_text())) for d in args.runs]
        differ = sorted(k for k in configs[0] if configs[0][k] != configs[1].get(k))
        print(f"runs made before: {args.runs[0]} and {args.runs[1]}; their configs differ in "
              f"{', '.join(differ)}")  # fmt: skip
    else:
        with tempfile.TemporaryDirectory() as tmp:
            off, on = (train(Path(tmp) / m, args.steps, m, args.set) for m in ("false", "true"))
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
