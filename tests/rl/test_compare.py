"""`delta-jax compare` end to end on a reduced sweep: 2 seeds x 2 losses, 2 RL steps each."""

import csv
import json

import numpy as np
import pytest

from delta_jax.cli import main
from delta_jax.compare import RUN_COLUMNS, TABLE_COLUMNS, t_interval


def test_t_interval_matches_the_textbook_formula():
    x = [0.1, 0.3, 0.2, 0.4]
    m, lo, hi = t_interval(x)
    half = 3.182446305284263 * np.std(x, ddof=1) / 2  # t_{0.975, 3}, sqrt(4)
    np.testing.assert_allclose([m, lo, hi], [0.25, 0.25 - half, 0.25 + half], rtol=1e-9)
    assert np.isnan(t_interval([0.5])[1])


@pytest.mark.slow  # four 2-step training processes (two at a time) and two coefficient batches
def test_compare_runs_resumes_and_writes_its_table(tmp_path, demo_model_dir):
    out = tmp_path / "sweep"
    argv = [
        "compare", "--config", "configs/demo.yaml", "--losses", "delta", "dapo",
        "--seeds", "0", "1", "--out", str(out), "--workers", "2",
        f"model.path={demo_model_dir}", "run.steps=2", "run.eval_every=1", "run.save_every=1",
        "run.eval_prompts=4", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "reward.num_workers=1",
    ]  # fmt: skip
    assert main(argv) == 0
    with open(out / "table.csv") as f:
        table = list(csv.DictReader(f))
    assert tuple(table[0]) == TABLE_COLUMNS and [r["loss"] for r in table] == ["delta", "dapo"]
    with open(out / "runs.csv") as f:
        runs = list(csv.DictReader(f))
    assert tuple(runs[0]) == RUN_COLUMNS and len(runs) == 4
    for r in runs:  # the table is read from each run's own metrics
        rows = [json.loads(x) for x in (out / r["loss"] / f"seed{r['seed']}" / "metrics.jsonl")
                .read_text().splitlines()]  # fmt: skip
        assert rows[-1]["step"] == 2
        assert float(r["eval_final"]) == rows[-1]["eval/avg@1"]
        np.testing.assert_allclose(
            float(r["reward_auc"]), np.mean([x["reward_mean"] for x in rows[1:]]), rtol=1e-6
        )
    assert float(table[0]["diff_eval_final_mean"]) == 0.0  # delta minus itself
    coefs = json.loads((out / "coefficients.json").read_text())
    assert set(coefs) == {"0", "1"} and "mean_answer" in coefs["0"]["final"]
    assert (out / "curves.png").stat().st_size > 0
    summary = (out / "summary.md").read_text()
    assert "| delta | 2 |" in summary and "| dapo | 2 |" in summary
    # Resume: a finished sweep trains nothing again; an unfinished run resumes from its last
    # checkpoint (here: the final one, so it adds no step) through the trainer.
    metrics = out / "dapo" / "seed1" / "metrics.jsonl"
    before = {p: p.stat().st_mtime_ns for p in out.glob("*/seed*/metrics.jsonl")}
    (out / "dapo" / "seed1" / "DONE").unlink()
    assert main(argv) == 0
    after = {p: p.stat().st_mtime_ns for p in out.glob("*/seed*/metrics.jsonl")}
    assert {p for p in before if before[p] != after[p]} <= {metrics}
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [0, 1, 2]
    assert (out / "dapo" / "seed1" / "DONE").exists()
