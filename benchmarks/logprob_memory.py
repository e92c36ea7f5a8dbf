"""Peak memory of token_logprobs vs full-logits log_softmax + gather (compiled, not run).

Both paths run the same small decoder (hidden 64, 1 layer) on B=8, T=1024 tokens with a
V=151936 vocabulary, so the [B, T, V] logits dominate. For each path the compiled executable's
``memory_analysis()`` gives temp + output bytes (arguments excluded: they are the same params
and tokens for both), for the forward pass and for forward + backward (gradient w.r.t. all
parameters of a weighted sum of the log-probs, as in a policy-gradient loss).

Usage: python benchmarks/logprob_memory.py [--batch 8 --length 1024 --vocab 151936]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from delta_jax.models import ModelConfig, Transformer, token_logprobs


def _full_path(model, ids, targets, temperature):
    logits = model(ids).logits.astype(jnp.float32) / temperature
    return jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]


def _ours(model, ids, targets, temperature):
    return token_logprobs(model, ids, targets, temperature=temperature).logprobs


def _measure(path_fn, graphdef, state, ids, targets, backward: bool) -> int:
    def fwd(state, ids, targets):
        return path_fn(nnx.merge(graphdef, state), ids, targets, 0.7)

    def loss(state, ids, targets):
        w = jnp.linspace(-1.0, 1.0, ids.size).reshape(ids.shape)
        return jnp.sum(w * fwd(state, ids, targets))

    fn = jax.grad(loss) if backward else fwd
    compiled = jax.jit(fn).lower(state, ids, targets).compile()
    mem = compiled.memory_analysis()
    return int(mem.temp_size_in_bytes + mem.output_size_in_bytes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()

    cfg = ModelConfig.tiny(
        "qwen3",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_layers=1,
        tie_word_embeddings=False,
    )
    model = nnx.eval_shape(lambda: Transformer(cfg))
    graphdef, state = nnx.split(model, nnx.Param)
    ids = jax.ShapeDtypeStruct((args.batch, args.length), jnp.int32)
    print(
        f"backend={jax.default_backend()} B={args.batch} T={args.length} V={args.vocab} "
        f"H={args.hidden}; logits f32 [B,T,V] = "
        f"{args.batch * args.length * args.vocab * 4 / 2**30:.2f} GiB"
    )
    print(f"{'pass':<18}{'full logits (GiB)':>20}{'token_logprobs (GiB)':>22}{'ratio':>8}")
    for backward in (False, True):
        full = _measure(_full_path, graphdef, state, ids, ids, backward)
        ours = _measure(_ours, graphdef, state, ids, ids, backward)
        name = "forward+backward" if backward else "forward"
        print(f"{name:<18}{full / 2**30:>20.3f}{ours / 2**30:>22.3f}{ours / full:>8.3f}")


if __name__ == "__main__":
    main()
