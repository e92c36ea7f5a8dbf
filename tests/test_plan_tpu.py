"""The planner on the real TPU compiler (compile-only, no TPU attached; needs libtpu, which the
``test`` extra installs): a tiny model's full train step with splash attention on an FSDP mesh
of a v5p 2x2x1 slice, and its sampler program."""

import pytest

from delta_jax import plan as plan_lib
from delta_jax.config import load_config
from delta_jax.models import ModelConfig

pytest.importorskip("libtpu")

ROWS, PROMPT, NEW = 8, 128, 1920  # 8 rows of T = 2048 tokens, 2 rows per chip
OVERRIDES = [
    "run.mesh=[1, -1, 1]",  # FSDP over the 4 chips
    "model.attention_block=512",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=4",
    f"data.max_prompt_length={PROMPT}",
    f"rollout.max_new_tokens={NEW}",
    "algo.mini_batches=1",
    "algo.micro_batches=1",
]


# Small, but with TPU-sized heads (D = 128): tinier dimensions are padded to the 128-lane tiles.
MODEL = ModelConfig.tiny(
    "qwen3",
    hidden_size=256,
    intermediate_size=512,
    num_heads=8,
    num_kv_heads=2,
    head_dim=128,
    max_position_embeddings=2048,
    attention="splash",
    attention_block=512,
)


@pytest.mark.slow  # two TPU compiles
def test_tiny_splash_train_step_and_sampler_compile_for_v5p():
    config = load_config("configs/demo.yaml", OVERRIDES)
    splash = plan_lib.plan(config, "v5p-8", model_config=MODEL, search=False, compiler="tpu")
    dense = plan_lib.compile_train_step(config, "v5p-8", model_config=MODEL, attention="dense")
    assert splash.compiler.startswith("TPU compiler, compile-only for v5p:2x2x1")
    assert splash.mesh == {"data": 1, "fsdp": 4, "tensor": 1}
    assert not splash.train.out_of_memory and not splash.sampler.out_of_memory
    # Bound from the shapes: one layer's float32 [rows, N, T, T] score matrix per chip, which
    # dense attention materialises (the dense program needs more) and splash never does.
    T, rows_per_chip = PROMPT + NEW, ROWS // 4
    scores = 4 * rows_per_chip * MODEL.num_heads * T * T
    assert splash.train.temporaries < scores <= dense.temporaries
    # The engine's page pool is one of its (donated) buffers.
    assert splash.sampler.aliased >= splash.kv_cache_bytes > 0
    assert "TPU compiler" in splash.table().split("train temporaries")[1].splitlines()[0]
