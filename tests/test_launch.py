"""Launch scripts: shellcheck, dry-run output, the local multi-process launcher, the JobSet."""

import importlib.util
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from delta_jax import distributed
from delta_jax.sharding import topology

ROOT = Path(__file__).resolve().parents[1]
POD = ROOT / "launch" / "tpu_pod.sh"
LOCAL = ROOT / "launch" / "local_multiprocess.py"


def _pod(*args):
    return subprocess.run(["bash", str(POD), *args], capture_output=True, text=True, timeout=60)


def _local_module():
    spec = importlib.util.spec_from_file_location("local_multiprocess", LOCAL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_clean():
    proc = subprocess.run(["shellcheck", str(POD)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_pod_dry_run_commands():
    common = ["--dry-run", "--name", "rl", "--zone", "us-east5-a"]
    out = _pod("create", *common, "--type", "v5p-64", "--spot").stdout
    assert out == (
        "+ gcloud compute tpus tpu-vm create rl --zone=us-east5-a --accelerator-type=v5p-64 "
        "--version=v2-alpha-tpuv5 --spot\n"
    )
    # v5e slices are called v5litepod in gcloud.
    out = _pod("create", *common, "--type", "v5e-8", "--project", "p1").stdout
    assert "--accelerator-type=v5litepod-8 --version=v2-alpha-tpuv5-lite" in out
    assert "--project=p1" in out

    lines = _pod("install", *common).stdout.splitlines()
    assert lines[0] == (
        f"+ tar -czf /tmp/delta_jax_src.tar.gz -C {ROOT} --exclude=.git --exclude=runs "
        "'--exclude=*.egg-info' ."
    )
    assert lines[1] == (
        "+ gcloud compute tpus tpu-vm scp /tmp/delta_jax_src.tar.gz rl:/tmp/delta_jax_src.tar.gz "
        "--zone=us-east5-a --worker=all"
    )
    assert lines[2].startswith("+ gcloud compute tpus tpu-vm ssh rl --zone=us-east5-a --worker=all")
    assert "pip install -q -U '\\''jax[tpu]'\\''" in lines[2]

    out = _pod(
        "run",
        *common,
        "--config",
        "configs/qwen3_8b_dapo.yaml",
        "--run-dir",
        "/mnt/runs/a",
        "--",
        "run.steps=5",
        "data.system_prompt=be brief",
    ).stdout
    assert out == (
        "+ gcloud compute tpus tpu-vm ssh rl --zone=us-east5-a --worker=all --command "
        "'cd $HOME/delta_jax && nohup delta-jax train --config configs/qwen3_8b_dapo.yaml "
        "run.dir=/mnt/runs/a run.steps=5 data.system_prompt=be\\ brief > "
        "$HOME/delta_jax_train.log 2>&1 < /dev/null &'\n"
    )
    out = _pod("logs", *common, "--worker", "3").stdout
    assert out == (
        "+ gcloud compute tpus tpu-vm ssh rl --zone=us-east5-a --worker=3 --command "
        "'tail -n +1 -F $HOME/delta_jax_train.log'\n"
    )
    out = _pod("delete", *common).stdout
    assert out == "+ gcloud compute tpus tpu-vm delete rl --zone=us-east5-a --quiet\n"


def test_pod_usage_errors():
    for args, message in [
        (("create", "--zone", "z"), "--name (or TPU_NAME) is required"),
        (("--name", "a", "--zone", "z"), "no command given"),
        (("create", "--name", "a", "--zone", "z", "--type", "v3-8"), "--type v3-8"),
        (("create", "delete", "--name", "a", "--zone", "z"), "two commands"),
        (("logs", "--name", "a", "--zone", "z", "--worker", "x"), "--worker x"),
        (("nuke", "--name", "a"), "unknown argument 'nuke'"),
    ]:
        proc = _pod("--dry-run", *args)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)
    assert "Commands:" in _pod("--help").stdout


def test_local_launcher_dry_run():
    proc = subprocess.run(
        [
            sys.executable,
            str(LOCAL),
            "--dry-run",
            "--processes",
            "2",
            "--devices-per-process",
            "3",
            "--port",
            "4567",
            "--",
            "delta-jax",
            "train",
            "run.steps=3",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = proc.stdout.splitlines()
    assert len(lines) == 2
    for i, line in enumerate(lines):
        assert line == (
            f"DELTA_JAX_COORDINATOR=127.0.0.1:4567 DELTA_JAX_NUM_PROCESSES=2 "
            f"DELTA_JAX_PROCESS_ID={i} JAX_PLATFORMS=cpu "
            "XLA_FLAGS=--xla_force_host_platform_device_count=3 delta-jax train run.steps=3"
        )


def test_local_launcher_runs_and_propagates_failure(tmp_path, monkeypatch):
    local = _local_module()
    log = tmp_path / "out.txt"
    show = "import os; print(os.environ['DELTA_JAX_PROCESS_ID'], os.environ['XLA_FLAGS'])"
    # Each process gets its own device count; the other XLA flags are passed on.
    other = "--xla_backend_optimization_level=0"
    monkeypatch.setenv("XLA_FLAGS", f"{other} --xla_force_host_platform_device_count=8")
    with log.open("w") as sink:
        status = local.launch(
            [sys.executable, "-c", show], processes=3, devices_per_process=2, sink=sink
        )
    assert status == 0
    lines = sorted(log.read_text().splitlines())
    want = f"{other} --xla_force_host_platform_device_count=2"
    assert lines == [f"[p{i}] {i} {want}" for i in range(3)]
    # Process 1 fails at once; process 0 would sleep for a minute and must be stopped.
    fail = (
        "import os, sys, time; i = os.environ['DELTA_JAX_PROCESS_ID']; "
        "time.sleep(60) if i == '0' else sys.exit(7)"
    )
    start = time.monotonic()
    with (tmp_path / "fail.txt").open("w") as sink:
        status = local.launch([sys.executable, "-c", fail], processes=2, sink=sink)
    assert status == 7
    assert time.monotonic() - start < 30
    with pytest.raises(ValueError, match="processes=0"):
        local.launch(["true"], processes=0)


def test_jobset_manifest_is_consistent():
    manifest = yaml.safe_load((ROOT / "launch" / "gke" / "jobset.yaml").read_text())
    assert manifest["kind"] == "JobSet"
    job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = job["template"]["spec"]
    container = pod["containers"][0]
    topo = topology("v5p-64")
    dims = [int(d) for d in pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"].split("x")]
    assert math.prod(dims) == topo.chips
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5p-slice"
    assert job["parallelism"] == job["completions"] == topo.hosts
    assert container["resources"]["limits"]["google.com/tpu"] == topo.chips_per_host
    command = container["command"]
    assert command[:2] == ["delta-jax", "train"]
    assert (ROOT / command[command.index("--config") + 1]).is_file()


def test_distributed_initialize_validation(monkeypatch):
    for key in (
        distributed.ENV_COORDINATOR,
        distributed.ENV_NUM_PROCESSES,
        distributed.ENV_PROCESS_ID,
    ):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert distributed.initialize() is False  # single process: nothing to do
    with pytest.raises(ValueError, match="without a coordinator"):
        distributed.initialize(num_processes=2, process_id=1)
    with pytest.raises(ValueError, match="needs num_processes and process_id"):
        distributed.initialize("localhost:1234", num_processes=2)
    with pytest.raises(ValueError, match=r"process_id=2 not in \[0, num_processes=2\)"):
        distributed.initialize("localhost:1234", num_processes=2, process_id=2)
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
    with pytest.raises(ValueError, match="DELTA_JAX_NUM_PROCESSES='two'"):
        distributed.initialize("localhost:1234", process_id=0)
    assert distributed.is_main_process()
