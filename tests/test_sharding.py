"""Meshes, placement rules, and sharded == single-device numerics on 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from delta_jax import sharding as sh
from delta_jax.config import OptimConfigSection
from delta_jax.models import ModelConfig, Transformer
from delta_jax.rl.state import init_sharded_state, init_train_state, make_optimizer
from delta_jax.rl.train_step import TrainBatch, make_train_step
from delta_jax.sampling import Sampler
from tests.batches import padded_batch, padded_plan

MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2)]
PROMPT, GEN, ROWS = 6, 5, 8  # ROWS per micro-batch: a multiple of every mesh's 8 batch shards
# Same maths on the same inputs; only the reduction order changes under a mesh (float32).
TOL = 1e-5


def test_topology_names():
    assert (sh.topology("v5p-64").chips, sh.topology("v5p-64").hbm_bytes) == (32, 95 * 2**30)
    assert (sh.topology("v4-32").chips, sh.topology("v4-32").hbm_bytes) == (16, 32 * 2**30)
    assert (sh.topology("v5e-8").chips, sh.topology("v5e-1").chips) == (8, 1)
    assert (sh.topology("v6e-1").chips, sh.topology("v6e-1").hbm_bytes) == (1, 32 * 2**30)
    assert sh.topology("v5p-64").hosts == 8
    with pytest.raises(ValueError, match="topology='v9-8'"):
        sh.topology("v9-8")
    with pytest.raises(ValueError, match="multiple of 2"):
        sh.topology("v4-3")


def test_mesh_shapes_and_errors():
    assert sh.resolve_mesh_shape((-1, 2, 1), 8) == (4, 2, 1)
    assert dict(sh.make_mesh(-1, 2, 2).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert dict(sh.make_mesh(1, -1, 1).shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert sh.make_mesh(topology_name="v5e-1").size == 1
    with pytest.raises(ValueError, match="needs 16 devices"):
        sh.resolve_mesh_shape((4, 4, 1), 8)
    with pytest.raises(ValueError, match="not divisible"):
        sh.make_mesh(-1, 3, 1)
    with pytest.raises(ValueError, match="at most one -1"):
        sh.make_mesh(-1, -1, 1)
    with pytest.raises(ValueError, match="needs 32 devices"):
        sh.make_mesh(-1, 1, 1, topology_name="v5p-64")


@pytest.fixture(scope="module")
def model():
    return Transformer(ModelConfig.tiny("qwen3"), rngs=nnx.Rngs(3))


def test_param_placement_by_rules(model):
    mesh = sh.make_mesh(2, 2, 2)
    _, params = nnx.split(model, nnx.Param)
    train = sh.param_shardings(params, mesh, sh.TRAIN_RULES)
    sample = sh.param_shardings(params, mesh, sh.SAMPLE_RULES)
    # Written from the model's logical names: wq (layers, embed, heads, head_dim),
    # w_down (layers, mlp, embed), embed (vocab, embed), final_norm (embed,).
    assert train["blocks"]["wq"].get_value().spec == P(None, "fsdp", "tensor", None)
    assert train["blocks"]["w_down"].get_value().spec == P(None, "tensor", "fsdp")
    assert train["embed"].get_value().spec == P("tensor", "fsdp")
    assert train["final_norm"].get_value().spec == P("fsdp")
    assert sample["blocks"]["wq"].get_value().spec == P(None, None, "tensor", None)
    assert sample["embed"].get_value().spec == P("tensor", None)
    # The tiny model has K=2 kv heads: tensor=2 divides it, tensor=4 must fall back to replicated.
    mesh4 = sh.make_mesh(1, 2, 4)
    wk = sh.param_shardings(params, mesh4)["blocks"]["wk"].get_value()
    assert wk.spec == P(None, "fsdp", None, None)


def test_shard_params_keeps_values(model):
    mesh = sh.make_mesh(2, 2, 2)
    _, params = nnx.split(model, nnx.Param)
    placed = sh.shard_params(params, mesh)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(placed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert b.sharding.mesh == mesh


def test_optimizer_state_mirrors_params(model):
    mesh = sh.make_mesh(2, 2, 2)
    _, params = nnx.split(model, nnx.Param)
    opt = make_optimizer(OptimConfigSection(lr=1e-3), total_updates=10)
    state, shardings = init_sharded_state(params, opt, mesh)
    adam = state.opt_state[1][0]
    for p, mu, nu in zip(
        jax.tree.leaves(state.params),
        jax.tree.leaves(adam.mu),
        jax.tree.leaves(adam.nu),
        strict=True,
    ):
        assert mu.sharding == p.sharding and nu.sharding == p.sharding
    assert state.step.sharding.spec == P()
    assert jax.tree.structure(shardings) == jax.tree.structure(state)


def test_batch_placement_and_errors():
    mesh = sh.make_mesh(2, 2, 2)
    assert sh.batch_sharding(mesh).spec == P(None, ("data", "fsdp"))
    assert sh.batch_divisor(mesh) == 4
    rng = np.random.default_rng(0)
    batch = {"ids": rng.integers(0, 9, (2, 8, 5)), "adv": rng.normal(size=(2, 8)), "none": None}
    out = sh.host_local_batch_to_global(batch, mesh)
    assert out["none"] is None
    np.testing.assert_array_equal(np.asarray(out["ids"]), batch["ids"])
    assert out["ids"].sharding.spec == P(None, ("data", "fsdp"))
    # Each device holds b / 4 = 2 rows.
    assert {s.data.shape for s in out["ids"].addressable_shards} == {(2, 2, 5)}
    with pytest.raises(ValueError, match=r"\['adv'\].*not divisible by the 4 batch shards"):
        sh.host_local_batch_to_global({"adv": np.zeros((1, 6))}, mesh)
    with pytest.raises(ValueError, match="expected \\[M, b, ...\\]"):
        sh.host_local_batch_to_global({"adv": np.zeros((6,))}, mesh)
    rows = sh.host_local_batch_to_global(batch["ids"][0], mesh, row_axis=0)
    assert rows.sharding.spec == P(("data", "fsdp"))
    np.testing.assert_array_equal(np.asarray(rows), batch["ids"][0])


def _batch(seed: int, micro: int, vocab: int) -> TrainBatch:
    """Left-padded prompts ++ right-padded responses of varied lengths, random advantages."""
    rng = np.random.default_rng(seed)
    rows = ROWS
    ids = rng.integers(1, vocab, (micro, rows, PROMPT + GEN)).astype(np.int32)
    plen = rng.integers(2, PROMPT + 1, (micro, rows))
    glen = rng.integers(1, GEN + 1, (micro, rows))
    pos = np.arange(PROMPT + GEN)
    attn = (pos >= PROMPT - plen[..., None]) & (pos < PROMPT + glen[..., None])
    resp = np.arange(GEN) < glen[..., None]
    adv = rng.normal(size=(micro, rows)).astype(np.float32)
    return padded_batch(ids, attn, resp, adv)


def _one_step(model, mesh, loss, micro, batch_np):
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.tree.map(jnp.copy, params)
    plan = padded_plan(loss, PROMPT, GEN, ROWS)
    # Adam's first update is lr * g / (|g| + eps): with eps=1e-8 a gradient entry near 1e-8 turns
    # float32 reduction-order noise into a visible parameter change. eps=1e-6 bounds that gain
    # (lr / eps = 1e3) while every parameter still moves by up to lr.
    optim = OptimConfigSection(lr=1e-3, eps=1e-6, weight_decay=0.1)
    opt = make_optimizer(optim, total_updates=10)
    if mesh is None:
        state = init_train_state(params, opt)
        batch = jax.tree.map(jnp.asarray, batch_np)
        step = make_train_step(graphdef, opt, plan)
        new_state, metrics = step(state, batch)
    else:
        state, _ = init_sharded_state(params, opt, mesh)
        kwargs = sh.train_jit_kwargs(state, mesh)
        batch = sh.host_local_batch_to_global(batch_np, mesh)
        step = make_train_step(graphdef, opt, plan, mesh=mesh, jit_kwargs=kwargs)
        with sh.use_mesh(mesh):
            new_state, metrics = step(state, batch)
        for p in jax.tree.leaves(new_state.params):
            assert p.sharding.mesh == mesh
    return jax.device_get(new_state.params), jax.device_get(metrics)


# Inline DelTA (statistics over the sharded batch inside the loss) on every mesh; gradient
# accumulation over two micro-batches on the mesh that uses all three axes.
@pytest.mark.parametrize(
    ("loss", "micro", "meshes"), [("delta", 1, MESHES), ("dapo", 2, MESHES[2:])]
)
def test_train_step_sharded_equals_single_device(model, loss, micro, meshes):
    batch = _batch(seed=micro, micro=micro, vocab=model.config.vocab_size)
    ref_params, ref_metrics = _one_step(model, None, loss, micro, batch)
    for shape in meshes:
        params, metrics = _one_step(model, sh.make_mesh(*shape), loss, micro, batch)
        np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=TOL, atol=TOL)
        np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=TOL)
        for (path, a), b in zip(
            jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params), strict=True
        ):
            np.testing.assert_allclose(
                a, b, rtol=TOL, atol=TOL, err_msg=f"{shape} {jax.tree_util.keystr(path)}"
            )


def test_reshard_for_sampling_moves_only_differing_leaves(model):
    _, params = nnx.split(model, nnx.Param)
    data_only = sh.make_mesh(8, 1, 1)
    placed = sh.shard_params(params, data_only)
    assert sh.reshard_for_sampling(placed, data_only) is placed
    mesh = sh.make_mesh(2, 2, 2)
    placed = sh.shard_params(params, mesh)
    out = sh.reshard_for_sampling(placed, mesh)
    # q_norm (layers, head_dim) is replicated under both tables: the very same buffer.
    assert out["blocks"]["q_norm"].get_value() is placed["blocks"]["q_norm"].get_value()
    assert out["blocks"]["wq"].get_value().sharding.spec == P(None, None, "tensor", None)
    np.testing.assert_array_equal(np.asarray(out["embed"].get_value()), params["embed"].get_value())


def test_sampling_layout_is_tensor_parallel_in_compute_dtype(model):
    """The rollout's layout: the trainer's FSDP devices regrouped into tensor-parallel groups
    of the KV heads, weights cast to the compute dtype; the engine samples the same tokens."""
    _, params = nnx.split(model, nnx.Param)
    mesh = sh.make_mesh(1, 8, 1)
    sample_mesh = sh.sampling_mesh(mesh, model.config.num_kv_heads)
    assert dict(sample_mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    assert list(sample_mesh.devices.flat) == list(mesh.devices.flat)
    placed = sh.shard_params(params, mesh)
    half = sh.reshard_for_sampling(placed, mesh, sample_mesh=sample_mesh, dtype=jnp.bfloat16)
    wq = half["blocks"]["wq"].get_value()
    assert wq.dtype == jnp.bfloat16 and wq.sharding.mesh is sample_mesh
    assert wq.sharding.spec == P(None, None, "tensor", None)
    np.testing.assert_array_equal(
        np.asarray(wq, np.float32),
        np.asarray(params["blocks"]["wq"].get_value().astype(jnp.bfloat16), np.float32),
    )
    # Per device: a 2-way split of the heads, half the bytes of float32.
    assert wq.addressable_shards[0].data.nbytes * 4 == params["blocks"]["wq"].get_value().nbytes
    prompts = [[5, 9, 2], [7], [1, 2, 3, 4, 5], [11, 3]]
    ref = Sampler(model, engine="continuous").generate(prompts, max_new_tokens=6, temperature=0.0)
    full = sh.reshard_for_sampling(placed, mesh, sample_mesh=sample_mesh, dtype=jnp.float32)
    out = Sampler(model, mesh=sample_mesh, engine="continuous", decode_slots=4).generate(
        prompts, max_new_tokens=6, temperature=0.0, params=full
    )
    assert out.tokens == ref.tokens
    np.testing.assert_allclose(
        np.asarray(out.logprob_array), np.asarray(ref.logprob_array), atol=TOL
    )
    # One slot in each of the 4 data groups, each group with its own pool share: all used.
    stats = out.engine_stats
    assert len(stats.high_water_pages) == 4 and min(stats.high_water_pages) > 0
    assert stats.free_pages_after == (stats.group_pages - 1,) * 4


def test_sampler_greedy_identical_under_mesh(model):
    prompts = [[5, 9, 2], [7], [1, 2, 3, 4, 5], [11, 3], [8, 8, 8, 8], [6], [2, 4], [9, 1, 3]]
    ref = Sampler(model).generate(prompts, max_new_tokens=6, temperature=0.0)
    _, params = nnx.split(model, nnx.Param)
    for shape in MESHES:
        mesh = sh.make_mesh(*shape)
        sampler_params = sh.reshard_for_sampling(sh.shard_params(params, mesh), mesh)
        out = Sampler(model, mesh=mesh).generate(
            prompts, max_new_tokens=6, temperature=0.0, params=sampler_params
        )
        assert out.tokens == ref.tokens, shape
        np.testing.assert_allclose(
            np.asarray(out.logprob_array), np.asarray(ref.logprob_array), atol=TOL
        )


def test_no_recompilation_across_steps(model):
    """Second sharded update and second resharding for the sampler compile nothing new."""
    compiles = []

    def listener(name, duration, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    mesh = sh.make_mesh(2, 2, 2)
    graphdef, params = nnx.split(model, nnx.Param)
    opt = make_optimizer(OptimConfigSection(lr=1e-3), total_updates=10)
    state, _ = init_sharded_state(params, opt, mesh)
    step = make_train_step(
        graphdef,
        opt,
        padded_plan("dapo", PROMPT, GEN, ROWS),
        mesh=mesh,
        jit_kwargs=sh.train_jit_kwargs(state, mesh),
    )
    batches = [_batch(seed=s, micro=1, vocab=model.config.vocab_size) for s in (5, 6)]
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        counts = []
        for batch in batches:
            with sh.use_mesh(mesh):
                state, _ = step(state, sh.replicated_to_global(batch, mesh))
            sh.reshard_for_sampling(state.params, mesh)
            counts.append(len(compiles))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert counts[0] > 0 and counts[1] == counts[0], counts


def test_replicated_to_global_matches_host_copy():
    mesh = sh.make_mesh(1, 4, 2)
    rng = np.random.default_rng(1)
    batch = {"ids": rng.integers(0, 9, (2, 8, 3)), "none": None}
    out = sh.replicated_to_global(batch, mesh)
    assert out["none"] is None and out["ids"].sharding.spec == P(None, "fsdp")
    np.testing.assert_array_equal(np.asarray(out["ids"]), batch["ids"])
    # An array already on the mesh is resharded on device, values unchanged.
    moved = sh.replicated_to_global(
        {"x": jax.device_put(batch["ids"], sh.batch_sharding(sh.make_mesh(8, 1, 1)))}, mesh
    )["x"]
    assert moved.sharding.spec == P(None, "fsdp")
    np.testing.assert_array_equal(np.asarray(moved), batch["ids"])
    with pytest.raises(ValueError, match="multiple of the 4 batch shards"):
        sh.replicated_to_global({"x": np.zeros((1, 6))}, mesh)
