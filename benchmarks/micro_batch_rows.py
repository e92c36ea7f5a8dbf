"""One update shape per run against buckets of rows in one micro-batch: whole CLI runs.

``algo.micro_batch_rows`` (``auto``, the default: micro-batches of about 256 tokens on CPU, as
many as a step's packed rows need) against ``bucketed`` (a step's rows in one micro-batch, one
program per bucket of rows a run meets), each a fresh process training ``--steps`` steps of
``--config`` with no evaluation or checkpoint and a compile cache of its own (empty at the
start), one after the other and repeated ``--repeats`` times in alternation. Per run: the
median seconds of the update, the rollout and the whole step over the steps that compiled
nothing, the steps that compiled and the seconds compiling, the run's wall time, the packed rows
and micro-batches per step, and the mean reward of the last steps (DelTA's coefficients come
from the sampler's hidden states where a step can run several micro-batches, from the loss's
own forward where it runs one).

    python benchmarks/micro_batch_rows.py --config configs/demo.yaml [--steps 20] [--repeats 1]
    python benchmarks/micro_batch_rows.py --config configs/demo_tool.yaml --steps 12
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from delta_jax.diagnostics.metrics_log import read_metrics

MODES = ("auto", "bucketed")


def run(config: str, mode: str, steps: int, extra: list[str]) -> dict[str, float]:
    """One fresh CLI run of ``config`` with ``algo.micro_batch_rows=mode``: its figures."""
    with tempfile.TemporaryDirectory() as tmp:
        quiet = ["run.eval_every=0", "run.save_every=0", "run.progress=false"]
        overrides = [f"algo.micro_batch_rows={mode}", f"run.steps={steps}", *quiet]
        overrides += ["run.tensorboard=false", f"run.dir={tmp}/run", f"run.compile_cache={tmp}/xla"]
        overrides += extra
        cmd = [sys.executable, "-m", "delta_jax.cli", "train", "--config", config, *overrides]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        wall = time.perf_counter() - start
        rows = [r for r in read_metrics(Path(tmp) / "run" / "metrics.jsonl") if "loss" in r]
    steady = [r for r in rows if r["compiles"] == 0]
    median = lambda key, rs=steady: statistics.median(r[key] for r in rs) if rs else float("nan")
    return {
        "update": median("time/update"),
        "rollout": median("time/rollout"),
        "step": median("time/step"),
        "compiling steps": sum(r["compiles"] > 0 for r in rows),
        "compile s": sum(r["time/compile"] for r in rows),
        "wall": wall,
        "rows": median("batch/packed_rows", rows),
        "micro-batches": median("batch/micro_batches", rows),
        "reward (last 5)": statistics.mean(r["reward_mean"] for r in rows[-5:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="more section.key=value overrides")
    args = parser.parse_args()
    print(f"{args.config}, {args.steps} steps per run, {' '.join(args.overrides)}", flush=True)
    results = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            results[mode].append(run(args.config, mode, args.steps, args.overrides))
            figures = ", ".join(f"{k} {v:.3g}" for k, v in results[mode][-1].items())
            print(f"micro_batch_rows={mode}: {figures}", flush=True)
    mid = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    for key in ("update", "step", "wall"):
        ratio = mid["auto"][key] / mid["bucketed"][key]
        print(f"{key}: auto / bucketed = {ratio:.3f}")


if __name__ == "__main__":
    main()
