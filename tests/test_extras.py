"""Optional dependencies (delta_jax.extras): a missing one is one line naming its install, from
the command line (an ``error:`` line, exit code 2) and from ``Trainer`` (before anything loads),
never a traceback. Modules are hidden as a machine without them has them: ``sys.modules[name] =
None`` makes ``import name`` fail."""

import os
import sys
from pathlib import Path

import pytest

from delta_jax import Trainer, cli, distributed, extras
from delta_jax import plan as plan_lib
from delta_jax.config import ConfigError, load_config

ROOT = Path(__file__).parents[1]
GYM_CONFIG = str(ROOT / "configs" / "smollm2_arith.yaml")


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_the_install_command_names_the_checkout_or_the_extras_requirements(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    assert extras.install_command("gym") == 'pip install -e ".[gym]"'
    monkeypatch.chdir(tmp_path)
    assert extras.install_command("tpu") == f'pip install -e "{ROOT}[tpu]"'
    # Installed from a wheel (no checkout): the extra's own requirements from the metadata.
    assert extras.install_command("gym", root=None) == 'pip install "reasoning-gym==0.1.25"'
    assert extras.install_command("wandb", root=None).startswith('pip install "wandb>=')


def test_a_hidden_module_is_a_missing_extra(monkeypatch):
    assert extras.installed("gym")  # the test extras install it
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    assert not extras.installed("gym")
    with pytest.raises(extras.MissingExtra) as info:
        extras.require("gym", "a reasoning_gym task")
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, ImportError)
    assert message.startswith("a reasoning_gym task needs reasoning_gym, which is not installed")
    assert message.endswith(f"{extras.install_command('gym')}")
    assert info.value.__cause__ is None and info.value.__suppress_context__  # one line, no chain


def test_cli_without_the_gym_extra_prints_one_error_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    assert cli.main(["train", "--config", GYM_CONFIG]) == 2
    line = _error_line(capsys)
    assert "data.source=reasoning_gym:chain_sum" in line and line.endswith('[gym]"')
    # From Python: the same line as the ConfigError the config check raises.
    with pytest.raises(ConfigError, match=r"needs reasoning_gym, which is not installed: pip"):
        Trainer(load_config(GYM_CONFIG))


def test_cli_plan_on_the_tpu_compiler_without_libtpu_prints_one_error_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "libtpu", None)
    kind, why = plan_lib.resolve_compiler("auto")
    assert kind == "cpu" and why.startswith("libtpu not importable (pip install")
    argv = ["plan", "--config", str(ROOT / "configs" / "demo.yaml"), "--topology", "v5p-8",
            "--compiler", "tpu"]  # fmt: skip
    assert cli.main(argv) == 2
    assert _error_line(capsys).startswith("error: --compiler tpu needs libtpu, which is not")


def test_a_tpu_without_libtpu_stops_before_anything_loads(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "libtpu", None)
    monkeypatch.setattr(distributed, "_tpu_attached", lambda: True)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    run = tmp_path / "run"
    assert cli.main(["train", "--config", str(ROOT / "configs" / "demo.yaml"),
                     f"run.dir={run}"]) == 2  # fmt: skip
    line = _error_line(capsys)
    assert line.startswith("error: this machine has a TPU: running on it needs libtpu")
    with pytest.raises(extras.MissingExtra, match="needs libtpu"):
        Trainer({"run.dir": str(run)})
    assert not run.exists()  # nothing was loaded or written
    # A user who chose the CPU on a TPU machine is left alone.
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    distributed.check_tpu_runtime()


def test_wandb_logging_without_wandb_stops_before_anything_loads(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)
    run = tmp_path / "run"
    argv = ["train", "--config", str(ROOT / "configs" / "demo.yaml"), f"run.dir={run}",
            "run.wandb=true"]  # fmt: skip
    assert cli.main(argv) == 2
    line = _error_line(capsys)
    assert line.startswith("error: run.wandb=true needs wandb, which is not installed: pip")
    with pytest.raises(extras.MissingExtra, match=r"^run.wandb=true needs wandb"):
        Trainer({"run.dir": str(run), "run.wandb": True})
    assert not run.exists()


def test_the_runtime_only_check_is_wired_into_ci():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash .ci/runtime-only" in ci.splitlines()
    assert os.access(ROOT / ".ci" / "runtime-only", os.X_OK)
