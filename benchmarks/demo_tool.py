"""The tool-use demo (configs/demo_tool.yaml) at several seeds, with and without the tool.

    python benchmarks/demo_tool.py                   # seeds 0-4, both variants
    python benchmarks/demo_tool.py --seeds 0 --variants tool

Each run is the README's ``delta-jax train --config configs/demo_tool.yaml`` with ``run.seed``
and ``run.dir`` set; the ``no_tool`` variant adds ``rollout.max_turns=1`` (a tool call ends the
episode unanswered). A finished run is read, not re-run. Reported per run: held-out accuracy
(``eval/avg@1``) at step 0 and at the last step, their ratio and difference, tool calls per
episode in the first and last 5 steps, and the run's wall time (warm-up included).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from delta_jax.diagnostics.metrics_log import read_metrics

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"tool": (), "no_tool": ("rollout.max_turns=1",)}


def run(seed: int, variant: str, out: Path) -> float | None:
    """Trains one run unless it finished; its wall time in seconds (None: read, not run)."""
    run_dir = out / f"{variant}_seed{seed}"
    if (run_dir / "learning_curve.png").exists():
        return None
    cmd = [sys.executable, "-m", "delta_jax.cli", "train", "--config", "configs/demo_tool.yaml"]
    cmd += [f"run.seed={seed}", f"run.dir={run_dir}", "run.progress=false", *VARIANTS[variant]]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    wall = time.perf_counter() - t0
    (run_dir / "wall_s.txt").write_text(f"{wall:.1f}\n")
    return wall


def summary(seed: int, variant: str, out: Path) -> dict:
    run_dir = out / f"{variant}_seed{seed}"
    rows = read_metrics(run_dir / "metrics.jsonl")
    evals = [(r["step"], r["eval/avg@1"]) for r in rows if "eval/avg@1" in r]
    calls = [r["episode/tool_calls"] for r in rows if "episode/tool_calls" in r]
    first, last = evals[0][1], evals[-1][1]
    wall = run_dir / "wall_s.txt"
    return {
        "variant": variant,
        "seed": seed,
        "acc_0": first,
        "acc_last": last,
        "ratio": last / first if first else float("inf"),
        "gain": last - first,
        "calls_first5": float(np.mean(calls[:5])),
        "calls_last5": float(np.mean(calls[-5:])),
        "wall_s": float(wall.read_text()) if wall.exists() else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "demo_tool_seeds")
    args = parser.parse_args()
    for variant in args.variants:
        for seed in args.seeds:
            run(seed, variant, args.out)
    print("| variant | seed | eval@step0 | eval@last | ratio | gain | tool calls first 5 -> "
          "last 5 steps | wall |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for variant in args.variants:
        for seed in args.seeds:
            s = summary(seed, variant, args.out)
            print(
                f"| {variant} | {seed} | {s['acc_0']:.3f} | {s['acc_last']:.3f} | "
                f"{s['ratio']:.2f}x | {s['gain']:+.3f} | {s['calls_first5']:.2f} -> "
                f"{s['calls_last5']:.2f} | {s['wall_s']:.0f} s |"
            )


if __name__ == "__main__":
    main()
