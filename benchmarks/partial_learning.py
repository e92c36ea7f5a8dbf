"""Does learning suffer under partial rollouts? Two ``delta-jax compare`` sweeps of one config,
the same seeds, partial rollouts off and on, paired by seed.

Run the sweeps first (any overrides; the partial arm adds ``rollout.over_provision``), e.g.::

  delta-jax compare --config configs/demo.yaml --losses delta --seeds 0 1 2 3 4 \\
      --out runs/partial_off algo.tis_cap=2.0
  delta-jax compare --config configs/demo.yaml --losses delta --seeds 0 1 2 3 4 \\
      --out runs/partial_on algo.tis_cap=2.0 rollout.over_provision=1
  python benchmarks/partial_learning.py --off runs/partial_off --on runs/partial_on \\
      --seeds 0 1 2 3 4

Prints per seed the final held-out accuracy of each arm and their difference, the paired mean
difference with its 95% t-interval, and the wall time each arm took to first reach the lower of
the two final accuracies (the sum of ``time/step`` up to the first evaluation at or above it:
the steps' own time, the warm-up and start-up left out).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from delta_jax.compare import run_dir, run_row, t_interval
from delta_jax.diagnostics.metrics_log import read_metrics


def time_to(rdir: Path, accuracy: float) -> float:
    """Seconds of RL steps until the first evaluation at or above ``accuracy`` (NaN: never)."""
    spent = 0.0
    for row in read_metrics(rdir / "metrics.jsonl"):
        spent += row.get("time/step") or 0.0
        if row.get("eval/avg@1") is not None and row["eval/avg@1"] >= accuracy:
            return spent
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--off", type=Path, required=True)
    parser.add_argument("--on", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--loss", default="delta")
    args = parser.parse_args()
    print("| seed | final off | final on | on - off | to target off / on (s) | wall off / on (s) |")
    print("|---|---|---|---|---|---|")
    diffs, ratios = [], []
    for seed in args.seeds:
        off, on = run_dir(args.off, args.loss, seed), run_dir(args.on, args.loss, seed)
        a, b = run_row(off), run_row(on)
        target = min(a["eval_final"], b["eval_final"])
        t_off, t_on = time_to(off, target), time_to(on, target)
        diffs.append(b["eval_final"] - a["eval_final"])
        ratios.append(t_on / t_off)
        print(
            f"| {seed} | {a['eval_final']:.3f} | {b['eval_final']:.3f} | {diffs[-1]:+.3f} | "
            f"{t_off:.0f} / {t_on:.0f} | {a['wall_s']:.0f} / {b['wall_s']:.0f} |"
        )
    m, lo, hi = t_interval(diffs)
    print(f"\nfinal held-out accuracy, on - off: {m:+.4f} [{lo:+.4f}, {hi:+.4f}] (95%, paired)")
    m, lo, hi = t_interval(ratios)
    print(f"time to the target accuracy, on / off: {m:.2f} [{lo:.2f}, {hi:.2f}]")


if __name__ == "__main__":
    main()
