"""Shared prompts in whole RL steps: two trainers of one config, ``algo.share_prompts`` against
``false``, stepping in turn in one process (so both see the same machine load).

    python benchmarks/shared_prompts_run.py --config configs/smollm2_arith.yaml --steps 6 \\
        run.eval_every=0

Both trainers start from the same seed, so their first rollouts are the same sequences and
their losses agree to float32 rounding (later rollouts drift apart as the parameters do, by
rounding). Each step prints both trainers' time split (``time/step``, ``time/rollout``,
``time/update``), compiles, positions the update ran and its loss; the summary gives the sums
over all steps (what a run pays, compiles included), the medians over the steps after the first
and over the steps in which neither compiled, and the ratios unshared / shared.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from delta_jax import Trainer
from delta_jax.config import load_config

KEYS = ("time/step", "time/rollout", "time/update")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--shared", default="auto", help="algo.share_prompts of the first trainer")
    parser.add_argument("overrides", nargs="*", help="key=value for both trainers")
    args = parser.parse_args()
    settings = {"shared": args.shared, "unshared": "false"}
    rows: dict[str, list[dict]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {
            name: Trainer(
                load_config(
                    args.config,
                    [
                        *args.overrides,
                        f"algo.share_prompts={value}",
                        f"run.dir={tmp}/{name}",
                        f"run.steps={args.steps}",
                        "run.save_every=0",
                        "run.progress=false",
                    ],
                )
            )  # fmt: skip
            for name, value in settings.items()
        }
        try:
            for step in range(1, args.steps + 1):
                for name, trainer in trainers.items():
                    m = trainer.step()
                    rows[name].append(m)
                    split = "  ".join(f"{k[5:]} {m[k]:6.1f}s" for k in KEYS)
                    print(
                        f"step {step} {name:8s} {split}  compiles {m['compiles']:3d}  positions "
                        f"{m['batch/positions']:6.0f} (shared {m['batch/shared_prompts']:.0f})  "
                        f"rows {m['batch/packed_rows']}  loss {m['loss']:+.6f}",
                        flush=True,
                    )
        finally:
            for trainer in trainers.values():
                trainer.close()
    _summary(rows)


def _summary(rows: dict[str, list[dict]]) -> None:
    quiet = [
        i for i in range(1, len(rows["shared"])) if not any(r[i]["compiles"] for r in rows.values())
    ]
    figures = {}
    for name, ms in rows.items():
        for k in KEYS:
            figures[name, k] = (
                sum(m[k] for m in ms),
                statistics.median(m[k] for m in ms[1:]) if len(ms) > 1 else float("nan"),
                statistics.median(ms[i][k] for i in quiet) if quiet else float("nan"),
            )
    print(f"sums over all steps | medians of steps 2+ | medians of the {len(quiet)} steps in "
          "which neither compiled")  # fmt: skip
    for k in KEYS:
        for name in rows:
            print(f"  {k:13s} {name:8s}", "  ".join(f"{x:8.1f}" for x in figures[name, k]))
        ratios = [u / s for u, s in zip(figures["unshared", k], figures["shared", k], strict=True)]
        print(f"  {k:13s} unshared/shared", "  ".join(f"{x:7.2f}x" for x in ratios))


if __name__ == "__main__":
    main()
