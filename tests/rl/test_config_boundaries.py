"""Every numeric config key at 0 and -1 on the demo config: refused at load with one line naming
the key, or a run of one RL step. The keys are read from the config dataclasses, so a new key
is walked without touching this file."""

import subprocess
import sys
import types
import typing
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax.checkpoint import Checkpointer
from delta_jax.config import (
    Config,
    ConfigError,
    OptimConfigSection,
    RunConfigSection,
    load_config,
)
from delta_jax.diagnostics.metrics_log import read_metrics
from delta_jax.rl import train
from delta_jax.rl.state import make_optimizer
from tests.rl.conftest import tiny_overrides

ROOT = Path(__file__).parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
VALUES = (0, -1)


def _numeric(tp) -> bool:
    """int / float, or an Optional of one."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return all(a is type(None) or _numeric(a) for a in typing.get_args(tp))
    return tp in (int, float)


def numeric_variants(base: Config) -> list[tuple[str, str]]:
    """(key, override) for every numeric field of every section (tuples of numbers entry by
    entry, the others at their value in ``base``) at each of ``VALUES``."""
    out = []
    for section, section_tp in typing.get_type_hints(Config).items():
        for name, tp in typing.get_type_hints(section_tp).items():
            key = f"{section}.{name}"
            args = typing.get_args(tp)
            if typing.get_origin(tp) is tuple and args and all(a is int for a in args):
                current = list(getattr(getattr(base, section), name))
                for i in range(len(args)):
                    for v in VALUES:
                        value = current[:i] + [v] + current[i + 1 :]
                        out.append((key, f"{key}={value}"))
            elif _numeric(tp):
                out.extend((key, f"{key}={v}") for v in VALUES)
    return out


# One step, rewards scored in the trainer's process (no worker start-up per run).
CHEAP = ("run.steps=1", "reward.num_workers=0")


def test_the_walk_sees_every_numeric_field():
    keys = {key for key, _ in numeric_variants(Config())}
    assert {"run.save_every", "run.mesh", "algo.tis_cap", "data.limit", "optim.eps"} <= keys
    assert not keys & {"model.path", "algo.loss", "run.tensorboard", "model.lora_targets"}
    # One per section at least, Optional and tuple fields included.
    assert {"model.lora_alpha", "rollout.top_k", "reward.timeout_s", "optim.b2"} <= keys


def test_save_every_zero_saves_only_the_last_and_the_stopping_step():
    run = RunConfigSection(steps=5, save_every=0)
    assert [s for s in range(1, 6) if run.save_due(s)] == [5]
    assert run.save_due(3, stopping=True)
    run = RunConfigSection(steps=5, save_every=2)
    assert [s for s in range(1, 6) if run.save_due(s)] == [2, 4, 5]


def test_a_refused_key_is_one_error_line_from_the_cli():
    cmd = [sys.executable, "-m", "delta_jax.cli", "train", "--config", str(DEMO)]
    proc = subprocess.run(
        [*cmd, "run.save_every=-1"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: run.save_every=-1 must be >= 0"]


def test_grad_clip_zero_is_no_clipping():
    """optim.grad_clip=0 updates as AdamW without clipping (not a zero update)."""
    grads = {"w": jnp.array([[3.0, -4.0], [0.5, 2.0]])}
    params = {"w": jnp.ones((2, 2))}
    updates = {}
    for clip in (0.0, 1e9):  # off, and a bound far above the gradient norm
        tx = make_optimizer(OptimConfigSection(grad_clip=clip), total_updates=10)
        updates[clip] = tx.update(grads, tx.init(params), params)[0]["w"]
    np.testing.assert_array_equal(updates[0.0], updates[1e9])
    assert float(jnp.abs(updates[0.0]).min()) > 0


def _group(accepted, loads):
    """Accepted overrides packed first-fit into groups that still load together (one key at
    most once per group): each group is one run, so the walk costs a few runs, not one per
    override."""
    groups: list[list[tuple[str, str]]] = []
    for key, override in accepted:
        for group in groups:
            if key not in {k for k, _ in group} and loads([o for _, o in group] + [override]):
                group.append((key, override))
                break
        else:
            groups.append([(key, override)])
    return groups


@pytest.mark.slow  # a few one-step runs
def test_every_numeric_key_at_zero_and_minus_one_is_refused_or_runs_a_step(
    tmp_path, demo_model_dir
):
    def config(run: str, *extra: str) -> Config:
        return load_config(DEMO, tiny_overrides(tmp_path / run, demo_model_dir, *CHEAP, *extra))

    def loads(extra) -> bool:
        try:
            config("probe", *extra)
        except ConfigError:
            return False
        return True

    accepted = []
    for key, override in numeric_variants(config("probe")):
        try:
            config("probe", override)
        except ConfigError as e:
            # One line naming the key (and its range, or the key it conflicts with).
            assert "\n" not in str(e) and key in str(e), (override, str(e))
        else:
            accepted.append((key, override))
    accepted_keys = {k for k, _ in accepted}
    assert {"run.save_every", "run.eval_every", "optim.grad_clip", "algo.kl_coef"} <= accepted_keys
    # Sampling keys apart from the update's: rollout.temperature=0 (greedy) draws identical
    # samples, zero advantages, and the update keys would then act on zero gradients.
    sampling = [a for a in accepted if a[0].startswith("rollout.")]
    groups = _group(sampling, loads) + _group([a for a in accepted if a not in sampling], loads)
    assert sum(map(len, groups)) == len(accepted)
    for i, group in enumerate(groups):
        overrides = [o for _, o in group]
        result = train(config(f"run{i}", *overrides))
        rows = read_metrics(result.metrics_path)
        assert result.last_step == 1 and rows[-1]["step"] == 1, overrides
        if group[0][0].startswith("rollout."):
            assert rows[-1]["loss"] == 0.0  # greedy: no learning signal, as said above
        else:
            assert rows[-1]["grad_norm"] > 0, overrides
        # The last step is always saved, with save_every=0 too.
        assert Checkpointer(result.checkpoint_dir).all_steps() == [1], overrides
