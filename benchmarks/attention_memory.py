"""Attention memory and speed: dense vs splash on the TPU compiler, dense vs chunked on CPU.

Part 1 (``--part tpu``, needs libtpu): per-chip memory of Qwen3-8B's train step (the paper's
``configs/qwen3_8b_delta.yaml``: one 22.5k-token row per chip per micro-batch on v5p-64, FSDP)
compiled compile-only by the TPU compiler, at 2k, 8k, 16k and 22.5k tokens per row, with
``model.attention`` dense and splash. A program the compiler refuses (out of HBM) is shown with
the requirement its error states (">=": a lower bound).

Part 2 (``--part cpu``): wall time of the tiny model's forward + backward (the train step's
gradient, no optimiser update) on this CPU at T = 512, 2048, 4096 tokens, dense vs chunked;
median of ``--repeats`` calls after one warm-up (compile) call, and the ratio in one run.

  JAX_PLATFORMS=cpu python benchmarks/attention_memory.py --part cpu
  JAX_PLATFORMS=cpu python benchmarks/attention_memory.py --part tpu --lengths 2048 8192
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from delta_jax import plan as plan_lib
from delta_jax.config import load_config
from delta_jax.models import ModelConfig, Transformer, token_logprobs

_GiB = 1024**3
CONFIG = "configs/qwen3_8b_delta.yaml"


def tpu_table(lengths, topology: str, overrides) -> None:
    print(f"Qwen3-8B train step per chip on {topology} (TPU compiler, compile-only), GiB")
    print(f"{'tokens/row':>10} {'attention':>9} {'temporaries':>12} {'peak':>8} {'compile s':>9}")
    buffer = load_config(CONFIG, list(overrides)).reward.overlong_buffer
    for total in lengths:
        prompt = 2048 if total >= 8192 else 512
        new = total - prompt
        config = load_config(
            CONFIG,
            [
                f"data.max_prompt_length={prompt}",
                f"rollout.max_new_tokens={new}",
                f"reward.overlong_buffer={min(buffer, new)}",  # no longer than a response
                *overrides,
            ],
        )
        for impl in ("dense", "splash"):
            mem = plan_lib.compile_train_step(config, topology, attention=impl)
            more = ">=" if mem.out_of_memory else "  "
            print(
                f"{total:>10} {impl:>9} {more}{mem.temporaries / _GiB:>10.2f} "
                f"{more}{mem.peak / _GiB:>6.2f} {mem.compile_s:>9.0f}",
                flush=True,
            )


def cpu_table(lengths, repeats: int) -> None:
    print("tiny model forward + backward on CPU (batch 1), median seconds")
    print(f"{'T':>6} {'dense s':>9} {'chunked s':>10} {'chunked/dense':>14}")
    for T in lengths:
        times = {}
        for impl in ("dense", "chunked"):
            cfg = ModelConfig.tiny("qwen3", max_position_embeddings=T, attention=impl)
            graphdef, params = nnx.split(Transformer(cfg))
            ids = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (1, T)))

            @jax.jit
            def grad(params, ids=ids, graphdef=graphdef):
                def loss(p):
                    return -token_logprobs(nnx.merge(graphdef, p), ids, ids).logprobs.mean()

                return jax.grad(loss)(params)

            jax.block_until_ready(grad(params))
            runs = []
            for _ in range(repeats):
                start = time.perf_counter()
                jax.block_until_ready(grad(params))
                runs.append(time.perf_counter() - start)
            times[impl] = statistics.median(runs)
        ratio = times["chunked"] / times["dense"]
        print(f"{T:>6} {times['dense']:>9.3f} {times['chunked']:>10.3f} {ratio:>14.2f}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("tpu", "cpu", "both"), default="both")
    parser.add_argument("--topology", default="v5p-64")
    parser.add_argument("--lengths", type=int, nargs="*", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="config overrides for the TPU part")
    args = parser.parse_args(argv)
    if args.part in ("tpu", "both"):
        tpu_table(args.lengths or [2048, 8192, 16384, 22528], args.topology, args.overrides)
    if args.part in ("cpu", "both"):
        cpu_table(args.lengths or [512, 2048, 4096], args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
