"""Per-device memory of Qwen3-8B with the paper's batch on TPU v5p-64 and v4-32 (planner).

Runs ``delta-jax plan`` (``delta_jax.plan``) once per slice, each in its own process because a
process's number of stand-in CPU devices is fixed when JAX starts. Nothing is allocated at model
size: the programs are only compiled. Prints each report table, and the wall time.

  python benchmarks/plan_memory.py                      # paper recipe, both slices
  python benchmarks/plan_memory.py --topology v5p-64 -- algo.micro_batches=32
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "qwen3_8b_delta.yaml"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--topology", action="append", help="default: v5p-64 and v4-32")
    parser.add_argument("--no-search", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    status = 0
    for topo in args.topology or ["v5p-64", "v4-32"]:
        cmd = [
            sys.executable,
            "-m",
            "delta_jax.plan",
            "--config",
            args.config,
            "--topology",
            topo,
            *(["--no-search"] if args.no_search else []),
            *args.overrides,
        ]
        print(f"$ {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, text=True)
        print(f"({topo}: {time.perf_counter() - start:.0f}s wall)\n", flush=True)
        status = status or proc.returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
