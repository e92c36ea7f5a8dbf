"""Model sizes the benchmarks use (issue figures are quoted for these), in ModelConfig terms.

``tiny``: vocab 4096, hidden 256, 4 layers, 4 heads / 2 KV heads, head dim 64, MLP 768.
``small``: vocab 32000, hidden 1024, 8 layers, 16 / 8 heads, head dim 64, MLP 3072.
``smollm2``: SmolLM2-135M's shapes (Llama): vocab 49152, hidden 576, 30 layers, 9 / 3 heads,
head dim 64, MLP 1536 (random weights of the real model's size; ``configs/smollm2_arith.yaml``
runs the real weights).
"""

from delta_jax.models import ModelConfig

SIZES = {
    "tiny": dict(
        vocab_size=4096,
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=768,
    ),
    "small": dict(
        vocab_size=32000,
        hidden_size=1024,
        num_layers=8,
        num_heads=16,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=3072,
    ),
    "smollm2": dict(
        family="llama",
        vocab_size=49152,
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        rope_theta=100000.0,
        rope_scaling=None,
    ),
}


def bench_config(name: str) -> ModelConfig:
    """A config of the named size (Qwen3-style unless it names its family), tied embeddings."""
    size = dict(SIZES[name])
    return ModelConfig.tiny(size.pop("family", "qwen3"), tie_word_embeddings=True, **size)


def one_second_program(prompt: str, response: str, item) -> float:
    """A reward whose sandboxed program runs for about 1 s, as a code reward's tests may: the
    code sandbox (:func:`delta_jax.rewards.run_code`) with its usual limits."""
    from delta_jax.rewards import run_code

    return float(run_code("import time\ntime.sleep(1.0)", "assert True", timeout_s=5).passed)


def alternate(calls: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each ``name -> call()`` over ``repeats`` rounds, the calls alternating
    within each round (a load change on a shared machine hits all of them); each timing is
    printed as it comes."""
    import statistics
    import time

    import jax

    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - t0)
            print(f"{name}: {times[name][-1]:.2f} s", flush=True)
    return {name: statistics.median(ts) for name, ts in times.items()}
