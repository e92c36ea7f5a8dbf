"""Memory planner: search logic, known model shapes, and compiled reports (Qwen3-0.6B on v5e-1)."""

import dataclasses
import math

import jax
import pytest
from flax import nnx

from delta_jax import plan as plan_lib
from delta_jax import sharding as sh
from delta_jax.config import load_config
from delta_jax.extras import MissingExtra
from delta_jax.models import Transformer
from delta_jax.plan import compiler as plan_compiler
from delta_jax.plan.compiler import chip_grid
from delta_jax.plan.programs import Planner
from delta_jax.sampling import Sampler
from delta_jax.sampling.buckets import prepare_request

DEMO = "configs/demo.yaml"


def _brute(measure, unit, budget, limit):
    return max((x for x in range(unit, limit + 1, unit) if measure(x) <= budget), default=0)


@pytest.mark.parametrize(
    ("measure", "unit", "budget", "start", "limit"),
    [
        (lambda x: 10 + 3 * x, 2, 40, 4, 64),
        (lambda x: 10 + 3 * x, 2, 9, 4, 64),  # nothing fits
        (lambda x: 10, 2, 40, 4, 64),  # flat: the limit
        (lambda x: 5 + x, 4, 1000, 8, 64),
        (lambda x: 100 + 7 * x + (x // 16) * 50, 8, 2000, 32, 512),  # steps on top of a line
    ],
)
def test_largest_fitting_matches_brute_force(measure, unit, budget, start, limit):
    calls = []

    def counted(x):
        calls.append(x)
        return measure(x)

    got = plan_lib.largest_fitting(counted, unit, budget, start=start, limit=limit)
    assert got == _brute(measure, unit, budget, limit)
    assert len(calls) == len(set(calls)) <= 8  # each size compiled at most once


def _param_count(c) -> tuple[int, int]:
    """(total, non-embedding) parameters of a Qwen3 config, counted from the architecture."""
    H, F, N, K, D, V = (
        c.hidden_size,
        c.intermediate_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size,
    )
    per_layer = H * N * D + 2 * H * K * D + N * D * H + 3 * H * F + 2 * H + 2 * D
    body = c.num_layers * per_layer + H
    embed = V * H * (1 if c.tie_word_embeddings else 2)
    return body + embed, body


def test_known_models_match_published_sizes():
    # Model cards: Qwen3-0.6B 0.6B total / 0.44B non-embedding; Qwen3-8B 8.2B / 6.95B;
    # Qwen3-14B 14.8B / 13.2B.
    for name, total, body in [
        ("Qwen/Qwen3-0.6B", 0.6e9, 0.44e9),
        ("Qwen/Qwen3-8B-Base", 8.2e9, 6.95e9),
        ("Qwen3-14B", 14.8e9, 13.2e9),
    ]:
        got_total, got_body = _param_count(plan_lib.known_model_config(name))
        assert got_total == pytest.approx(total, rel=0.01), name
        assert got_body == pytest.approx(body, rel=0.01), name
    with pytest.raises(ValueError, match="known models"):
        plan_lib.known_model_config("meta/Llama-9-1T")


@pytest.fixture(scope="module")
def qwen06_report():
    config = load_config(
        DEMO,
        [
            "model.path=Qwen/Qwen3-0.6B",
            "model.dtype=bfloat16",
            "model.scan_layers=true",
            "model.remat=block",
            "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=4",
            "data.max_prompt_length=16",
            "rollout.max_new_tokens=16",
        ],
    )
    return plan_lib.plan(config, "v5e-1", search=False, compiler="cpu")


def test_qwen3_06b_on_v5e_1(qwen06_report):
    r = qwen06_report
    mc = plan_lib.known_model_config("Qwen/Qwen3-0.6B")
    total, _ = _param_count(mc)
    assert (r.chips, r.hbm_bytes, r.mesh) == (1, 16 * 2**30, {"data": 1, "fsdp": 1, "tensor": 1})
    assert r.params_bytes == 4 * total  # float32 master weights on one chip
    # AdamW: two float32 moments per parameter plus a few scalar counters.
    assert 0 <= r.opt_state_bytes - 2 * r.params_bytes <= 64
    # The continuous engine (rollout's default): its 64 decode slots (config default) capped at
    # the 4 x 4 rows of a step; each sequence's own 16 new tokens take up to 2 pages of 16
    # (wherever its prompt ends in a page), each of the 4 prompts 1 shared page (its 15 prefix
    # tokens), so the pool holds 16 x 2 + 4 x 1 + scratch.
    assert (r.engine, r.cache_slots, r.num_pages, r.page_size) == ("continuous", 16, 37, 16)
    L, K, D = mc.num_layers, mc.num_kv_heads, mc.head_dim
    assert r.kv_cache_bytes == L * 37 * 16 * 2 * K * D * 2  # k and v pages, bfloat16
    assert r.sampler_params_bytes == 2 * total  # the sampling copy in the compute dtype
    assert r.shared_params_bytes == 0  # every float32 leaf moves: no buffer read in place
    # The donated train state is both an argument and (aliased) an output of the step.
    state = r.params_bytes + r.opt_state_bytes
    assert r.train.arguments >= state and r.train.aliased >= state
    # The engine's programs take the sampling copy and the (donated) pool as arguments.
    assert r.sampler.arguments >= r.kv_cache_bytes + r.sampler_params_bytes
    assert r.sampler.aliased >= r.kv_cache_bytes and r.prefill.aliased >= r.kv_cache_bytes
    assert r.train.temporaries > 0 and r.sampler.temporaries > 0
    # One chip: the reshard is a local cast, nothing goes through collectives.
    assert r.reshard_collective_bytes == 0
    assert 0 <= r.reshard.outputs - r.sampler_params_bytes <= 1024  # + the output tuple
    assert r.fits == (max(r.train_peak, r.sampling_peak) <= 0.95 * 16 * 2**30)
    table = r.table()
    assert "Qwen/Qwen3-0.6B (L=28 H=1024" in table and "fits:" in table
    assert "largest micro-batch that fits: not searched" in table


def test_lora_base_read_in_place_is_counted_once():
    # A bfloat16 base on one chip stays where the trainer holds it; only the float32 adapters
    # get a bfloat16 sampling copy. The base must not be counted twice in the sampling peak.
    config = load_config(
        DEMO, ["model.lora_rank=4", "model.param_dtype=bfloat16", "model.dtype=bfloat16"]
    )
    mesh = sh.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    planner = Planner(config, mesh, plan_lib.resolve_model_config(config))
    leaves = jax.tree.leaves(planner.params)
    base = sum(x.size * 2 for x in leaves if x.dtype == jax.numpy.bfloat16)
    adapters = sum(x.size for x in leaves if x.dtype == jax.numpy.float32)
    assert base > 0 and adapters > 0
    assert all(x.dtype in (jax.numpy.bfloat16, jax.numpy.float32) for x in leaves)
    assert planner.shared_params_bytes() == base
    assert planner.sampler_params_bytes() == 2 * adapters
    assert planner.params_bytes() == base + 4 * adapters


def test_tiny_plan_on_mesh_matches_real_placement():
    config = load_config(
        DEMO,
        [
            "run.mesh=[2, 2, 2]",
            "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=4",
            "data.max_prompt_length=16",
            "rollout.max_new_tokens=16",
        ],
    )
    report = plan_lib.plan(config, "v5e-8", search=True, compiler="cpu")
    # Independent per-device bytes: place a real tiny model and measure one device's shards.
    model = Transformer(plan_lib.resolve_model_config(config))
    placed = sh.shard_params(nnx.split(model, nnx.Param)[1], sh.make_mesh(2, 2, 2))
    device = jax.devices()[0]
    on_device0 = sum(
        s.data.nbytes
        for x in jax.tree.leaves(placed)
        for s in x.addressable_shards
        if s.device == device
    )
    assert report.params_bytes == on_device0
    mc = model.config
    # Sampling: the same 8 devices as data=4 x tensor=2 (K = 2 kv heads). The 64 decode slots
    # split into 4 data groups, each capped at the 4 rows of its one prompt (4 x 4 rows over
    # 4 groups), each with its own pool share of 4 x 2 own pages + 4 x 1 prompt page + its
    # scratch page; a device holds its group's share, one KV head of it. The demo's cache
    # dtype "auto" is planned as bfloat16, the sampler's default on TPU.
    assert report.sample_mesh == {"data": 4, "fsdp": 1, "tensor": 2}
    assert (report.data_groups, report.cache_slots, report.num_pages) == (4, 16, 4 * 13)
    assert report.kv_cache_bytes == mc.num_layers * 13 * 16 * 2 * 1 * mc.head_dim * 2
    assert "4 data groups x (4 decode slots, 13 pages of 16 tokens" in report.table()
    # FSDP-sharded training weights -> tensor-parallel sampling ones: collectives move them.
    assert report.reshard_collective_bytes > 0
    # The tiny model fits easily: the searches reach their limits (the whole update, and as
    # many decode slots as the call has sequences).
    assert report.max_micro_batch_rows == 16 and report.max_sampler_size == 16
    assert report.fits


def test_plan_errors():
    config = load_config(
        DEMO, ["run.mesh=[8, 1, 1]", "rollout.prompts_per_step=1", "rollout.samples_per_prompt=4"]
    )
    with pytest.raises(ValueError, match="does not split over the 8 batch shards"):
        plan_lib.plan(config, "v5e-8", search=False, compiler="cpu")
    with pytest.raises(ValueError, match="needs 32 devices"):
        plan_lib.plan(load_config(DEMO), "v5p-64", search=False, compiler="cpu")
    with pytest.raises(ValueError, match="--headroom=1.5"):
        plan_lib.main(["--topology", "v5e-1", "--headroom", "1.5"])
    too_few = plan_lib.Workload(mean_new_tokens=0)
    with pytest.raises(ValueError, match=r"--mean-new-tokens=0 must be in \(0, rollout"):
        plan_lib.plan(load_config(DEMO), "v5e-1", roofline=too_few, compiler="cpu")
    with pytest.raises(ValueError, match=r"--mean-new-tokens=0.0 must be in \(0, rollout"):
        plan_lib.main(
            ["--config", DEMO, "--topology", "v5e-1", "--compiler", "cpu", "--no-roofline"]
            + ["--mean-new-tokens", "0"]
        )
    # The previous release's keywords still work, with a DeprecationWarning.
    with pytest.warns(DeprecationWarning, match=r"plan\(mean_new_tokens=\.\.\.\) is deprecated"):
        with pytest.raises(ValueError, match=r"--mean-new-tokens=0 must be in \(0, rollout"):
            plan_lib.plan(load_config(DEMO), "v5e-1", mean_new_tokens=0, compiler="cpu")
    with pytest.raises(TypeError, match="unexpected keyword argument 'mean_new'"):
        plan_lib.plan(load_config(DEMO), "v5e-1", mean_new=1, compiler="cpu")


def test_main_prints_table(capsys):
    assert (
        plan_lib.main(
            [
                "--config",
                DEMO,
                "--topology",
                "v6e-1",
                "--no-search",
                "--compiler",
                "cpu",
                "--tokens-per-step",
                "1.5",
                "--lengths",
                "list:24",  # every response at the cap: the roofline's lengths, as without
                "rollout.prompts_per_step=2",
                "rollout.samples_per_prompt=2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("demo:tiny (L=2 H=64") and "on v6e-1 (1 devices, 32 GiB HBM" in out
    assert math.isfinite(float(out.split("fits: ")[1].split("(train ")[1].split("%")[0]))
    assert "compiler: XLA:CPU on 1 stand-in devices, an estimate (--compiler cpu)" in out
    assert "train temporaries" in out and "XLA:CPU estimate" in out.split("train temporaries")[1]
    # The step-time roofline (on by default in the CLI) with v6e's constants, to the run's hours.
    assert "step-time roofline (v6e: 918 TFLOP/s bf16, 1640 GB/s HBM per chip" in out
    assert "model-FLOPs utilisation bound" in out and "100 steps >= " in out
    # The longest responses (the default): one sequence of 16 + 24 - 1 positions per row.
    assert (
        "update runs 4 of the compiled 4 rows per mini-batch at these lengths (156 positions)"
        in out
    )
    # With a measured tokens per verify step: the verify chunk compiled, its rollout bound beside.
    # (Stand-in CPU devices: the verify chunk compiled on the dense CPU attention path.)
    assert "rollout with speculation >= " in out
    assert "(k=4, dense attention, 1.50 tokens per verify step" in out
    # At a length distribution, the three rollout bounds; every length 24 on as many slots as
    # sequences: one round of 24 decode steps, the slots full, as the uniform bound has it.
    assert "rollout at response lengths list:24 (capped at 24): mean 24" in out
    assert "synchronous (slots refilled, the step waits for its last sequence): rollout" in out
    assert "(24 decode steps x " in out and "slot occupancy 100%" in out
    assert "partial rollouts (slots kept full" in out
    assert "asynchronous on split meshes (max staleness 1): no split" in out


def test_without_libtpu_plan_says_it_used_the_cpu_estimate(monkeypatch):
    monkeypatch.setattr(plan_compiler, "tpu_compiler_available", lambda: False)
    kind, why = plan_lib.resolve_compiler("auto")
    assert kind == "cpu" and why.startswith("libtpu not importable")
    with pytest.raises(MissingExtra, match="--compiler tpu needs libtpu"):
        plan_lib.resolve_compiler("tpu")


def test_chip_grids_of_slices():
    assert chip_grid(32, 3) == (4, 4, 2)  # v5p-64
    assert chip_grid(4, 3) == (2, 2, 1)  # v5p-8
    assert chip_grid(8, 2) == (4, 2)  # v5e-8
    assert chip_grid(1, 2) == (1, 1)
    with pytest.raises(ValueError, match="power-of-two"):
        chip_grid(6, 2)


def test_meshes_on_compile_only_slices():
    """The run's mesh on a slice's compile-only TPU devices: v5p has one device per chip (the
    physical layout), v4's topology one per TensorCore (two per chip; id order)."""
    for topology, devices in (("v5p-16", 8), ("v4-32", 32)):
        _, found = plan_compiler.tpu_topology_devices(topology)
        assert len(found) == devices
        mesh = sh.make_mesh(1, -1, 4, devices=found)
        assert dict(mesh.shape) == {"data": 1, "fsdp": devices // 4, "tensor": 4}
        assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in found)


def test_engine_pool_follows_the_config():
    """The planner sizes the engine's pool as the rollout does: by the engine's rule, or as
    ``rollout.num_pages`` says (no compilation)."""
    overrides = ["data.max_prompt_length=16", "rollout.max_new_tokens=40"]
    mesh = sh.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    sized = {}
    for pages in (0, 50):
        config = load_config(DEMO, [*overrides, f"rollout.num_pages={pages}"])
        planner = Planner(config, mesh, plan_lib.resolve_model_config(config))
        spec = planner.engine_spec(8)
        sized[pages] = (spec.num_pages, planner.pool_bytes(spec))
    mc = plan_lib.resolve_model_config(load_config(DEMO))
    page = mc.num_layers * 16 * 2 * mc.num_kv_heads * mc.head_dim * 2  # bfloat16 K and V
    # 8 slots x (40 new tokens, wherever the prompt ends: up to 4 own pages of 16) + 8 running
    # prompts x (15 prefix tokens: 1 shared page) + the scratch page.
    assert sized == {0: (41, 41 * page), 50: (50, 50 * page)}


def test_planner_sizes_the_engine_with_the_samplers_function():
    """The planner sizes the engine with the sampler's own function (``size_engine``), with no
    sampler: on a mesh of data groups, multi-turn or not, speculative or not, its spec is the
    one the trainer's sampler (as ``rl/setup`` builds it) gives the same request."""
    overrides = [
        "data.max_prompt_length=16",
        "rollout.max_new_tokens=40",
        "rollout.prompts_per_step=6",
        "rollout.samples_per_prompt=4",
    ]
    mesh = sh.make_mesh(2, 1, 2, devices=jax.devices()[:4])
    for turns, slots, k, depth in ((1, 8, 0, 0), (3, 12, 0, 0), (1, 16, 4, 0), (1, 8, 6, 3)):
        config = load_config(DEMO, [*overrides, f"rollout.max_turns={turns}"])
        planner = Planner(config, mesh, plan_lib.resolve_model_config(config))
        request, *_ = planner.request(6)
        sampler = Sampler(
            Transformer(planner.model_config),
            mesh=planner.sample_mesh,
            engine="continuous",
            decode_slots=slots,
            page_size=config.rollout.page_size,
            speculate=k > 0,
            draft_tokens=k,
            draft_depth=depth,
        )
        spec = sampler.engine_spec(request, 4, False, multi_turn=turns > 1)
        assert spec.groups == 2 and (spec.draft_window > 0) == (k > 0)
        assert planner.engine_spec(slots, k, depth) == spec


def test_multiturn_pool_holds_every_waiting_sequence():
    """With ``rollout.max_turns`` > 1 a sequence keeps its pages while a tool answers, with no
    decode slot: the planner sizes the pool as the engine's multi-turn default and reports
    what waiting sequences hold as a line of its own."""
    overrides = [
        "data.max_prompt_length=16",
        "rollout.max_new_tokens=40",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "rollout.decode_slots=8",
    ]
    reports = {
        turns: plan_lib.plan(
            load_config(DEMO, [*overrides, f"rollout.max_turns={turns}"]),
            "v5e-1",
            search=False,
            compiler="cpu",
            compile_train=False,
        )
        for turns in (1, 4)
    }
    one, four = reports[1], reports[4]
    # Single-turn: 8 slots x (40 new tokens, wherever the prompt ends: up to 4 own pages of
    # 16) + 4 prompts x 1 page (15 prefix tokens) + scratch. Multi-turn: all 4 x 4 sequences
    # hold their own pages (8 of them in no slot), + the 4 prompts' pages + scratch.
    assert (one.num_pages, four.num_pages) == (8 * 4 + 4 + 1, 16 * 4 + 4 + 1)
    assert (one.waiting_pages, four.waiting_pages) == (0, 8 * 4)
    page = one.kv_cache_bytes // one.num_pages
    assert (four.kv_cache_bytes, four.waiting_bytes) == (69 * page, 32 * page)
    # The engine's own sizing for such a request (a real sampler over the demo model).
    model = Transformer(plan_lib.resolve_model_config(load_config(DEMO)))
    sampler = Sampler(model, engine="continuous", decode_slots=8, page_size=16)
    request = prepare_request(
        [[1] * 16] * 4,
        max_new_tokens=40,
        n=4,
        stop_token_ids=[0],
        vocab_size=model.config.vocab_size,
        pad_id=0,
        buckets=sampler.buckets,
        max_cache_length=model.config.max_position_embeddings,
    )
    assert sampler.engine_spec(request, 4, False, multi_turn=True).num_pages == four.num_pages
    assert "up to 4 turns" in four.table() and "up to" not in one.table()
    held = [line for line in four.table().splitlines() if "waiting on tools" in line]
    assert held and "32 pages per group" in held[0]
    assert "waiting on tools" not in one.table()
    with pytest.raises(ValueError, match="needs rollout.engine=continuous"):
        static = load_config(DEMO, ["rollout.engine=static", "rollout.max_turns=2"])
        plan_lib.plan(static, "v5e-1", search=False, compiler="cpu", compile_train=False)


# The TPU compiler's refusals as libtpu 0.0.42.1 words them (captured compile-only: Qwen3-8B's
# engine at 214 slots per group, a 20 GiB program on v5e, the engine's decode over 121 slots in
# one kernel call, a Pallas kernel with a 256 MiB VMEM window).
REFUSALS = {
    "SMEM": (
        "RESOURCE_EXHAUSTED: Allocation (size=1769472) would exceed memory (size=1048576) :: "
        "#allocation9 [shape = 'u8[1769472]{0}', space=smem, size = 0x1b0000, scoped, tag = "
        "'prefetched SMEM operand 1'] :: ragged_paged_attention_kernel.1"
    ),
    "HBM": (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (32.00G) exceeds available HBM (15.75G)."
    ),
    "smem, in use": (
        "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
        "smem. Used 1.00M of 1.00M smem. Exceeded smem capacity by 3.1K.\n\nProgram smem "
        "requirement 1.00M:\n    scoped            1.00M"
    ),
    "VMEM": (
        "RESOURCE_EXHAUSTED: Allocation (size=268435456) would exceed memory (size=134217728) :: "
        "#allocation2 [shape = 'u8[268435456]{0}', space=vmem, size = 0x10000000, scoped, tag = "
        "'input window allocation for operator input 0.'] :: _lambda_.1"
    ),
}


def test_compiler_refusals_are_classified():
    got = {k: plan_compiler.compiler_refusal(RuntimeError(v)) for k, v in REFUSALS.items()}
    assert got == {
        "SMEM": ("SMEM", 0),
        "HBM": ("HBM", 32 * 2**30),
        "smem, in use": ("SMEM", 0),
        "VMEM": ("VMEM", 0),
    }
    old = "RESOURCE_EXHAUSTED: CompileTimeHbmOom: Program hbm requirement 9.08G"
    assert plan_compiler.compiler_refusal(RuntimeError(old)) == ("HBM", int(9.08 * 2**30))
    assert plan_compiler.compiler_refusal(RuntimeError("INVALID_ARGUMENT: bad shape")) is None


def test_largest_fitting_bisects_below_refused_sizes():
    # Sizes above 20 are refused (no figure): the search still lands on the largest that fits.
    for cut in (6, 20, 50):
        measure = lambda x, cut=cut: None if x > cut else 10 + x  # noqa: E731
        got = plan_lib.largest_fitting(measure, 2, 10**6, start=4, limit=64)
        assert got == cut // 2 * 2
    assert plan_lib.largest_fitting(lambda x: None, 2, 100, start=4, limit=64) == 0


def test_searches_report_refusals_as_does_not_fit(monkeypatch):
    """Train steps over 8 rows refused for VMEM, engines over 4 slots for SMEM (real messages,
    through ``compile_program``; the sizes that fit cost 1 MiB a row or slot, no compilation):
    the plan finishes, with the largest sizes that fit and the refusals as its bounds."""
    config = load_config(
        DEMO,
        [
            "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=4",
            "data.max_prompt_length=16",
            "rollout.max_new_tokens=16",
            "rollout.decode_slots=4",
            "algo.mini_batches=1",
            "algo.micro_batches=4",
        ],
    )
    MiB = 2**20

    def program(size, refuse_above, message, mesh):
        if size > refuse_above:
            return plan_compiler.compile_program(lambda: _Refused(message), mesh, sh.TRAIN_RULES)
        return plan_lib.ProgramMemory(size * MiB, 0, 0, size * MiB, 0.0)

    monkeypatch.setattr(
        Planner, "train", lambda self, rows: program(rows, 8, REFUSALS["VMEM"], self.mesh)
    )
    monkeypatch.setattr(
        Planner,
        "engine",
        lambda self, spec: (program(spec.slots, 4, REFUSALS["SMEM"], self.mesh),) * 2,
    )
    report = plan_lib.plan(config, "v5e-1", search=True, compiler="cpu")
    assert (report.max_micro_batch_rows, report.max_sampler_size) == (8, 4)
    assert report.micro_batch_bound == "9 rows: TPU compiler: refused, out of VMEM"
    # The decode-slot search stops after 4 measures: the smallest refused size it saw.
    refused = int(report.sampler_bound.split()[0])
    assert 4 < refused <= 16
    assert report.sampler_bound == f"{refused} slots: TPU compiler: refused, out of SMEM"
    table = report.table()
    assert "largest micro-batch that fits: 8 rows; 9 rows: TPU compiler: refused" in table
    assert "largest decode_slots that fits: 4 slots; " in table
    assert report.fits


class _Refused:
    """A lowered program whose compilation the compiler refuses with ``message``."""

    def __init__(self, message):
        self.message = message

    def compile(self):
        raise jax.errors.JaxRuntimeError(self.message)


@pytest.fixture
def unreachable_hub(monkeypatch, tmp_path):
    """An empty local cache and a hub endpoint nothing listens on, HF_HUB_OFFLINE unset."""
    import socket

    import huggingface_hub.constants as hf

    with socket.socket() as probe:  # a port that was free a moment ago: connections are refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(hf, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path))
    return port


def test_offline_bundled_model_is_one_line_and_no_retry(unreachable_hub, monkeypatch):
    import socket
    import time

    connects = []
    real = socket.create_connection
    monkeypatch.setattr(
        socket, "create_connection", lambda *a, **k: connects.append(a) or real(*a, **k)
    )
    lines = []
    start = time.perf_counter()
    mc = plan_lib.resolve_model_config(
        load_config(DEMO, ["model.path=Qwen/Qwen3-8B-Base"]), lines.append
    )
    assert time.perf_counter() - start < 2 and connects == []  # the network is never asked
    assert mc == plan_lib.known_model_config("Qwen3-8B", scan_layers=mc.scan_layers,
                                             remat=mc.remat, attention=mc.attention,
                                             attention_block=mc.attention_block)  # fmt: skip
    assert len(lines) == 1 and "not in the local Hugging Face cache" in lines[0]


def test_offline_unknown_model_is_one_line_error(unreachable_hub):
    import time

    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match=f"hub \\(http://127.0.0.1:{unreachable_hub}\\)"):
        plan_lib.resolve_model_config(load_config(DEMO, ["model.path=someone/unknown-8b"]))
    assert time.perf_counter() - start < 5  # one refused connection, no retries


def test_cached_config_is_read_before_the_bundled_shape(unreachable_hub, tmp_path):
    import json

    # A cached Qwen3-8B-Base config.json (the layout huggingface_hub writes), with one layer less
    # than the bundled shape so the two sources can be told apart.
    cfg = plan_lib.known_model_config("Qwen/Qwen3-8B-Base").replace(num_layers=35).to_hf()
    repo = tmp_path / "models--Qwen--Qwen3-8B-Base"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc")
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "snapshots" / "abc" / "config.json").write_text(json.dumps(cfg))
    lines = []
    mc = plan_lib.resolve_model_config(
        load_config(DEMO, ["model.path=Qwen/Qwen3-8B-Base"]), lines.append
    )
    assert mc.num_layers == 35 and lines == []
    # The bundled shape written as a config.json parses back to itself.
    known = plan_lib.known_model_config("Qwen/Qwen3-8B-Base")
    assert type(known).from_hf(known.to_hf()) == known


def test_roofline_arithmetic_by_hand():
    from delta_jax.models import ModelConfig
    from delta_jax.plan import roofline

    mc = ModelConfig.tiny("qwen3")  # L=2 H=64 F=128 N=4 K=2 D=16 V=256, tied
    L, H, F, N, K, D, V = 2, 64, 128, 4, 2, 16, 256
    assert (mc.num_layers, mc.hidden_size, mc.intermediate_size) == (L, H, F)
    assert (mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.vocab_size) == (N, K, D, V)
    # Matmul weights: the architecture's parameters less norms and embedding, plus the LM head.
    total, body = _param_count(mc)
    mm = body - L * (2 * H + 2 * D) - H + V * H
    assert (
        roofline.matmul_params(mc)
        == mm
        == 2 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128) + 256 * 64
    )
    P = plan_lib.ProgramMemory
    decode = P(0, 0, 0, 0, 0.0, flops=4e6, bytes_accessed=8e6)
    prefill = P(0, 0, 0, 0, 0.0, flops=3e9, bytes_accessed=1e6)
    # The 1-layer step calls a splash forward twice (remat), dq and dkv once: rows of 48 tokens
    # padded to 64, blocks of 32 (3 causal blocks of 2 x 2), 2 rows x 4 heads per device, bf16.
    S = plan_lib.SplashCalls
    one = P(0, 0, 0, 0, 0.0, flops=5e9, bytes_accessed=2e9, splash=S(2, 1, 1, (2, 4, 64, 16), 2))
    two = P(0, 0, 0, 0, 0.0, flops=7e9, bytes_accessed=3e9, splash=S(4, 2, 2, (2, 4, 64, 16), 2))
    block_flops = 2 * 32 * 32 * 16  # one [32, 16] x [16, 32] matmul
    k1 = 2 * 4 * 3 * block_flops * (2 * 2 + 3 + 4)
    k1_bytes = 2 * 4 * 2 * (3 * 2 * 32 * 16 * 4 + 2 * 32 * 16 * (2 * 2 + 3 + 4))
    assert roofline.splash_cost(one.splash, 32) == (k1, k1_bytes)
    assert roofline.splash_cost(two.splash, 128) == (
        2 * 4 * 2 * 64 * 64 * 16 * 2 * 11,
        pytest.approx(2 * 4 * 2 * (16 * 64 * 16 + 22 * 64 * 16)),
    )  # one block of 64 (block > T: b = T)
    assert roofline.splash_cost(None, 32) == (0.0, 0.0)
    mc = mc.replace(attention_block=32)  # the splash kernels' blocks
    tpu = roofline.Slice("v5p-8", chips=4, devices=4)
    programs = roofline.Programs(
        decode, prefill, prefill_tokens=2 * 64, train_one=one, train_two=two
    )
    update = roofline.Update(micro_batches=3, micro_rows=8, mini_batches=2, useful_tokens=48)
    rollout = roofline.Rollout(
        sequences_per_group=20,
        group_slots=8,
        prompts_per_group=5,
        prompt_len=16,
        mean_new=32,
        kv_heads=1,
        cache_itemsize=2,
        weight_bytes=1_000_000,
    )

    def estimate(programs=programs, update=update, speculation=None):
        return roofline.estimate(mc, tpu, programs, update, rollout, 10, speculation)

    st = estimate()
    peak, bw = 459e12, 2765e9
    kv = L * 2 * 1 * D * 2 * (16 + 32 / 2)  # K and V of 32 mean context positions, bf16
    step_bytes = 8e6 + 8 * kv
    assert st.decode_steps == 3 * 32  # ceil(20 / 8) rounds of 32 tokens
    assert st.decode_s == pytest.approx(96 * max(4e6 / peak, step_bytes / bw))
    assert st.prefill_s == pytest.approx(5 * 16 * max(3e9 / peak, 1e6 / bw) / 128)
    # 2 layers from 1 and 2, the kernels' cost added to each (it doubles from 1 to 2 layers);
    # the programs' figures are the whole step, its 3 micro-batches (loops at their trip counts)
    flops, nbytes = 5e9 + 2e9 + 2 * k1, 2e9 + 1e9 + 2 * k1_bytes
    assert (st.train_flops, st.train_bytes) == (flops, nbytes)
    model = 24 * (6 * mm * 48 + 6 * L * N * D * 48**2) / 4  # 3 x 8 rows over 4 devices
    assert st.update_s == pytest.approx(2 * max(flops / peak, nbytes / bw, model / peak))
    assert st.mfu_bound == pytest.approx(model / flops)
    train_s = max(flops / peak, nbytes / bw, model / peak)
    assert st.update_mfu == pytest.approx(model / peak / train_s)
    assert st.update_limit == ("HBM" if nbytes / bw > flops / peak else "FLOP/s")
    assert "update runs 24 of the compiled 24 rows per mini-batch" in "\n".join(st.lines())
    # Packed rows at the mean lengths: 12 of the 24 compiled rows run, the bound halves.
    half = estimate(update=dataclasses.replace(update, rows=12, shared_prompts=True))
    model_half = 12 * (6 * mm * 48 + 6 * L * N * D * 48**2) / 4
    half_s = max(flops / 2 / peak, nbytes / 2 / bw, model_half / peak)
    assert half.update_s == pytest.approx(2 * half_s)
    assert half.mfu_bound == pytest.approx(model_half / (flops / 2))
    assert (
        "update runs 12 of the compiled 24 rows per mini-batch at these lengths (576 positions; "
        "each prompt once per row for its responses)" in "\n".join(half.lines())
    )
    assert st.bytes_per_token == pytest.approx(step_bytes / 8)
    assert st.min_bytes_per_token == pytest.approx(1_000_000 / 8 + kv)
    assert st.run_hours == pytest.approx(10 * (st.decode_s + st.prefill_s + st.update_s) / 3600)
    text = "\n".join(st.lines())
    assert "459 TFLOP/s bf16, 2765 GB/s HBM" in text and "chip-hours on 4 chips" in text
    assert st.train_loops_once == 0 and "loop(s) once" not in text
    assert st.draft_tokens == 0 and "speculation" not in text
    # Speculative rollouts: the verify chunk's step (more FLOPs, nearly the same bytes) over
    # ceil(32 / 2.5) = 13 verify steps per round at 2.5 tokens per verify step.
    verify = P(0, 0, 0, 0, 0.0, flops=2e7, bytes_accessed=8.5e6)
    spec = estimate(speculation=roofline.Speculation(verify, tokens_per_step=2.5, draft_tokens=4))
    verify_s = 3 * 13 * max(2e7 / peak, (8.5e6 + 8 * kv) / bw)
    assert spec.verify_steps == 39 and spec.verify_s == pytest.approx(verify_s)
    assert spec.speculative_rollout_s == pytest.approx(verify_s + st.prefill_s)
    assert spec.rollout_s == st.rollout_s  # the bound without, beside it
    ratio = st.rollout_s / spec.speculative_rollout_s
    assert f"rollout with speculation >= {spec.speculative_rollout_s:,.1f} s, {ratio:.2f}x" in (
        "\n".join(spec.lines())
    )
    for bad in (0.5, 5.5):
        with pytest.raises(ValueError, match=r"tokens per verify step must be in \[1, 5\]"):
            estimate(speculation=roofline.Speculation(verify, tokens_per_step=bad, draft_tokens=4))
    # A trie of 8 drafts up to 3 deep keeps at most 3 of them a step.
    trie = roofline.Speculation(
        verify, 2.5, draft_tokens=8, draft_depth=3, verify_attention="pallas"
    )
    with pytest.raises(ValueError, match=r"tokens per verify step must be in \[1, 4\]"):
        estimate(speculation=dataclasses.replace(trie, tokens_per_step=4.5))
    text = "\n".join(estimate(speculation=trie).lines())
    assert "(k=8 in a trie up to 3 deep, pallas attention, 2.50 tokens per verify step" in text
    unknown = dataclasses.replace(one, loops_counted_once=1)
    st = estimate(programs=dataclasses.replace(programs, train_one=unknown))
    assert "counts 1 loop(s) once" in "\n".join(st.lines())
    with pytest.raises(ValueError, match="no chip constants for 'v9'"):
        roofline.chip("v9-8")


@pytest.mark.slow  # compiles every program of the run
def test_programs_lists_every_program_a_run_compiles():
    """``--programs``: the train step at its one shape (or every bucket of rows in a
    micro-batch, ``algo.micro_batch_rows=bucketed``), the engine's decode chunk at every slot
    bucket and its prefill chunk at every length it compiles at a request's first call, each
    with its time."""
    overrides = ["run.mesh=[2, 2, 2]", "rollout.prompts_per_step=4"]
    overrides += ["rollout.samples_per_prompt=4", "data.max_prompt_length=16"]
    config = load_config(DEMO, [*overrides, "rollout.max_new_tokens=16"])
    report = plan_lib.plan(
        config, "v5e-8", search=False, compiler="cpu", roofline=False, programs=True
    )
    names = [name for name, _ in report.programs]
    # 16 rows per micro-batch on 4 batch shards (data 2 x fsdp 2): buckets of 4, 8, 12, 16.
    train = [f"train step, {r} rows per micro-batch" for r in (4, 8, 12, 16)]
    # 4 decode slots per group (16 sequences over 4 data groups): an eighth (1) up to 4.
    decode = [f"decode chunk, {s} slots per group" for s in (1, 2, 4)]
    prefill = ["prefill chunk, 16 tokens per row", "prefill chunk, 32 tokens per row"]
    assert names == train + decode + prefill, names
    assert all(memory.compile_s > 0 and not memory.out_of_memory for _, memory in report.programs)
    lines = report.table().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("programs a run compiles"))
    assert lines[head].startswith(f"programs a run compiles: {len(names)}, ")
    assert [line[2:46].strip() for line in lines[head + 1 : head + 1 + len(names)]] == names
