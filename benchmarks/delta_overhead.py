"""Cost of the DelTA coefficients next to the LM-head matmul they ride along with.

Times, in one process and interleaved, the jitted ``delta_coefficients`` (default K = 1) on
``[B, T, H]`` hidden states and the jitted LM-head matmul ``[N, H] @ [H, V]`` alone (N = B·T),
and prints the medians and their ratio (target: <= 5%). Also prints the compiled DelTA
program's temporary memory next to the size of ``hidden``, which shows that no ``[B, T, H]``
temporary is allocated.

    python benchmarks/delta_overhead.py                      # N=16384, H=1024, V=32768, f32
    python benchmarks/delta_overhead.py --tokens 4096 --repeats 5 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp

from delta_jax.losses import DeltaOptions, delta_coefficients


def _time(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="N = B * T")
    parser.add_argument("--batch", type=int, default=16, help="B (responses); T = N / B")
    parser.add_argument("--hidden", type=int, default=1024, help="H")
    parser.add_argument("--vocab", type=int, default=32768, help="V")
    parser.add_argument("--refine-steps", type=int, default=1, help="K")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs after compiling")
    args = parser.parse_args()
    if args.tokens % args.batch:
        parser.error(f"--tokens {args.tokens} must be divisible by --batch {args.batch}")
    b, t, h, v = args.batch, args.tokens // args.batch, args.hidden, args.vocab
    dtype = jnp.dtype(args.dtype)

    keys = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(keys[0], (b, t, h), dtype)
    lm_head = (jax.random.normal(keys[1], (h, v), dtype) / h**0.5).astype(dtype)
    logprobs = -jax.random.exponential(keys[2], (b, t))
    advantages = jax.random.normal(keys[3], (b,))
    lengths = jnp.linspace(t // 4, t, b).astype(jnp.int32)
    mask = (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.float32)

    options = DeltaOptions(refine_steps=args.refine_steps)
    delta = jax.jit(functools.partial(delta_coefficients, options=options))
    lm_head_matmul = jax.jit(
        lambda x, w: jnp.einsum("nh,hv->nv", x, w, preferred_element_type=jnp.float32)
    )
    delta_args = (hidden, logprobs, advantages, mask)
    matmul_args = (hidden.reshape(b * t, h), lm_head)

    compiled = delta.lower(*delta_args).compile()
    memory = compiled.memory_analysis()
    for _ in range(args.warmup + 1):  # first call compiles
        _time(delta, *delta_args)
        _time(lm_head_matmul, *matmul_args)
    delta_s, matmul_s = [], []
    for _ in range(args.repeats):  # interleaved so that load changes hit both alike
        delta_s.append(_time(delta, *delta_args))
        matmul_s.append(_time(lm_head_matmul, *matmul_args))

    d, m = statistics.median(delta_s), statistics.median(matmul_s)
    print(f"backend={jax.default_backend()} devices={jax.device_count()} dtype={args.dtype}")
    print(f"N={b * t} (B={b}, T={t}) H={h} V={v} K={args.refine_steps} repeats={args.repeats}")
    print(f"delta_coefficients  median {d * 1e3:10.2f} ms  (min {min(delta_s) * 1e3:.2f})")
    print(f"lm_head matmul      median {m * 1e3:10.2f} ms  (min {min(matmul_s) * 1e3:.2f})")
    print(f"ratio delta / matmul: {100 * d / m:.2f}%  (target <= 5%)")
    if memory is not None:
        print(
            f"delta temporaries: {memory.temp_size_in_bytes / 2**20:.1f} MiB "
            f"(hidden itself: {hidden.nbytes / 2**20:.1f} MiB)"
        )


if __name__ == "__main__":
    main()
