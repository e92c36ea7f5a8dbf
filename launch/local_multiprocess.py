"""Run one command as N cooperating JAX processes on this machine (multi-host, simulated on CPU).

Each process gets its own fake CPU devices and the ``DELTA_JAX_*`` variables that
``delta_jax.distributed.initialize`` reads, so ``jax.distributed`` connects them through a
coordinator on localhost and gloo collectives. Output lines are prefixed with ``[p<i>]``; when one
process fails the others are terminated, and the exit status is the first non-zero one.

Usage:
  python launch/local_multiprocess.py --processes 2 --devices-per-process 2 -- \\
      delta-jax train --config configs/demo.yaml run.steps=3
  python launch/local_multiprocess.py --dry-run --processes 2 -- python my_script.py
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(
    process_id: int,
    processes: int,
    devices_per_process: int,
    port: int,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of process ``process_id``: CPU platform, fake devices, coordinator."""
    env = dict(os.environ if base is None else base)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = (
        f"{flags.strip()} --xla_force_host_platform_device_count={devices_per_process}".strip()
    )
    env["JAX_PLATFORMS"] = "cpu"
    env["DELTA_JAX_COORDINATOR"] = f"127.0.0.1:{port}"
    env["DELTA_JAX_NUM_PROCESSES"] = str(processes)
    env["DELTA_JAX_PROCESS_ID"] = str(process_id)
    return env


def _pump(stream, prefix: str, sink) -> None:
    for line in iter(stream.readline, ""):
        sink.write(f"{prefix}{line}")
        sink.flush()
    stream.close()


def launch(
    command: Sequence[str],
    *,
    processes: int = 2,
    devices_per_process: int = 2,
    port: int | None = None,
    timeout_s: float = 600.0,
    cwd: str | None = None,
    sink=None,
) -> int:
    """Runs ``command`` as ``processes`` JAX processes; returns the job's exit status.

    Args:
      command: the program and its arguments (the same for every process).
      processes: number of processes (simulated hosts).
      devices_per_process: fake CPU devices per process.
      port: coordinator port (default: a free one).
      timeout_s: the whole job's time limit; on expiry every process is killed and 124 returned.
      cwd: working directory of the processes.
      sink: where prefixed output goes (default ``sys.stdout``).

    Returns:
      0 when every process exited with 0, else the first failing process's status.
    """
    if processes < 1 or devices_per_process < 1:
        raise ValueError(
            f"processes={processes} and devices_per_process={devices_per_process} must be >= 1"
        )
    if not command:
        raise ValueError("command is empty")
    sink = sys.stdout if sink is None else sink
    port = free_port() if port is None else port
    procs, pumps = [], []
    for i in range(processes):
        p = subprocess.Popen(
            list(command),
            env=process_env(i, processes, devices_per_process, port),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        t = threading.Thread(target=_pump, args=(p.stdout, f"[p{i}] ", sink), daemon=True)
        t.start()
        procs.append(p)
        pumps.append(t)
    deadline = time.monotonic() + timeout_s
    status = 0
    while [p.poll() for p in procs].count(None):  # polls every process, sets returncode
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            status = failed[0] if failed else 124
            for p in procs:  # only the processes this launcher started, each by its own handle
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.1)
    for p in procs:
        p.wait()
    for t in pumps:
        t.join(timeout=5)
    if status == 0:
        status = next((p.returncode for p in procs if p.returncode != 0), 0)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=2)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole job")
    parser.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program args...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    if args.dry_run:
        port = args.port or 12355
        for i in range(args.processes):
            env = process_env(i, args.processes, args.devices_per_process, port, base={})
            print(
                " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())),
                shlex.join(command),
            )
        return 0
    return launch(
        command,
        processes=args.processes,
        devices_per_process=args.devices_per_process,
        port=args.port,
        timeout_s=args.timeout,
    )


if __name__ == "__main__":
    sys.exit(main())
