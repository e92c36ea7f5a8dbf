"""The pass before the update on the TPU compiler: skipping empty micro-batches, and not.

The prepare program (:func:`delta_jax.rl.prepare.make_prepare`: the old-policy pass over every
micro-batch of the rollout batch, DelTA's coefficients from its hidden states, the reference
pass) of ``--config`` with ``--overrides``, lowered for a TPU topology (compile-only, no TPU
needed) twice: as the trainer runs it (packed micro-batches of padding only skipped by a
``lax.cond``) and with every micro-batch computed. Prints each program's temporaries and FLOPs
(the TPU compiler's ``memory_analysis`` and ``cost_analysis``) and the ratio: a skip that costs
memory on the TPU compiler (as the LM head's did) shows here.

    python benchmarks/prepare_tpu.py [--config configs/qwen3_0.6b_gsm8k_delta.yaml]
        [--topology v5p-8] [overrides ...]
"""

from __future__ import annotations

import argparse
from unittest import mock

import jax

from delta_jax import sharding as sh
from delta_jax.config import load_config
from delta_jax.plan.compiler import plan_mesh
from delta_jax.plan.models import resolve_model_config
from delta_jax.plan.programs import Planner
from delta_jax.rl import prepare
from delta_jax.rl.packing import micro_batch_shape
from delta_jax.rl.train_step import abstract_batch

GiB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/qwen3_0.6b_gsm8k_delta.yaml")
    parser.add_argument("--topology", default="v5p-8")
    parser.add_argument("overrides", nargs="*", default=["algo.mini_batches=4"])
    args = parser.parse_args()
    config = load_config(args.config, args.overrides)
    mesh, described = plan_mesh(config, args.topology, "tpu")
    planner = Planner(config, mesh, resolve_model_config(config))
    plan, shards = planner.update_plan, sh.batch_divisor(mesh)
    micro, rows = micro_batch_shape(plan, plan.rows_per_update, shards)
    print(f"{described}; {args.config} {' '.join(args.overrides)}")
    print(
        f"{plan.mini_batches} mini-batches x {micro} micro-batches x {rows} rows of {plan.row_len}"
    )
    print(
        f"coefficients: {plan.coefficients}; old pass {plan.old_pass}; reference {plan.reference}"
    )
    one = abstract_batch(plan, rows)
    batch_sharding = sh.rows_sharding(mesh, row_axis=2)
    aval = lambda x: jax.ShapeDtypeStruct(
        (plan.mini_batches, *x.shape), x.dtype, sharding=batch_sharding
    )
    batch = jax.tree.map(aval, one)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        planner.params,
        planner.param_shardings,
    )
    ref = params if plan.reference else None
    figures = {}
    every = lambda fn, mb, *args: fn(*args)
    for name, patch in (("skipping", None), ("every micro-batch", every)):
        program = prepare.make_prepare(planner.graphdef, plan, mesh=mesh)
        with mock.patch.object(prepare, "unless_padding", patch or prepare.unless_padding):
            with sh.use_mesh(mesh):
                compiled = program.lower(params, ref, batch).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        cost = compiled.cost_analysis()
        flops = (cost[0] if isinstance(cost, list) else cost).get("flops", 0.0)
        figures[name] = temp, flops
        print(f"{name}: temporaries {temp / GiB:.3f} GiB, {flops:.3e} FLOPs", flush=True)
    (a, fa), (b, fb) = figures["skipping"], figures["every micro-batch"]
    print(f"skipping / every micro-batch: temporaries {a / b:.3f}x, FLOPs {fa / fb:.3f}x")


if __name__ == "__main__":
    main()
