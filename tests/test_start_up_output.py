"""Where libtpu is installed (the ``tpu`` and ``test`` extras bring it for the planner) but no
TPU is attached, JAX's automatic platform choice starts the TPU runtime, which fails and prints
its probe to stderr. The commands start without it; the planner still compiles for TPU."""

import importlib.util
import os
import subprocess
import sys

import pytest

from delta_jax import distributed

PROBE = ("host bounds", "TPU_WORKER_HOSTNAMES", "libtpu_init_utils")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None
    or distributed._tpu_attached()
    or bool(distributed._accelerator_plugins()),
    reason="needs libtpu installed on a machine with no TPU and no other accelerator plugin",
)


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # another process holding libtpu's lock hides it
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout + done.stderr


def test_jax_alone_prints_the_probe():
    """The check below is not vacuous: here, JAX left to choose does print it."""
    out = _run("import jax; print(jax.devices())")
    assert any(p in out for p in PROBE), out


def test_commands_start_without_the_tpu_probe():
    out = _run(
        "from delta_jax import cli\n"
        "try:\n"
        "    cli.main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "import jax\n"
        "print(jax.devices())\n"
    )
    assert "usage: delta-jax" in out and "CpuDevice" in out
    assert not any(p in out for p in PROBE), out


def test_the_planner_still_compiles_for_tpu():
    out = _run(
        "from delta_jax import distributed\n"
        "assert distributed.leave_out_absent_tpu()\n"
        "import jax, jax.numpy as jnp\n"
        "from delta_jax.plan.compiler import tpu_topology_devices\n"
        "_, devices = tpu_topology_devices('v5e-1')\n"
        "f = jax.jit(lambda x: x @ x)\n"
        "spec = jax.ShapeDtypeStruct((128, 128), jnp.float32,\n"
        "    sharding=jax.sharding.SingleDeviceSharding(devices[0]))\n"
        "print('flops', f.lower(spec).compile().cost_analysis()['flops'])\n"
    )
    assert "flops" in out


def test_a_chosen_platform_is_left_alone(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not distributed.leave_out_absent_tpu()
