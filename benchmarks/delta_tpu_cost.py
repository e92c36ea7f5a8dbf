"""DelTA's share of a train step's FLOPs and HBM bytes, from the TPU compiler's cost analysis.

Compile-only (libtpu, no TPU, no weights: every input is a ``jax.ShapeDtypeStruct``): the
project's jitted train step (forward + backward + AdamW) for ``loss=delta`` and ``loss=dapo`` on
one chip of a v5p, one response row of ``S = prompt + response`` tokens, one micro-batch (DelTA's
coefficients computed inside the loss). DelTA's extra work is the difference of the two programs'
``cost_analysis()`` figures.

The TPU compiler's cost analysis counts the body of a while loop once, whatever its trip count
(an 8-step ``lax.scan`` of a matmul reports the flops of one step), and a Pallas kernel (splash
attention) as no flops. So the programs compiled here have no loops over the sequence or the
layers: ``dense`` attention, unrolled layers, and the LM head in one chunk (the chunk size of
``delta_jax.models.logprobs`` is raised for this process only). Dense attention does not fit a
chip at the paper's 22.5k tokens, and the program grows with the number of layers, so each model
is compiled with 1 and 2 decoder layers at three lengths and scaled:

* per layer = ``cost(L=2) - cost(L=1)``; the rest (embedding, LM head, loss, their optimiser
  update) = ``cost(L=1) - per layer``; the whole step = ``rest + L * per layer``;
* over lengths, the quadratic ``a + b S + c S^2`` through the three compiled lengths gives the
  figure at the paper's length (dense attention's flops are exactly quadratic in S);
* DelTA's extra = ``cost_delta(L=1) - cost_dapo(L=1)``, extrapolated the same way: the
  coefficients read the final hidden states only, so the extra does not depend on L (checked
  once per run with ``--check-layers``).

HBM bytes: dense attention moves the ``S x S`` scores through HBM, which a flash kernel (splash)
keeps on chip, so the bytes share is given twice: against the dense step (a lower bound of the
share) and against the step without its ``c S^2`` term (no score traffic: an upper bound).

    JAX_PLATFORMS=cpu python benchmarks/delta_tpu_cost.py --models Qwen3-8B --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import topologies

from delta_jax.config import load_config
from delta_jax.models import ModelConfig, Transformer
from delta_jax.models import logprobs as logprobs_lib
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
    config = ModelConfig(**{**shape, "num_layers": layers}, attention="dense", scan_layers=False)
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
    start = time.perf_counter()
    compiled = step.lower(place(state), place(batch)).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "flops": float(cost["flops"]),
        "bytes": float(cost["bytes accessed"]),
        "compile_s": round(time.perf_counter() - start, 1),
    }


def quadratic(xs, ys) -> np.ndarray:
    """Coefficients (c, b, a) of the quadratic through three points."""
    return np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 2)


def shares(rows: list[dict], layers: int, target: int) -> dict:
    """DelTA's extra and its share of the L-layer step at ``target`` tokens, per metric."""
    xs = [r["tokens"] for r in rows]
    out = {}
    for metric in ("flops", "bytes"):
        keys = ("dapo_L1", "dapo_L2", "delta_L1")
        col = {key: np.array([r[key][metric] for r in rows]) for key in keys}
        per_layer = quadratic(xs, col["dapo_L2"] - col["dapo_L1"])
        rest = quadratic(xs, col["dapo_L1"]) - per_layer
        step = rest + layers * per_layer
        extra = float(np.polyval(quadratic(xs, col["delta_L1"] - col["dapo_L1"]), target))
        dapo = float(np.polyval(step, target))
        linear = float(np.polyval(step[1:], target))  # the step without its S^2 term
        out[metric] = {
            "dapo_step": dapo,
            "dapo_step_without_s2": linear,
            "delta_extra": extra,
            "share": extra / (dapo + extra),
            "share_without_s2": extra / (linear + extra),
        }
    return out


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
    parser.add_argument(
        "--check-layers", action="store_true", help="also compile DelTA with 2 layers (shortest)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # The LM head in one chunk: a lax.map over chunks would be counted once (module docstring).
    logprobs_lib._CHUNK_ELEMENTS = 2**40
    device = topologies.get_topology_desc(topology_name=args.topology, platform="tpu").devices[0]
    target = args.prompt + args.gen
    results = {}
    for name in args.models:
        shape = MODELS[name]
        rows = []
        for i, gen in enumerate(args.lengths):
            prompt = gen * args.prompt // args.gen
            keys = [(1, "dapo"), (2, "dapo"), (1, "delta")]
            if args.check_layers and i == 0:
                keys.append((2, "delta"))
            c = {k: step_cost(shape, k[0], k[1], prompt, gen, device) for k in keys}
            rows.append({"tokens": prompt + gen, **{f"{k[1]}_L{k[0]}": v for k, v in c.items()}})
            print(name, json.dumps(rows[-1]), flush=True)
            if "delta_L2" in c:
                for m in ("flops", "bytes"):
                    extra = [c[(n, "delta")][m] - c[(n, "dapo")][m] for n in (1, 2)]
                    print(f"  DelTA extra {m} with 1 / 2 layers: {extra[0]:.6g} / {extra[1]:.6g}")
        out = {"compiled": rows, **shares(rows, shape["num_layers"], target)}
        results[name] = out
        f, b = out["flops"], out["bytes"]
        print(
            f"{name} (L={shape['num_layers']}) at {target} tokens: DelTA extra "
            f"{f['delta_extra']:.4g} of {f['dapo_step']:.4g} flops = {f['share']:.4%}; HBM bytes "
            f"{b['delta_extra']:.4g} of {b['dapo_step']:.4g} = {b['share']:.4%} (dense "
            f"attention), {b['share_without_s2']:.4%} against the step without S^2 traffic",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target_tokens": target, "topology": args.topology, **results}, f, indent=1)


if __name__ == "__main__":
    main()
