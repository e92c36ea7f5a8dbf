"""Per-chip memory of a run's train step alone, from the TPU compiler (compile-only).

``delta-jax plan`` compiles the train step and the sampler side; this compiles the train step
only (one micro-batch as configured), for the fit boundary of a model size on a slice when the
sampling side is already known from exact figures. Needs libtpu; no TPU attached.

  JAX_PLATFORMS=cpu python benchmarks/train_memory.py --config configs/qwen3_0.6b_gsm8k_delta.yaml \
      --topology v5e-8 model.path=Qwen/Qwen3-4B run.mesh=[1,-1,1] algo.micro_batches=4
"""

from __future__ import annotations

import argparse

from delta_jax import plan as plan_lib
from delta_jax import sharding as sh
from delta_jax.config import load_config
from delta_jax.plan.models import describe
from delta_jax.plan.report import GiB as _GiB


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--topology", required=True)
    parser.add_argument("--headroom", type=float, default=0.95)
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    model_config = plan_lib.resolve_model_config(config)
    mem = plan_lib.compile_train_step(config, args.topology, model_config=model_config)
    topo = sh.topology(args.topology)
    hbm = topo.hbm_bytes  # v5e / v6e: one device per chip
    budget = hbm * args.headroom
    more = ">= " if mem.out_of_memory else ""
    print(f"{describe(config.model.path, model_config)} on {args.topology}")
    print(f"train step, TPU compiler (compile-only), GiB per device; HBM {hbm / _GiB:.2f}")
    print(f"  arguments {mem.arguments / _GiB:.2f}, outputs {mem.outputs / _GiB:.2f}")
    print(f"  temporaries {more}{mem.temporaries / _GiB:.2f}")
    print(
        f"  peak {more}{mem.peak / _GiB:.2f} = {more}{mem.peak / hbm:.1%} of HBM, "
        f"{more}{mem.peak / budget:.1%} of the {args.headroom:.0%} budget "
        f"({'fits' if not mem.out_of_memory and mem.peak <= budget else 'does not fit'})"
    )
    print(f"  compile {mem.compile_s:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
