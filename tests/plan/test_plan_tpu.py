"""The planner on the real TPU compiler (compile-only, no TPU attached; needs libtpu, which the
``test`` extra installs): a tiny model's full train step with splash attention on an FSDP mesh
of a v5p 2x2x1 slice, its sampler program, and the engine's multi-turn continuation programs."""

import pytest

from delta_jax import plan as plan_lib
from delta_jax import sharding as sh
from delta_jax.config import load_config
from delta_jax.models import ModelConfig
from delta_jax.plan.lowering import lower_prefill, lower_write
from delta_jax.sampling.engine.requests import EngineSpec

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
    f"algo.micro_batch_rows={ROWS}",  # the 8 rows in one micro-batch (auto: 2,048 tokens, 4)
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


@pytest.mark.slow  # three TPU compiles
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
    # The roofline's splash calls, read from the compiled HLO: [rows, heads, T, D] per chip (no
    # kernel in the dense program; a rematerialised forward: the test below).
    assert dense.splash is None and splash.train.splash.shape == (rows_per_chip, 8, T, 128)
    assert splash.train.splash == plan_lib.SplashCalls(2, 2, 2, (rows_per_chip, 8, T, 128), 4)


@pytest.mark.slow  # two TPU compiles
def test_multiturn_continuation_programs_compile_for_v5p():
    """What a sequence runs between two turns, compiled for the slice's sampling mesh (2 data
    groups x 2 KV-head shards): the observation written into its output row, and the
    observation prefilled into its own pages from where the turn ended (the prefill program on
    the TPU engine's kernel, page tables from position 0 on, and on the planner's XLA path, its
    page list holding every row's pages). Each updates its donated buffers in place and copies
    none of them."""
    _, devices = plan_lib.tpu_topology_devices("v5p-8")
    mesh = sh.sampling_mesh(sh.make_mesh(1, 4, 1, devices=devices), MODEL.num_kv_heads)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2}
    pages, page_size, rows = 8192, 16, 8
    context = MODEL.max_position_embeddings // page_size  # a row's pages at the longest
    spec = EngineSpec(
        slots=rows,
        steps=8,
        page_size=page_size,
        num_pages=pages,
        seq_pages=context,
        max_table=context,
        prefill_len=64,
        min_len=16,
        prefill_rows=rows,
        groups=2,
        attention="pallas",
        return_hidden=False,
        pad_id=0,
    )
    # A chip holds its group's half of the pages and one of the 2 KV heads (K and V), bfloat16.
    layer_share = pages // 2 * page_size * 2 * MODEL.head_dim * 2
    for attention in ("pallas", "xla"):
        lowered = lower_prefill(
            MODEL, mesh, sh.SAMPLE_RULES, spec, length=64, list_pages=rows // 2 * context,
            attention=attention,
        )  # fmt: skip
        # The TPU engine's prefill attends on the kernel (a Mosaic call), the planner's on XLA.
        assert ("tpu_custom_call" in lowered.as_text()) == (attention == "pallas")
        prefill = lowered.compile().memory_analysis()
        assert prefill.alias_size_in_bytes >= MODEL.num_layers * layer_share
        # Not even one layer's share of the pool in temporaries (no relayout copy of the pages).
        assert 0 < prefill.temp_size_in_bytes < layer_share

    out_rows, gen_len = 64, 4096
    lowered = lower_write(
        MODEL, mesh, sh.SAMPLE_RULES, slots=rows, width=64, rows=out_rows, gen_len=gen_len
    )
    write = lowered.compile().memory_analysis()
    tokens = out_rows // 2 * gen_len * 4  # a chip's rows of one int32 buffer
    assert write.alias_size_in_bytes >= 3 * tokens  # tokens, log-probs, untruncated log-probs
    assert write.temp_size_in_bytes < tokens


def test_loop_cost_reads_tpu_loops():
    """On the TPU compiler's HLO (no recorded trip count): JAX's loops, and the windowed
    all-gather matmul loop the SPMD partitioner makes for an FSDP matmul over 8 chips, whose body
    (4 of the 8 shards' matmuls) XLA's cost analysis counts once."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    from delta_jax.plan.hlo import loop_cost

    _, devices = plan_lib.tpu_topology_devices("v5p-8")
    n = 256
    x = jax.ShapeDtypeStruct((n, n), jnp.float32, sharding=SingleDeviceSharding(devices[0]))

    def step(x):
        return jnp.tanh(x @ x)

    def inner(x):
        return jax.lax.scan(lambda c, _: (step(c), None), x, None, length=4)[0]

    loops = {
        10: lambda x: jax.lax.fori_loop(0, 10, lambda i, x: step(x), x),
        7: lambda x: jax.lax.fori_loop(2, 9, lambda i, x: step(x), x),
        12: lambda x: jax.lax.scan(lambda c, _: (inner(c), None), x, None, length=3)[0],
    }
    for trips, fn in loops.items():
        cost = loop_cost(jax.jit(fn).lower(x).compile().as_text())
        assert cost.unknown_trips == 0
        assert cost.flops == pytest.approx(trips * 2 * n**3, rel=1e-2)

    _, devices = plan_lib.tpu_topology_devices("v5p-16")  # 8 chips
    mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
    B, T, H, F = 8, 2048, 4096, 8192
    shard = NamedSharding(mesh, P("fsdp"))
    xs = jax.ShapeDtypeStruct((B, T, H), jnp.bfloat16, sharding=shard)
    ws = jax.ShapeDtypeStruct((H, F), jnp.bfloat16, sharding=shard)
    matmul = jax.jit(lambda x, w: jnp.einsum("bth,hf->btf", x, w), out_shardings=shard)
    compiled = matmul.lower(xs, ws).compile()
    assert "windowed_dot_general_body" in compiled.as_text()
    per_chip = 2 * B * T * H * F / 8
    assert compiled.cost_analysis()["flops"] < 0.6 * per_chip
    cost = loop_cost(compiled.as_text())
    assert (cost.loops, cost.unknown_trips) == (1, 0)
    assert cost.flops == pytest.approx(per_chip, rel=1e-2)


@pytest.mark.slow  # two TPU compiles
def test_train_step_figures_equal_with_layers_scanned_or_unrolled():
    """Two micro-batches: the step's loop over them (and the scan over layers) at their trip
    counts, so scanned and unrolled layers give the same FLOPs and splash calls; with the block
    rematerialised, each forward kernel runs twice (forward and recompute)."""
    config = load_config("configs/demo.yaml", [*OVERRIDES[:-1], "algo.micro_batches=2"])
    programs = [
        plan_lib.compile_train_step(
            config, "v5p-8", model_config=MODEL, scan_layers=scan, remat="block"
        )
        for scan in (True, False)
    ]
    scanned, unrolled = programs
    assert scanned.loops_counted_once == unrolled.loops_counted_once == 0
    assert scanned.flops == pytest.approx(unrolled.flops, rel=5e-3)
    # 2 layers x 2 micro-batches (x 2 forwards), 1 row per chip ([heads, T, D] kernel shapes)
    assert scanned.splash == unrolled.splash == plan_lib.SplashCalls(8, 4, 4, (1, 8, 2048, 128), 4)


@pytest.mark.slow  # one TPU compile
def test_shared_prompt_train_step_compiles_for_v5p_with_two_splash_parts():
    """Shared prompts on the splash kernel: each layer runs the kernel twice (a response's own
    tokens, its prompt) forward and backward, and the program fits as the unshared one does."""
    config = load_config("configs/demo.yaml", [*OVERRIDES, "algo.share_prompts=true"])
    shared = plan_lib.compile_train_step(config, "v5p-8", model_config=MODEL)
    assert not shared.out_of_memory
    T, rows_per_chip = PROMPT + NEW, ROWS // 4
    assert shared.splash == plan_lib.SplashCalls(4, 4, 4, (rows_per_chip, 8, T, 128), 4)


@pytest.mark.slow  # three TPU compiles
def test_asynchronous_split_meshes_compile_for_v5p():
    """Asynchronous rollouts on a v5p 2x2x1 slice split in two (``rollout.async_devices=2``):
    the train step on the last two chips, the engine's decode chunk on the first two (regrouped
    for decoding), and the cast of the weights copied over to them, each program on its own
    chips only."""
    from delta_jax.plan.programs import Planner

    _, devices = plan_lib.tpu_topology_devices("v5p-8")
    config = load_config(
        "configs/demo.yaml", [*OVERRIDES, "rollout.async_devices=2", "algo.tis_cap=2.0"]
    )
    train_mesh = sh.make_mesh(*config.run.mesh, devices=devices[2:])
    planner = Planner(config, train_mesh, MODEL, sample_mesh=sh.make_mesh(devices=devices[:2]))
    assert set(planner.sample_mesh.devices.flat) == set(devices[:2]) and planner.apart
    train = planner.train(ROWS)
    decode = planner.decode(planner.engine_spec(slots=8))
    _, traffic = planner.reshard()
    assert not train.out_of_memory and not decode.out_of_memory
    assert traffic == 0  # the cast runs where the weights were copied: no collective
