"""Generated tokens/s of ``delta_jax.sampling.Sampler`` vs ``transformers`` ``generate`` on CPU.

Both sides sample at temperature 1 with no truncation from the same architecture (random
weights), prompt length 64, exactly 128 new tokens (no stop token), batch 1 / 8 / 64, on two
configs (tiny and small, see ``bench_models.SIZES``). PyTorch runs with 2 threads. The first
call of each shape is reported apart (for us it includes XLA compilation); the throughput is the
best of ``--repeats`` later calls (on a shared machine the minimum is the least disturbed figure).

The machine's float32 matmul throughput is measured with a jitted square matmul, and each of
our rows is also given as a fraction of it: "% matmul" counts the forward FLOPs of the generated
tokens only (tokens/s x FLOPs/token), "+prefill %" adds the prompt prefill that every call also
does (the compute-bound row is small, batch 64).

Two ceilings put each row in context, both measured on this machine:

* "mem roof": the tokens/s a decoder cannot beat when every step streams all float32 weights
  (tied head included) plus each row's K/V from memory at the measured read bandwidth (a
  jitted sum over 1 GiB). Small models at batch 1 are bound by this.
* "mm alone %": the decode step's weight matmuls run alone (every layer's q/k/v/o and MLP
  projections and the LM head at M = batch, jitted, no attention, norms or sampling), as a
  percentage of the square matmul's GFLOP/s. In the compute-bound rows this is the realistic
  ceiling of "% matmul" at that batch; at tiny sizes per-op overheads dominate instead and it
  is no bound.

``--engines`` instead compares our two engines in one run: the static ``Sampler`` and
``Sampler(engine="continuous", decode_slots=batch)``, same float32 weights and prompts, greedy,
exactly ``--new-tokens`` per row (equal lengths), tokens checked identical; the two engines'
calls are interleaved (static, continuous, static, ...) so that load on a shared machine hits
both alike, and each figure is the median of ``--repeats`` calls after a first (compiling) one.

Usage::

    python benchmarks/sampler_throughput.py                 # the full table
    python benchmarks/sampler_throughput.py --engines --repeats 5   # static vs continuous
    python benchmarks/sampler_throughput.py --quick         # reduced: tiny only, batch 1 / 8,
                                                            # 32 new tokens, 1 repeat
    python benchmarks/sampler_throughput.py --configs small --batches 64 --skip-hf
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_models import SIZES, bench_config

from delta_jax.models import ModelConfig, Transformer
from delta_jax.sampling import Buckets, Sampler


def hf_config(name: str):
    """The transformers config of a benchmark size: the same hyperparameters as ours."""
    import transformers

    cfg = bench_config(name)
    hf = cfg.to_hf()
    hf.update(max_position_embeddings=1024, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    return transformers.AutoConfig.for_model(**hf)


def matmul_weights(name: str) -> int:
    """Weights one decoded token multiplies: every layer's q/k/v/o and MLP, and the LM head."""
    c = SIZES[name]
    h, d, f = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    n, k = c["num_heads"], c["num_kv_heads"]
    per_layer = h * n * d * 2 + h * k * d * 2 + 3 * h * f
    return c["num_layers"] * per_layer + h * c["vocab_size"]


def flops_per_token(name: str, context: int) -> float:
    """Forward FLOPs of one decoded token: 2 x (matmul weights) + attention over ``context``."""
    c = SIZES[name]
    attention = 2 * c["num_heads"] * c["head_dim"] * context  # scores and weighted values
    return 2.0 * (matmul_weights(name) + c["num_layers"] * attention)


def matmul_gflops(size: int = 2048, repeats: int = 5) -> float:
    """Best-of-``repeats`` float32 ``[size, size] @ [size, size]`` throughput in GFLOP/s."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)
    mm = jax.jit(jnp.matmul)
    mm(a, b).block_until_ready()
    best = min(_timed(lambda: mm(a, b).block_until_ready()) for _ in range(repeats))
    return 2 * size**3 / best / 1e9


def read_bandwidth(mib: int = 1024, repeats: int = 7) -> float:
    """Best-of-``repeats`` memory read bandwidth in GB/s: a jitted sum over ``mib`` MiB."""
    x = jnp.ones((mib * 2**18,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    return (
        x.nbytes / min(_timed(lambda: total(x).block_until_ready()) for _ in range(repeats)) / 1e9
    )


def bytes_per_step(name: str, batch: int, context: int) -> float:
    """Bytes one decode step must read: all matmul weights (f32) + each row's K/V."""
    c = SIZES[name]
    kv = 2 * c["num_layers"] * c["num_kv_heads"] * c["head_dim"] * context
    return 4.0 * (matmul_weights(name) + batch * kv)


def matmul_only_tps(name: str, batch: int, steps: int = 10, repeats: int = 3) -> float:
    """Tokens/s of the decode step's weight matmuls alone at M = ``batch`` (see module doc)."""
    c = SIZES[name]
    h, d, f, v = c["hidden_size"], c["head_dim"], c["intermediate_size"], c["vocab_size"]
    n, k = c["num_heads"], c["num_kv_heads"]
    key = jax.random.key(0)

    def w(i, shape):
        return 0.02 * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)

    layers = [
        [
            w(7 * i + j, s)
            for j, s in enumerate(
                [(h, n * d), (h, k * d), (h, k * d), (n * d, h), (h, f), (h, f), (f, h)]
            )
        ]
        for i in range(c["num_layers"])
    ]
    head = w(10**6, (v, h))

    @jax.jit
    def run(x, layers, head):
        def step(_, x):
            for wq, wk, wv, wo, wg, wu, wd in layers:
                q, kk, vv = x @ wq, x @ wk, x @ wv
                x = x + (q + jnp.tile(kk + vv, (1, n // k))) @ wo
                x = x + ((x @ wg) * (x @ wu)) @ wd
            logits = jnp.einsum("BH,VH->BV", x, head)
            return x + logits[:, :h] * 1e-3

        return jax.lax.fori_loop(0, steps, step, x)

    x = jnp.ones((batch, h), jnp.float32)
    run(x, layers, head).block_until_ready()
    best = min(_timed(lambda: run(x, layers, head).block_until_ready()) for _ in range(repeats))
    return batch * steps / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_ours(name, batches, prompt_len, new_tokens, repeats):
    cfg = ModelConfig.from_hf(hf_config(name).to_dict())
    sampler = Sampler(
        Transformer(cfg),
        stop_token_ids=(),
        buckets=Buckets(prompt=(prompt_len,), generation=(new_tokens,)),
    )
    rng = np.random.default_rng(0)
    rows = {}
    for batch in batches:
        prompts = rng.integers(1, cfg.vocab_size, (batch, prompt_len)).tolist()

        def run(seed, prompts=prompts, batch=batch):
            out = sampler.generate(prompts, max_new_tokens=new_tokens, temperature=1.0, seed=seed)
            out.token_array.block_until_ready()
            assert out.lengths == [new_tokens] * batch
            return out

        first = _timed(lambda: run(0))
        times = [_timed(lambda s=s: run(s)) for s in range(1, repeats + 1)]
        rows[batch] = (first, min(times))
    return rows


def bench_engines(name, batches, prompt_len, new_tokens, repeats):
    """Static vs continuous engine, interleaved; prints one row per batch (medians)."""
    cfg = ModelConfig.from_hf(hf_config(name).to_dict())
    model = Transformer(cfg)
    kw = dict(stop_token_ids=(), buckets=Buckets(prompt=(prompt_len,), generation=(new_tokens,)))
    rng = np.random.default_rng(0)
    for batch in batches:
        engines = {
            "static": Sampler(model, **kw),
            "continuous": Sampler(model, engine="continuous", decode_slots=batch, **kw),
        }
        prompts = rng.integers(1, cfg.vocab_size, (batch, prompt_len)).tolist()

        def run(sampler, prompts=prompts):
            out = sampler.generate(prompts, max_new_tokens=new_tokens, temperature=0.0)
            out.token_array.block_until_ready()
            return out

        first = {k: run(s) for k, s in engines.items()}
        static, cont = (np.asarray(first[k].token_array)[:batch] for k in engines)
        assert (static == cont).all(), "the engines' greedy tokens differ"
        stats = first["continuous"].engine_stats
        times = {k: [] for k in engines}
        for _ in range(repeats):
            for k, s in engines.items():
                times[k].append(_timed(lambda s=s: run(s)))
        tps = {k: batch * new_tokens / float(np.median(v)) for k, v in times.items()}
        print(
            f"{name:6} {batch:5d} | {tps['static']:10.1f} {tps['continuous']:10.1f} | "
            f"{tps['continuous'] / tps['static']:6.2f}x | {stats.chunks:6d} "
            f"{stats.occupancy:9.2f} {stats.preemptions:5d}",
            flush=True,
        )


def bench_hf(name, batches, prompt_len, new_tokens, repeats):
    import torch
    import transformers

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name)).eval()
    rng = np.random.default_rng(0)
    rows = {}
    for batch in batches:
        ids = torch.tensor(rng.integers(1, model.config.vocab_size, (batch, prompt_len)))

        def run(ids=ids, batch=batch):
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    pad_token_id=0,
                    eos_token_id=None,
                )
            assert out.shape == (batch, prompt_len + new_tokens)

        first = _timed(run)
        times = [_timed(run) for _ in range(repeats)]
        rows[batch] = (first, min(times))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="tiny,small")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true", help="only time delta_jax")
    parser.add_argument("--quick", action="store_true", help="tiny, batch 1/8, 32 tokens, 1 rep")
    parser.add_argument("--engines", action="store_true", help="static vs continuous engine")
    args = parser.parse_args()
    if args.quick:
        args.configs, args.batches, args.new_tokens, args.repeats = "tiny", "1,8", 32, 1
    names = args.configs.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    if args.engines:
        print(
            f"backend {jax.default_backend()}, prompt {args.prompt_len}, new tokens "
            f"{args.new_tokens}, greedy, median of {args.repeats} interleaved calls"
        )
        header = (
            f"{'config':6} {'batch':>5} | {'static':>10} {'continuous':>10} | {'ratio':>7} | "
            f"{'chunks':>6} {'occupancy':>9} {'preempt':>5}"
        )
        print(header + "\n" + "-" * len(header))
        for name in names:
            bench_engines(name, batches, args.prompt_len, args.new_tokens, args.repeats)
        return

    gflops = matmul_gflops()
    bandwidth = read_bandwidth()
    print(f"backend {jax.default_backend()}, devices {jax.device_count()}")
    print(f"float32 matmul (2048^3, jitted): {gflops:.1f} GFLOP/s")
    print(f"memory read bandwidth (1 GiB jitted sum): {bandwidth:.1f} GB/s")
    print(f"prompt {args.prompt_len}, new tokens {args.new_tokens}, best of {args.repeats}")
    header = (
        f"{'config':6} {'batch':>5} | {'ours tok/s':>10} {'first s':>8} | {'hf tok/s':>9} "
        f"{'first s':>8} | {'speedup':>7} | {'ours GFLOP/s':>12} {'% matmul':>8} "
        f"{'+prefill %':>10} | {'mem roof':>8} {'mm alone %':>10}"
    )
    print(header)
    print("-" * len(header))
    for name in names:
        ours = bench_ours(name, batches, args.prompt_len, args.new_tokens, args.repeats)
        hf = None
        if not args.skip_hf:
            hf = bench_hf(name, batches, args.prompt_len, args.new_tokens, args.repeats)
        # Mean attention context over the generated tokens; the prefill's work is counted in a
        # second column (each call also prefills batch x prompt tokens).
        context = args.prompt_len + args.new_tokens // 2
        flops = flops_per_token(name, context)
        prefill_flops = args.prompt_len * flops_per_token(name, args.prompt_len // 2)
        for batch in batches:
            first, t = ours[batch]
            tps = batch * args.new_tokens / t
            achieved = tps * flops / 1e9
            with_prefill = batch * (args.new_tokens * flops + prefill_flops) / t / 1e9
            hf_cols = f"{'-':>9} {'-':>8} | {'-':>7}"
            if hf is not None:
                hf_first, hf_t = hf[batch]
                hf_tps = batch * args.new_tokens / hf_t
                hf_cols = f"{hf_tps:9.1f} {hf_first:8.2f} | {tps / hf_tps:6.2f}x"
            roof = batch * bandwidth * 1e9 / bytes_per_step(name, batch, context)
            alone = matmul_only_tps(name, batch) * flops_per_token(name, 0) / 1e9 / gflops
            print(
                f"{name:6} {batch:5d} | {tps:10.1f} {first:8.2f} | {hf_cols} | "
                f"{achieved:12.1f} {100 * achieved / gflops:7.1f}% "
                f"{100 * with_prefill / gflops:9.1f}% | {roof:8.1f} "
                f"{100 * alone:9.1f}%",
                flush=True,
            )


if __name__ == "__main__":
    main()
