"""One update shape per run against buckets of rows in one micro-batch: whole CLI runs.

``algo.micro_batch_rows`` (``auto``: micro-batches of about 512 tokens on CPU, as many as a
step's packed rows need) against ``bucketed`` (the default: a step's rows in one micro-batch,
one program per bucket of rows a run meets), each a fresh process training ``--steps`` steps of
``--config`` with no evaluation or checkpoint and a compile cache of its own (empty at the
start), one after the other and repeated ``--repeats`` times in alternation. Per run: the
median seconds of the update, the rollout and the whole step over the steps that compiled
nothing, the steps that compiled and the seconds compiling, the run's wall time, the packed rows
and micro-batches per step, and the mean reward of the last steps (DelTA's coefficients come
from the sampler's hidden states where a step can run several micro-batches, from the loss's
own forward where it runs one).

    python benchmarks/micro_batch_rows.py --config configs/demo.yaml [--steps 20] [--repeats 1]
    python benchmarks/micro_batch_rows.py --config configs/demo_tool.yaml --steps 12

``--update``: the update alone of ``configs/smollm2_arith.yaml`` (SmolLM2-135M's shapes, random
weights: ``bench_models`` ``smollm2``; 6 prompts of ``--prompt`` tokens x 8 samples, responses
uniform in ``[--min-response, --max-response]``, as ``compile_once.py`` makes them) through the
trainer's ``Updater`` (rows, the passes before the update, the update; AdamW), at each
``--rows`` setting of ``algo.micro_batch_rows`` and ``--loss``; compiled first, then alternating,
the median of ``--repeats``:

    python benchmarks/micro_batch_rows.py --update [--rows bucketed 2 3 6] [--loss dapo delta]
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


def update_only(args) -> None:
    """The smollm2-shaped update at each ``--rows`` setting (see the module)."""
    import jax
    import numpy as np
    from bench_models import alternate, bench_config
    from compile_once import rollout_arrays
    from flax import nnx

    from delta_jax import sharding as sh
    from delta_jax.config import load_config
    from delta_jax.models import Transformer
    from delta_jax.rl.rollout import Rollout
    from delta_jax.rl.state import init_train_state, make_optimizer
    from delta_jax.rl.update import Updater
    from delta_jax.rl.update_plan import UpdatePlan

    model_config = bench_config("smollm2")
    graphdef, params = nnx.split(Transformer(model_config, rngs=nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(0)
    (sequences, logprobs, advantages), plens, glens = rollout_arrays(model_config, rng, args)
    hidden = rng.normal(size=(*logprobs.shape, model_config.hidden_size)).astype(np.float32)
    scores = {"rewards": np.zeros(len(glens), np.float32), "advantages": np.asarray(advantages)}
    texts = {"records": [], "responses": [], "stats": {}}
    rollout = Rollout(
        sequences, logprobs, jax.numpy.asarray(hidden), plens, glens, **scores, **texts
    )
    mesh = sh.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    calls = {}
    for loss in args.loss:
        for rows in args.rows:
            overrides = [f"algo.loss={loss}", f"algo.micro_batch_rows={rows}"]
            config = load_config("configs/smollm2_arith.yaml", overrides)
            plan = UpdatePlan.from_config(config)
            optimizer = make_optimizer(config.optim, 10)
            updater = Updater(graphdef, optimizer, plan, mesh, donate=False)
            state = jax.device_put(init_train_state(params, optimizer), jax.devices()[0])

            def call(updater=updater, state=state):
                batch, metrics = updater.prepare(rollout, 1, params)
                return updater.update(state, batch)[1]["loss"], metrics

            _, metrics = call()  # compiles
            name = f"{loss} rows={rows}"
            print(
                f"{name}: {metrics['batch/packed_rows']} rows in {metrics['batch/micro_batches']} "
                f"micro-batches (plan {plan.micro_batch_rows} rows each; coefficients "
                f"{plan.coefficients})",
                flush=True,
            )
            calls[name] = call
    medians = alternate(calls, args.repeats)
    for loss in args.loss:
        base = medians[f"{loss} rows={args.rows[0]}"]
        for rows in args.rows:
            median = medians[f"{loss} rows={rows}"]
            print(f"{loss} rows={rows}: {median:.2f} s, {median / base:.3f}x rows={args.rows[0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--update", action="store_true", help="the update alone (see above)")
    parser.add_argument("--rows", nargs="+", default=["bucketed", "2", "3", "6"])
    parser.add_argument("--loss", nargs="+", default=["dapo", "delta"])
    parser.add_argument("--prompt", type=int, default=120)
    parser.add_argument("--min-response", type=int, default=6)
    parser.add_argument("--max-response", type=int, default=22)
    parser.add_argument("overrides", nargs="*", help="more section.key=value overrides")
    args = parser.parse_args()
    if args.update:
        return update_only(args)
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
