"""Test-session setup shared by every test.

Eight fake CPU devices are created before JAX initialises so that sharded code paths (meshes,
shard_map, per-shard statistics) are exercised on a plain CPU machine. Single-device code simply
runs on device 0.
"""

import os

from tests.compile_flags import FAKE_DEVICES, with_fast_compile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += f" {FAKE_DEVICES}"
# A collective among fake devices waits for every device's thread. On a loaded 2-core machine
# (CI, two test workers beside subprocess runs) a thread can wait past XLA:CPU's default 40 s
# and abort the process though nothing is stuck; a real hang still meets the test's own timeout.
_TERMINATE = "xla_cpu_collective_call_terminate_timeout_seconds"
if _TERMINATE not in _flags:
    _flags += f" --{_TERMINATE}=600"
# XLA:CPU at optimisation level 0: the suite's tiny programs compile faster (tests.compile_flags).
os.environ["XLA_FLAGS"] = with_fast_compile(_flags.strip())
# The compile-only TPU tests load libtpu, which by default takes a machine-wide lock: another
# JAX process on the machine (a demo run, a second test session) would make them fail.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Never reach a model or dataset hub from the test-suite.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Programs compiled by the CLI runs the tests start in subprocesses (the demo config with a few
# overrides, again and again) go to one persistent XLA cache for the session, so a second run
# of the same programs (a resume, the second process layout, the same config in another test)
# loads them instead of compiling. JAX is imported first so that this test process keeps its own
# in-memory caching only: tests here count compilations and must see them.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402, F401

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _xla_cache = tempfile.mkdtemp(prefix="delta_jax_test_xla_cache_")
    atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _xla_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most 4 (each holds a JAX runtime with 8 CPU
    devices and its compiled programs, 2-4 GB)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


# The modules that take longest (seconds of one worker on a 2-core machine, measured 2026-11-28
# with `--durations`: the sum of their tests among the 100 slowest), longest first. Workers take
# whole modules (`--dist loadscope`) in collection order, so these go first and the many short
# modules fill in at the end: left to xdist's default order (most tests first), a 6-minute
# module with few tests was handed out last and ran while the other worker sat idle.
HEAVY_FIRST = (
    "tests/rl/test_loop.py",  # ~330 s
    "tests/sampling/test_engine.py",  # ~250 s
    "tests/test_multihost.py",  # ~240 s: runs of two processes
    "tests/rl/test_compare.py",  # ~210 s: a demo warm-up and two RL runs
    "tests/rl/test_train_step.py",  # ~190 s
    "tests/plan/test_plan_tpu.py",  # ~170 s: TPU compiles
    "tests/test_readme.py",  # ~140 s
    "tests/models/test_gguf.py",  # ~130 s: the real model and transformers
    "tests/sampling/test_multiturn.py",  # ~125 s
    "tests/rl/test_trainer.py",  # ~120 s
    "tests/rl/test_checkpoint_kills.py",  # ~105 s
    "tests/rl/test_multiturn_run.py",  # ~105 s
    "tests/sampling/test_speculative.py",  # ~100 s
    "tests/plan/test_plan.py",  # ~100 s
    "tests/test_hub.py",  # ~90 s
    "tests/test_sharding.py",  # ~85 s
)


def pytest_collection_modifyitems(config, items):
    """Heaviest modules first (``HEAVY_FIRST``), the rest in collection order; tests keep their
    order within a module."""
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
