"""JAX's persistent compilation cache (``run.compile_cache``) and the compile metrics of a step."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from delta_jax.diagnostics.metrics_log import read_metrics
from delta_jax.rl.packing import bucket_rows
from tests.rl.conftest import tiny_overrides

ROOT = Path(__file__).parents[2]
DEMO = ROOT / "configs" / "demo.yaml"


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def test_the_cache_directory_each_setting_chooses(tmp_path):
    """auto: ``JAX_COMPILATION_CACHE_DIR`` when set, else ``$DELTA_JAX_CACHE/xla``; a path;
    null: off. Every program is cached unless the environment sets the minimum compile time."""
    code = (
        "import sys, jax\n"
        "from delta_jax.rl.compilation import use_persistent_cache as use\n"
        "setting = None if sys.argv[1] == 'null' else sys.argv[1]\n"
        "print(use(setting), jax.config.jax_enable_compilation_cache,\n"
        "      jax.config.jax_persistent_cache_min_compile_time_secs)\n"
    )

    def run(setting, **env):
        out = subprocess.run(
            [sys.executable, "-c", code, setting], env=_env(**env), cwd=ROOT,
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return out.stdout.split()

    project = tmp_path / "project"
    assert run("auto", DELTA_JAX_CACHE=str(project)) == [str(project / "xla"), "True", "0.0"]
    mine = tmp_path / "mine"
    assert run("auto", DELTA_JAX_CACHE=str(project), JAX_COMPILATION_CACHE_DIR=str(mine))[0] == (
        str(mine)
    )
    assert run(str(mine), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="2") == [
        str(mine), "True", "2.0",
    ]  # fmt: skip
    assert run("null")[:2] == ["None", "False"]


@pytest.mark.slow  # two CLI runs
def test_a_second_process_loads_every_program_from_the_cache(tmp_path, demo_model_dir):
    """The same tiny run twice in fresh processes: the second compiles nothing (every program
    its steps need is loaded from the cache the first wrote, copied to another directory: the
    keys do not name it) and learns the same."""
    rows = []
    for name in ("first", "second"):
        cache = tmp_path / "xla"
        if name == "second":
            cache = shutil.copytree(cache, tmp_path / "copied" / "xla")
        overrides = tiny_overrides(
            tmp_path / name, demo_model_dir, "run.steps=3", "run.eval_every=2",
            "run.eval_prompts=8", f"run.compile_cache={cache}",
        )  # fmt: skip
        cmd = [sys.executable, "-m", "delta_jax.cli", "train", "--config", str(DEMO), *overrides]
        done = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        rows.append(read_metrics(tmp_path / name / "metrics.jsonl"))
    first, second = rows  # the evaluation before step 1, then steps 1-3 (step 2 evaluates)
    assert first[0]["compiles"] > 0 and first[1]["compiles"] > 0 and first[1]["time/compile"] > 0
    assert [r["compiles"] for r in second] == [0, 0, 0, 0], second
    first, second = ([r for r in rows if "loss" in r] for rows in (first, second))
    assert second[0]["compiles_loaded"] > 0 and any(os.scandir(cache))
    assert [r["loss"] for r in second] == [r["loss"] for r in first]


def _cli_run(tmp_path, name, demo_model_dir, *extra, **env):
    """A tiny packed CLI run (fresh process); its metric rows and its log."""
    overrides = tiny_overrides(tmp_path / name, demo_model_dir, *extra)
    cmd = [sys.executable, "-m", "delta_jax.cli", "train", "--config", str(DEMO), *overrides]
    done = subprocess.run(cmd, env=_env(**env), cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return read_metrics(tmp_path / name / "metrics.jsonl"), done.stderr


# Rows that hold two sequences only when both are short: the rows move across buckets.
MOVING = ["run.steps=6", "run.eval_every=3", "run.eval_prompts=8", "rollout.temperature=1.5"]
MOVING += ["algo.tokens_per_row=64", "algo.share_prompts=false"]


@pytest.mark.slow  # a CLI run
def test_steps_whose_lengths_move_compile_nothing_after_the_first(tmp_path, demo_model_dir):
    """Six steps whose response lengths move the packed rows (across what would be buckets of
    rows in one micro-batch), the scored slots and the sampling rounds from step to step, in
    one update shape (micro-batches of 4 rows here, as many as a step needs; nothing compiled
    ahead): nothing compiles after the first step and the first evaluation (evaluations at
    steps 0, 3, 6)."""
    cache = f"run.compile_cache={tmp_path / 'xla'}"
    one = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ["XLA_FLAGS"])
    shape = (*MOVING, cache, "algo.micro_batch_rows=4")  # one device: rows in fours
    rows, _ = _cli_run(tmp_path, "moving", demo_model_dir, *shape, XLA_FLAGS=one)
    steps = [r for r in rows if "loss" in r]
    moved = lambda key: len({r[key] for r in steps})
    assert moved("batch/micro_batches") > 1 and moved("batch/scored_positions") > 1, steps
    buckets = {bucket_rows(int(r["batch/packed_rows"]), 1, 64) for r in steps}
    assert len(buckets) > 1, steps  # a bucketed update would have compiled each
    assert moved("dynamic/rounds") > 1 or moved("response_length_max") > 1
    assert [r["compiles"] for r in steps[1:]] == [0] * 5, steps
    assert sum("eval/avg@1" in r for r in steps) == 2  # the evaluations at steps 3 and 6


@pytest.mark.slow  # two CLI runs
def test_compiling_ahead_leaves_the_first_step_little_to_compile(tmp_path, demo_model_dir):
    """``run.compile_ahead``: the train step and the rollout's engine programs compile before
    step 1 (a progress line with the count and the time), and step 1 loads the train step
    from the cache and compiles only the small programs left; the run learns the same."""
    cache = f"run.compile_cache={tmp_path / 'xla'}"
    common = ("run.steps=2", "run.eval_every=0")
    plain, _ = _cli_run(tmp_path, "plain", demo_model_dir, *common, "run.compile_cache=null")
    ahead_run = (*common, cache, "run.compile_ahead=true")
    ahead, log = _cli_run(tmp_path, "ahead", demo_model_dir, *ahead_run)
    line = next(line for line in log.splitlines() if "compiled ahead:" in line)
    assert " warm-up requests, in " in line and int(line.split("compiled ahead: ")[1].split()[0])
    assert ahead[0]["compiles_loaded"] >= 1  # the train step, compiled ahead
    assert ahead[0]["compiles"] < plain[0]["compiles"] / 2, (ahead[0], plain[0])
    assert ahead[0]["time/compile"] < plain[0]["time/compile"] / 2
    assert [r["loss"] for r in ahead] == [r["loss"] for r in plain]
