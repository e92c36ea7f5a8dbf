"""Real SIGKILLs of a `delta-jax train` process at the moments of a save, each followed by the
same command: it resumes with at most one warning line, no step is ever judged damaged, and the
metrics and parameters in the end are the uninterrupted run's (bitwise).

The save moments come from the test hook of ``delta_jax/checkpoint.py``
(``DELTA_JAX_TEST_KILL_AT=<point>:<step>``: ``save``, Orbax writing, not committed; ``record``,
committed, no integrity record yet); the others are timed from outside: mid-step between two
saves, and at a random moment.
"""

import os
import random
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from delta_jax.checkpoint import RECORD
from delta_jax.diagnostics.metrics_log import read_metrics
from tests.rl.test_loop import ROOT, _cli, _params

EXTRA = ("run.steps=6", "run.save_every=3", "run.keep_last=3", "reward.num_workers=0")
# What a user would read as a problem. After a kill there is none at all: a kill damages nothing
# (real damage gets one warning line, see test_damaged_checkpoint.py).
NOISE = re.compile(r"warning|traceback|exception ignored", re.IGNORECASE)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """One compilation cache for every run of the module: the runs after the first start in
    seconds (a cached executable computes what a fresh compile does)."""
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONUNBUFFERED": "1",
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


@pytest.fixture(scope="module")
def straight(tmp_path_factory, demo_model_dir, env):
    """The uninterrupted run the killed one must end up equal to."""
    run = tmp_path_factory.mktemp("straight") / "run"
    proc = subprocess.run(
        _cli(run, demo_model_dir, *EXTRA), env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return run


def _comparable(rows):
    """Rows without timings and compile counts (a resumed process compiles again)."""
    drop = lambda k: k.startswith(("time/", "compiles"))
    return [{k: v for k, v in r.items() if not drop(k)} for r in rows]


def _noise(output):
    return [line for line in output.splitlines() if NOISE.search(line)]


def _steps(run):
    """Committed steps, and those of them with an integrity record."""
    folders = [p for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    return sorted(int(p.name) for p in folders), sorted(
        int(p.name) for p in folders if (p / RECORD).exists()
    )


def _killed_at(run, model_dir, env, point):
    """Runs until the test hook kills the process at ``point``; returns its output."""
    proc = subprocess.run(
        _cli(run, model_dir, *EXTRA),
        env={**env, "DELTA_JAX_TEST_KILL_AT": point},
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == -signal.SIGKILL, (point, proc.returncode, proc.stderr)
    return proc.stdout + proc.stderr


def _killed_when(run, model_dir, env, *, row, delay):
    """Kills the process ``delay`` seconds after it has logged step ``row``; returns its output
    and whether the kill came before the run finished."""
    proc = subprocess.Popen(
        _cli(run, model_dir, *EXTRA),
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # The resumed process first drops the rows after its checkpoint, then logs them again.
    seen, deadline = [], time.time() + 600
    while not (seen and seen[-1] == row):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
        time.sleep(0.02)
        seen = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode in (0, -signal.SIGKILL), out
    return out, proc.returncode == -signal.SIGKILL


@pytest.mark.slow  # seven CLI runs (the compilation cache keeps all but the first short)
def test_kills_at_every_moment_of_a_save_resume_to_the_uninterrupted_metrics(
    tmp_path, demo_model_dir, env, straight
):
    run = tmp_path / "run"
    # Orbax writing step 3, uncommitted: only its temporary folder is there.
    assert not _noise(_killed_at(run, demo_model_dir, env, "save:3"))
    assert _steps(run) == ([], [])
    # Step 3 committed, its record not yet written (the next save writes it).
    assert not _noise(_killed_at(run, demo_model_dir, env, "record:3"))
    assert _steps(run) == ([3], [])
    # Mid-step between two saves: the newest step (3) has no record.
    out, killed = _killed_when(run, demo_model_dir, env, row=4, delay=0)
    assert killed and _steps(run)[0] == [3] and not _noise(out), out
    # Orbax writing step 6, step 3 recorded meanwhile.
    assert not _noise(_killed_at(run, demo_model_dir, env, "save:6"))
    assert _steps(run) == ([3], [3])
    # A random moment after the first resumed step (maybe after the run has finished).
    seed = random.randrange(1 << 30)
    delay = random.Random(seed).uniform(0, 1.0)
    out, _ = _killed_when(run, demo_model_dir, env, row=4, delay=delay)
    assert not _noise(out), (seed, delay, out)
    # And once more to the end.
    proc = subprocess.run(
        _cli(run, demo_model_dir, *EXTRA), env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0 and not _noise(proc.stdout + proc.stderr), proc.stderr
    assert not (tmp_path / "run" / "checkpoints_damaged").exists()  # a kill damages nothing
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))  # no step twice, none missing
    assert _comparable(rows) == _comparable(read_metrics(straight / "metrics.jsonl"))
    # and the same parameters, bit for bit
    for x, y in zip(_params(straight, 6), _params(run, 6), strict=True):
        np.testing.assert_array_equal(x, y)
