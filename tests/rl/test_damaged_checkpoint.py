"""A damaged latest checkpoint (a truncated or a deleted file): the run resumes from the newest
intact one with a warning naming the damage, and its metrics from there on are those of the
uninterrupted run; with no intact checkpoint the resume stops with one line. ``export`` reads
the newest intact step and moves nothing."""

import logging
import shutil

import pytest

from delta_jax.checkpoint import RECORD, CheckpointError
from delta_jax.cli import main
from delta_jax.config import load_config
from delta_jax.diagnostics.metrics_log import read_metrics
from delta_jax.rl import train
from tests.rl.conftest import tiny_overrides
from tests.rl.test_loop import DEMO


def _config(run_dir, model_dir):
    extra = ("run.steps=4", "run.save_every=2", "run.keep_last=3", "reward.num_workers=0")
    return load_config(DEMO, tiny_overrides(run_dir, model_dir, *extra))


def _comparable(rows, after):
    """Rows after ``after``, without timings and compile counts (a resumed run recompiles)."""
    drop = lambda k: k.startswith(("time/", "compiles"))
    return [{k: v for k, v in r.items() if not drop(k)} for r in rows if r["step"] > after]


def _largest_file(step_dir):
    return max((f for f in step_dir.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def _truncate(step_dir):
    big = _largest_file(step_dir / "state")  # the arrays' data
    with open(big, "r+b") as f:
        f.truncate(big.stat().st_size // 2)
    return big.name


def _delete(step_dir):
    gone = step_dir / "state" / "_METADATA"
    gone.unlink()
    return gone.name


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, demo_model_dir):
    """4 steps, checkpoints at 2 and 4: the uninterrupted run the resumed ones must match."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train(_config(run_dir, demo_model_dir))
    return run_dir


@pytest.mark.slow  # one 4-step run and two 2-step resumes
@pytest.mark.parametrize("damage", [_truncate, _delete], ids=["truncated", "deleted"])
def test_damaged_latest_checkpoint_resumes_from_the_previous_one(
    tmp_path, demo_model_dir, finished_run, damage, caplog
):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    name = damage(run_dir / "checkpoints" / "4")
    with caplog.at_level(logging.WARNING, logger="delta_jax.checkpoint"):
        result = train(_config(run_dir, demo_model_dir))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("checkpoints/4 is damaged" in w and name in w for w in warnings), warnings
    rows = read_metrics(result.metrics_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # steps 3 and 4 ran again, once each
    assert _comparable(rows, 2) == _comparable(read_metrics(finished_run / "metrics.jsonl"), 2)
    # The damaged step was saved again, intact, and the damaged copy kept aside.
    assert (run_dir / "checkpoints" / "4" / "integrity.json").exists()
    assert (run_dir / "checkpoints_damaged" / "4").is_dir()


@pytest.mark.slow  # builds the run's parts before it finds the checkpoints damaged
def test_no_intact_checkpoint_stops_with_one_line(tmp_path, demo_model_dir, finished_run):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    _truncate(run_dir / "checkpoints" / "4")
    _delete(run_dir / "checkpoints" / "2")
    for _ in range(2):  # and again: nothing was moved, so no silent fresh start either
        with pytest.raises(CheckpointError) as info:
            train(_config(run_dir, demo_model_dir))
        message = str(info.value)
        assert "\n" not in message and "no intact checkpoint" in message
        assert "step 4:" in message and "step 2: missing file state/_METADATA" in message
    assert isinstance(info.value, ValueError)  # the CLI prints ValueErrors as one error: line


def _tree(root):
    """Every path under ``root`` with its size and modification time."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.mark.slow  # builds on the finished run
def test_export_reads_the_newest_intact_step_and_moves_nothing(
    tmp_path, finished_run, capsys, caplog
):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    (run_dir / "checkpoints" / "4" / RECORD).unlink()  # as if killed before the record
    name = _truncate(run_dir / "checkpoints" / "4")
    before = _tree(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert main(["export", "--run", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    assert "exported step 2 of" in capsys.readouterr().out
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "checkpoints/4 is damaged" in warnings[0] and name in warnings[0]
    assert "nothing is moved" in warnings[0]
    # The damaged step named explicitly: one error line. Either way the run is as it was.
    assert main(["export", "--run", str(run_dir), "--step", "4", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: checkpoint") and "4 is damaged" in err
    assert {k: v for k, v in _tree(tmp_path).items() if "/hf" not in k} == before
