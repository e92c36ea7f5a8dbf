"""Multi-controller JAX on CPU: 2 processes x 2 devices (gloo) against 1 process x 4 devices.

The processes are started by ``launch/local_multiprocess.py``; each runs this file as a script
(the ``__main__`` block below), so the worker code and the in-process reference are the same
function, :func:`run_steps`. The mesh is ``(data=1, fsdp=2, tensor=2)``: the ``fsdp`` axis spans
the two processes, so parameters, optimiser state and batch rows are split across hosts and every
step needs cross-process collectives.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launch" / "local_multiprocess.py"
MESH = (1, 2, 2)
PROMPT, GEN, ROWS = 6, 5, 8
STEPS = 2  # updates before the save the resumed run starts from
# Same program on the same data; only the collectives' reduction order differs (float32).
TOL = 1e-5


def _batch(step: int, vocab: int):
    """The global batch of update ``step``: [1, ROWS, ...] host arrays."""
    rng = np.random.default_rng(100 + step)
    ids = rng.integers(1, vocab, (1, ROWS, PROMPT + GEN)).astype(np.int32)
    plen = rng.integers(2, PROMPT + 1, (1, ROWS))
    glen = rng.integers(1, GEN + 1, (1, ROWS))
    pos = np.arange(PROMPT + GEN)
    attn = (pos >= PROMPT - plen[..., None]) & (pos < PROMPT + glen[..., None])
    resp = np.arange(GEN) < glen[..., None]
    adv = rng.normal(size=(1, ROWS)).astype(np.float32)
    return ids, attn, resp, adv


def run_steps(first: int, last: int, ckpt_dir: str | None, restore: bool, devices=None) -> dict:
    """Updates ``first..last`` of the tiny model on the ``MESH`` mesh; returns host results.

    With ``restore`` the state comes from the checkpoint at step ``first - 1`` in ``ckpt_dir``;
    otherwise from the fixed random init, and the state after ``last`` is saved there (if given).
    Each process feeds only its own rows of every batch.
    """
    import jax
    from flax import nnx

    from delta_jax import distributed
    from delta_jax import sharding as sh
    from delta_jax.checkpoint import Checkpointer
    from delta_jax.config import OptimConfigSection
    from delta_jax.models import ModelConfig, Transformer
    from delta_jax.rl.state import init_sharded_state, make_optimizer
    from delta_jax.rl.train_step import make_train_step
    from tests.batches import padded_batch, padded_plan

    cfg = ModelConfig.tiny("qwen3")
    model = Transformer(cfg, rngs=nnx.Rngs(7))
    graphdef, params = nnx.split(model, nnx.Param)
    mesh = sh.make_mesh(*MESH, devices=devices)
    # Adam eps 1e-6 keeps the first update's gain lr/eps bounded (see test_sharding.py).
    opt = make_optimizer(OptimConfigSection(lr=1e-3, eps=1e-6), total_updates=10)
    state, _ = init_sharded_state(params, opt, mesh)
    out: dict = {"metrics": []}
    ckpt = Checkpointer(ckpt_dir) if ckpt_dir else None
    if restore:
        state, host = ckpt.restore(first - 1, state)
        out["restored_host"] = host
        out["restored"] = _host_params(distributed, state)
    step = make_train_step(
        graphdef,
        opt,
        padded_plan("delta", PROMPT, GEN, ROWS),
        mesh=mesh,
        jit_kwargs=sh.train_jit_kwargs(state, mesh),
    )
    rows = ROWS // jax.process_count()
    mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
    for k in range(first, last + 1):
        ids, attn, resp, adv = _batch(k, cfg.vocab_size)
        local = padded_batch(ids[:, mine], attn[:, mine], resp[:, mine], adv[:, mine])
        with sh.use_mesh(mesh):
            state, metrics = step(state, sh.host_local_batch_to_global(local, mesh))
        out["metrics"].append({key: float(v) for key, v in jax.device_get(metrics).items()})
    if ckpt is not None and not restore:
        ckpt.save(last, state, host={"step": last})
    if ckpt is not None:
        ckpt.close()
    out["params"] = _host_params(distributed, state)
    out["step"] = int(jax.device_get(state.step))
    return out


PROMPTS = [[5, 9, 2], [7], [1, 2, 3, 4, 5], [11, 3], [8, 8, 8], [6, 1]]


def sample_greedy(devices=None, **sampler_kw):
    """Greedy tokens of the tiny model under the ``MESH`` mesh (sampling placement), and the
    continuous engine's stats (None for the static sampler)."""
    from flax import nnx

    from delta_jax import distributed
    from delta_jax import sharding as sh
    from delta_jax.models import ModelConfig, Transformer
    from delta_jax.sampling import Sampler

    model = Transformer(ModelConfig.tiny("qwen3"), rngs=nnx.Rngs(7))
    mesh = sh.make_mesh(*MESH, devices=devices)
    params = sh.reshard_for_sampling(sh.shard_params(nnx.split(model, nnx.Param)[1], mesh), mesh)
    out = Sampler(model, mesh=mesh, **sampler_kw).generate(
        PROMPTS, max_new_tokens=6, temperature=0.0, params=params
    )
    # Global (cross-process) outputs are assembled on every host before reading them.
    tokens = distributed.process_allgather(out.token_array, tiled=True)
    lengths = distributed.process_allgather(out.length_array, tiled=True)
    return [tokens[i, : lengths[i]].tolist() for i in range(len(PROMPTS))], out.engine_stats


def _host_params(distributed, state) -> dict[str, np.ndarray]:
    import jax

    full = distributed.process_allgather(state.params, tiled=True)
    return {
        jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(full)
    }


def _worker(phase: str, out_dir: str) -> None:
    from delta_jax import distributed

    assert distributed.initialize(), "the launcher's DELTA_JAX_* environment is missing"
    import jax

    if phase == "late":  # process 0 reaches the barriers 40 s after process 1 (a warm-up)
        if distributed.is_main_process():
            time.sleep(40)
        distributed.barrier("late")
        distributed.barrier("late")  # the same name again: a barrier of its own
        Path(out_dir, f"late{jax.process_index()}").write_text("passed")
        return
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    if phase == "train":
        result = run_steps(1, STEPS, ckpt_dir, restore=False)
        result["greedy"], _ = sample_greedy()
        # The continuous engine: 4 slots for 6 sequences (refilled), rows over both processes;
        # the batch rows split over fsdp = 2, so 2 data groups of 2 slots, each with its pages.
        tokens, stats = sample_greedy(engine="continuous", decode_slots=4, page_size=4)
        result["greedy_engine"] = tokens
        result["engine_pages"] = [stats.high_water_pages, stats.free_pages_after, stats.group_pages]
    else:
        result = run_steps(STEPS + 1, STEPS + 1, ckpt_dir, restore=True)
    if distributed.is_main_process():
        arrays = {f"params{k}": v for k, v in result.pop("params").items()}
        arrays.update({f"restored{k}": v for k, v in result.pop("restored", {}).items()})
        np.savez(os.path.join(out_dir, f"{phase}.npz"), **arrays)
        result["processes"] = jax.process_count()
        result["devices"] = jax.device_count()
        Path(out_dir, f"{phase}.json").write_text(json.dumps(result))
    distributed.barrier(f"done-{phase}")


def _launch(phase: str, out_dir: Path) -> None:
    cmd = [
        sys.executable,
        str(LAUNCHER),
        "--processes",
        "2",
        "--devices-per-process",
        "2",
        "--timeout",
        "300",
        "--",
        sys.executable,
        __file__,
        phase,
        str(out_dir),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def reference():
    """One process, four of the test session's fake devices, four updates without a break."""
    import jax

    return run_steps(1, STEPS + 1, None, restore=False, devices=jax.devices()[:4])


@pytest.mark.slow
def test_two_processes_match_one_process_and_resume(tmp_path, reference):
    _launch("train", tmp_path)
    train = json.loads((tmp_path / "train.json").read_text())
    assert (train["processes"], train["devices"], train["step"]) == (2, 4, STEPS)
    assert len(train["metrics"]) == STEPS
    for got, want in zip(train["metrics"], reference["metrics"][:STEPS], strict=True):
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=TOL, atol=TOL, err_msg=key)
    # The sampler spans both processes; its greedy tokens equal one unsharded device's.
    from flax import nnx

    from delta_jax.models import ModelConfig, Transformer
    from delta_jax.sampling import Sampler

    model = Transformer(ModelConfig.tiny("qwen3"), rngs=nnx.Rngs(7))
    one_device = Sampler(model).generate(PROMPTS, max_new_tokens=6, temperature=0.0).tokens
    assert train["greedy"] == one_device
    assert train["greedy_engine"] == one_device
    high_water, free_after, group_pages = train["engine_pages"]
    assert len(high_water) == 2 and all(0 < h < group_pages for h in high_water)
    assert free_after == [group_pages - 1] * 2  # every page of both groups' pools free again
    saved = np.load(tmp_path / "train.npz")

    _launch("resume", tmp_path)
    resumed = json.loads((tmp_path / "resume.json").read_text())
    assert resumed["restored_host"] == {"step": STEPS}
    assert resumed["step"] == STEPS + 1
    after = np.load(tmp_path / "resume.npz")
    names = [k[len("params") :] for k in saved.files]
    for name in names:
        # The restore is exact: the very values the 2-process run saved.
        np.testing.assert_array_equal(after[f"restored{name}"], saved[f"params{name}"])
        np.testing.assert_allclose(
            after[f"params{name}"], reference["params"][name], rtol=TOL, atol=TOL, err_msg=name
        )
    for key, want in reference["metrics"][STEPS].items():
        np.testing.assert_allclose(
            resumed["metrics"][0][key], want, rtol=TOL, atol=TOL, err_msg=key
        )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _worker(sys.argv[1], sys.argv[2])


TRAIN = [
    "train",
    "--config",
    "configs/demo.yaml",
    "rollout.prompts_per_step=4",
    "run.mesh=[1,2,2]",
    "run.eval_every=0",
    "run.progress=false",
    "run.tensorboard=false",
    # The paper's mode: two updates per rollout batch (old-policy pass, fixed coefficients),
    # on packed rows (the default).
    "algo.mini_batches=2",
]


REWARD = ("reward.kind=tests.rl.reward_fns:graded_length", "reward.num_workers=1")


def _cli(out: Path, steps: int, processes: int, *overrides: str, ok: bool = True):
    """The run's metrics rows (``ok=False``: a run that must fail; its output)."""
    cli = [
        sys.executable,
        "-m",
        "delta_jax.cli",
        *TRAIN,
        f"run.steps={steps}",
        f"run.dir={out}",
        *overrides,
    ]
    if processes == 1:
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ["XLA_FLAGS"])
        flags += " --xla_force_host_platform_device_count=4"
        env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
        proc = subprocess.run(cli, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    else:
        cmd = [
            sys.executable,
            str(LAUNCHER),
            "--processes",
            str(processes),
            "--devices-per-process",
            str(4 // processes),
            "--timeout",
            "900",
            "--",
            *cli,
        ]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=960)
    if not ok:
        assert proc.returncode != 0
        return proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.slow
def test_cli_two_processes_match_one_process_and_resume(tmp_path):
    """`delta-jax train`, 2 processes x 2 devices vs 1 x 4; the 2-process run is resumed."""
    # The dense test reward gives every group varied rewards (a learning signal) from a
    # briefly warmed-up policy; the math reward would need hundreds of warm-up steps first.
    want = _cli(tmp_path / "one", STEPS + 1, 1, *REWARD, "model.demo_warmup_steps=30")
    assert any(row["loss"] != 0 for row in want) and any(row["reward_mean"] > 0 for row in want)
    # The 2-process runs start from the warmed-up model the 1-process run saved.
    model = f"model.path={tmp_path / 'one' / 'demo_model'}"
    assert len(_cli(tmp_path / "two", STEPS, 2, *REWARD, model)) == STEPS
    got = _cli(tmp_path / "two", STEPS + 1, 2, *REWARD, model)  # resumes from the step-STEPS save
    assert [row["step"] for row in got] == list(range(1, STEPS + 2))
    _assert_same_rows(got, want)


def _assert_same_rows(got: list[dict], want: list[dict]) -> None:
    """Every metric of every step equal within ``TOL`` (timings and compile counts aside)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        # Timings and compile counts depend on the process layout, not on the maths.
        own = lambda row: {k for k in row if not k.startswith(("time/", "compiles"))}
        keys = own(w)
        assert keys == own(g)
        for key in sorted(keys):
            if isinstance(w[key], int | float):
                np.testing.assert_allclose(
                    g[key], w[key], rtol=TOL, atol=TOL, err_msg=f"step {w['step']} {key}"
                )
            else:
                assert g[key] == w[key], (w["step"], key)


@pytest.mark.slow
def test_asynchronous_partial_rollouts_across_two_processes_match_one(tmp_path):
    """Asynchronous partial rollouts, 2 processes x 2 devices (each gives the sampler one
    device; the update's mesh is the other two) against 1 process x 4 (the first two sample).
    The weights cross to the sampler's devices and the rollout back through the hosts; on CPU
    the processes run each rollout inline (gloo shares one channel between two processes),
    the one process beside the update on its own thread."""
    run = (
        "run.mesh=[1,2,1]",
        "rollout.async_devices=2",
        "algo.tis_cap=2.0",
        "rollout.over_provision=1",
        "rollout.max_staleness=2",
    )
    want = _cli(tmp_path / "one", 3, 1, *REWARD, *run, "model.demo_warmup_steps=30")
    model = f"model.path={tmp_path / 'one' / 'demo_model'}"
    got = _cli(tmp_path / "two", 3, 2, *REWARD, *run, model)
    assert [row["rollout/policy_lag"] for row in got] == [0, 1, 1]
    assert got[1]["partial/staleness_1"] > 0 and got[2]["partial/tokens_carried"] > 0
    _assert_same_rows(got, want)
    odd = _cli(tmp_path / "odd", 3, 2, *REWARD, *run, model, "rollout.async_devices=1", ok=False)
    assert "error: rollout.async_devices=1 must be a multiple of the 2 processes" in odd


def test_a_process_may_reach_a_barrier_minutes_after_another(tmp_path):
    """The CPU collectives give up on a peer after 30 s; a barrier waits on the coordination
    service instead (the demo's warm-up keeps process 0 from the others' barrier that long)."""
    _launch("late", tmp_path)
    assert sorted(p.name for p in tmp_path.glob("late*")) == ["late0", "late1"]
