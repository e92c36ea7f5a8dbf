"""DelTA's share of a train step's FLOPs and HBM bytes, from the TPU compiler's cost analysis.

Compile-only (libtpu, no TPU, no weights: every input is a ``jax.ShapeDtypeStruct``): the
project's jitted train step (forward + backward + AdamW) for ``loss=delta`` and ``loss=dapo`` on
one chip of a v5p, one response row of ``S = prompt + response`` tokens. DelTA's extra work is
the difference of the two programs' ``cost_analysis()`` figures.

A whole 8B-70B step at the paper's 22.5k tokens is too heavy to compile here (dense attention
today; the layers' program grows with L). So the step is compiled with 1 and 2 decoder layers
at three lengths, and scaled: the per-layer cost is ``cost(2) - cost(1)``, the rest (embedding,
LM head, loss, DelTA, optimiser of those) is ``cost(1) - per-layer``, a whole model is
``rest + L * per-layer``; over lengths, a quadratic ``a + b S + c S^2`` through the three
compiled lengths extrapolates to the paper's length (attention is the quadratic term). DelTA's
extra cost is compiled at the same three lengths for 1 layer (it does not depend on L) and
extrapolated the same way. Printed: the compiled figures and the extrapolated shares.

    JAX_PLATFORMS=cpu python benchmarks/delta_tpu_cost.py --models Qwen3-8B --json out.json
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import topologies

from delta_jax.config import load_config
from delta_jax.models import Transformer
from delta_jax.plan import KNOWN_MODELS
from delta_jax.rl.state import init_train_state, make_optimizer
from delta_jax.rl.train_step import abstract_batch, make_train_step
from delta_jax.rl.update_plan import UpdatePlan

# A 70B-shaped Qwen3 (Llama-3-70B widths and depth, Qwen3 vocabulary and qk-norm).
MODELS = {
    "Qwen3-8B": KNOWN_MODELS["Qwen3-8B"],
    "Qwen3-14B": KNOWN_MODELS["Qwen3-14B"],
    "70B-shaped": {
        **KNOWN_MODELS["Qwen3-14B"],
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_layers": 80,
        "num_heads": 64,
    },
}


def step_cost(shape: dict, layers: int, loss: str, prompt: int, gen: int, device) -> dict:
    """flops and bytes accessed of one compiled train step (1 row, ``layers`` layers)."""
    from delta_jax.models import ModelConfig

    config = ModelConfig(**{**shape, "num_layers": layers})
    abstract = nnx.eval_shape(lambda: Transformer(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    optimizer = make_optimizer(load_config(None).optim, 100)
    state = jax.eval_shape(lambda p: init_train_state(p, optimizer), params)
    # One response row in the padded layout, one update: DelTA's coefficients in the loss.
    plan = UpdatePlan.padded(loss, prompt, gen, 2)
    step = make_train_step(graphdef, optimizer, plan)
    sds = jax.ShapeDtypeStruct
    batch = abstract_batch(plan, 1)
    on_chip = jax.sharding.SingleDeviceSharding(device)
    place = lambda tree: jax.tree.map(lambda x: sds(x.shape, x.dtype, sharding=on_chip), tree)
    compiled = step.lower(place(state), place(batch)).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"flops": float(cost["flops"]), "bytes": float(cost["bytes accessed"])}


def quadratic_at(xs, ys, x) -> float:
    """The quadratic through three points, evaluated at ``x``."""
    return float(np.polyval(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 2), x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--prompt", type=int, default=2048, help="paper: 2048")
    parser.add_argument("--gen", type=int, default=20480, help="paper: 20480")
    parser.add_argument(
        "--lengths",
        type=int,
        nargs=3,
        default=[1024, 2048, 4096],
        help="compiled response lengths (prompt scaled alike)",
    )
    parser.add_argument("--topology", default="v5p:2x2x1")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = topologies.get_topology_desc(topology_name=args.topology, platform="tpu").devices[0]
    target = args.prompt + args.gen
    results = {}
    for name in args.models:
        shape = MODELS[name]
        rows = []
        for gen in args.lengths:
            prompt = gen * args.prompt // args.gen
            c = {
                (layers, loss): step_cost(shape, layers, loss, prompt, gen, device)
                for layers in (1, 2)
                for loss in ("dapo", "delta")
            }
            rows.append({"tokens": prompt + gen, **{f"{k[1]}_L{k[0]}": v for k, v in c.items()}})
            print(name, rows[-1], flush=True)
        xs = [r["tokens"] for r in rows]
        out = {"compiled": rows}
        for metric in ("flops", "bytes"):
            per_layer = quadratic_at(
                xs, [r["dapo_L2"][metric] - r["dapo_L1"][metric] for r in rows], target
            )
            rest = quadratic_at(xs, [r["dapo_L1"][metric] for r in rows], target) - per_layer
            dapo = rest + shape["num_layers"] * per_layer
            extra = quadratic_at(
                xs, [r["delta_L1"][metric] - r["dapo_L1"][metric] for r in rows], target
            )
            out[metric] = {"dapo_step": dapo, "delta_extra": extra, "share": extra / (dapo + extra)}
        results[name] = out
        print(
            f"{name}: DelTA share at {target} tokens: flops {out['flops']['share']:.5%}, "
            f"HBM bytes {out['bytes']['share']:.5%}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target_tokens": target, "topology": args.topology, **results}, f, indent=1)


if __name__ == "__main__":
    main()
