"""What a speculative verify step costs against a plain decode step, on an accelerator.

Speculation pays where a decode step is bound by reading the weights (and the KV cache): a
verify step then scores ``k + 1`` positions per sequence for about the cost of one. This script
times the continuous engine's decode with and without verify steps on randomly initialised
models of real shapes (the cost of a step does not depend on the weights' values), sampled at
temperature 1: with a vocabulary this large, random weights give almost no accepted drafts
(printed), so both runs take about as many steps and their wall-time ratio is the cost of a
verify step relative to a decode step. The speed-up a rollout gets is then about the tokens per
verify step measured on the real model (``benchmarks/speculative.py``) divided by that ratio.

    python benchmarks/verify_cost.py --shapes smollm2,qwen3_1.7b --batches 1,8,32,64 --k 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from delta_jax.models import ModelConfig, Transformer
from delta_jax.sampling import Sampler

SHAPES = {
    # SmolLM2-135M (the real model of configs/smollm2_arith.yaml)
    "smollm2": dict(
        family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True,
    ),
    # Qwen3-1.7B
    "qwen3_1.7b": dict(
        family="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True,
        tie_word_embeddings=True,
    ),
}  # fmt: skip


def _model(shape: str, dtype) -> Transformer:
    if shape == "tiny":  # a seconds-long check of the script itself
        config = ModelConfig.tiny("qwen3", vocab_size=4096)
    else:
        config = ModelConfig(**SHAPES[shape], max_position_embeddings=4096)
    return Transformer(config, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))


def _time(sampler, prompts, new, repeats):
    walls, out = [], None
    for r in range(repeats + 1):  # the first call compiles
        start = time.perf_counter()
        out = sampler.generate(prompts, max_new_tokens=new, temperature=1.0, seed=r)
        out.token_array.block_until_ready()
        if r:
            walls.append(time.perf_counter() - start)
    return statistics.median(walls), out.engine_stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="smollm2,qwen3_1.7b")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    device = jax.devices()[0]
    dtype = jnp.float32 if device.platform == "cpu" else jnp.bfloat16
    print(f"{device.device_kind} ({device.platform}), {jnp.dtype(dtype).name}, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, k={args.k}, "
          f"median of {args.repeats}")  # fmt: skip
    print(
        f"{'shape':>11} {'batch':>5} | {'decode s':>8} {'verify s':>8} | cost ratio "
        "| tokens/verify step"
    )
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        model = _model(shape, dtype)
        vocab = model.config.vocab_size
        for batch in map(int, args.batches.split(",")):
            prompts = rng.integers(0, vocab, (batch, args.prompt_len)).tolist()
            kw = dict(engine="continuous", attention="xla", decode_slots=batch, stop_token_ids=())
            plain, _ = _time(Sampler(model, **kw), prompts, args.new_tokens, args.repeats)
            spec = Sampler(model, speculate=True, draft_tokens=args.k, **kw)
            verify, stats = _time(spec, prompts, args.new_tokens, args.repeats)
            print(
                f"{shape:>11} {batch:5d} | {plain:8.3f} {verify:8.3f} | {verify / plain:9.2f}x "
                f"| {stats.tokens_per_verify_step:.3f}",
                flush=True,
            )
        del model


if __name__ == "__main__":
    main()
