"""`delta-jax compare` end to end on the demo at one seed x two losses, and the demo learning.

One reduced sweep serves both slow checks (each used to train its own runs): the comparison
command's table, resume and statistics, and the demo's promise that every seed starts RL in the
band and learns.
"""

import csv
import json

import numpy as np
import pytest
from flax import nnx

from delta_jax import demo
from delta_jax.cli import main
from delta_jax.compare import (
    COEF_COLUMNS,
    RUN_COLUMNS,
    TABLE_COLUMNS,
    class_table,
    plot_curves,
    run_dir,
    step_table,
    summarize,
    summary_markdown,
    t_interval,
)
from delta_jax.diagnostics import ROLES
from delta_jax.models import from_pretrained
from delta_jax.rl.setup import restore_policy
from tests.compile_flags import optimized

STEPS = 12  # the first 12 of the demo's 100 RL steps (constant schedule: the same 12 steps)
# One of the five seeds the README promises (docs/evidence.md has all five at full length): 2, one
# of the seeds that started RL below the band before issue 16's fix. The warm-up runs until the
# held-out probe reaches its target, 210-440 steps depending on the seed (260 at seed 2). A
# second seed doubled the sweep's time in CI; the statistics over several seeds are checked on
# written metrics (test_table_over_several_seeds_pairs_the_differences_by_seed).
SEEDS = (2,)


def test_t_interval_matches_the_textbook_formula():
    x = [0.1, 0.3, 0.2, 0.4]
    m, lo, hi = t_interval(x)
    half = 3.182446305284263 * np.std(x, ddof=1) / 2  # t_{0.975, 3}, sqrt(4)
    np.testing.assert_allclose([m, lo, hi], [0.25, 0.25 - half, 0.25 + half], rtol=1e-9)
    assert np.isnan(t_interval([0.5])[1])


def test_table_over_several_seeds_pairs_the_differences_by_seed(tmp_path):
    """The table, curves and summary of a sweep of 3 seeds x 2 losses, from runs' metrics written
    here (the demo sweep below trains one seed): each quantity's mean and t-interval over the
    seeds, and the paired differences against the first loss, seed by seed."""
    rng = np.random.default_rng(0)
    losses, seeds, per_run = ("delta", "dapo"), (0, 1, 2), {}
    for loss in losses:
        for seed in seeds:
            rdir = run_dir(tmp_path, loss, seed)
            rdir.mkdir(parents=True)
            evals, rewards = rng.uniform(0, 1, 3), rng.uniform(0, 1, 4)
            rows = [{"step": 0, "eval/avg@1": evals[0]}]
            rows += [{"step": i + 1, "reward_mean": r} for i, r in enumerate(rewards)]
            rows[2]["eval/avg@1"], rows[4]["eval/avg@1"] = evals[1], evals[2]
            (rdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            per_run[loss, seed] = {
                "eval_final": evals[2], "eval_gain": evals[2] - evals[0],
                "reward_auc": rewards.mean(),
            }  # fmt: skip
    runs, table = summarize(tmp_path, losses, seeds)
    assert len(runs) == 6 and [r["n"] for r in table] == [3, 3]
    for row, loss in zip(table, losses, strict=True):
        for q in ("eval_final", "eval_gain", "reward_auc"):
            vals = [per_run[loss, s][q] for s in seeds]
            diffs = [per_run[loss, s][q] - per_run["delta", s][q] for s in seeds]
            for prefix, v in (("", vals), ("diff_", diffs)):
                half = 4.302652729911275 * np.std(v, ddof=1) / np.sqrt(3)  # t_{0.975, 2}
                got = [row[f"{prefix}{q}_{end}"] for end in ("mean", "lo", "hi")]
                want = [np.mean(v), np.mean(v) - half, np.mean(v) + half]
                np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    assert plot_curves(tmp_path, losses, seeds, tmp_path / "curves.png").stat().st_size > 0
    summary = summary_markdown("t", "cmd", runs, table, {}, losses)
    assert "| dapo | 3 | " in summary and summary.count(" [") >= 5  # intervals printed


def test_class_and_step_tables_average_the_seeds(tmp_path):
    """The mechanism tables: per class, mean over seeds of λ̄ (all, each side) and the shares;
    per step (1 and every 5th), mean over seeds of the centroid cosine and sign accuracy."""
    coefs = {
        str(seed): {
            when: {
                f"{key}{suffix}": seed + 10 * (when == "final") + ord(c[0]) / 1000
                for c in ("early", "late")
                for key, suffix in (
                    (f"mean_{c}", ""),
                    (f"mean_{c}", "_pos"),
                    (f"mean_{c}", "_neg"),
                    (f"{c}_count_share", ""),
                    (f"{c}_weight_share", ""),
                )
            }  # fmt: skip
            for when in ("start", "final")
        }
        for seed in (0, 2)
    }
    lines = "\n".join(class_table(coefs, ("early", "late"), "position"))
    want = 1 + ord("l") / 1000  # mean of seeds 0 and 2 at the start policy
    assert f"| start | late | {want:.3f} | {want:.3f} | {want:.3f} |" in lines
    assert f"| final | early | {11 + ord('e') / 1000:.3f} |" in lines
    assert class_table(coefs, ("answer",), "roles") == []  # no seed has the class: no table
    for seed, offset in ((0, 0.0), (1, 0.2)):
        rows = [
            {"step": t, "delta/centroid_cosine": 0.1 * t + offset, "delta/sign_accuracy": 0.5}
            for t in range(1, 11)
        ]
        write_rows(run_dir(tmp_path, "delta", seed), rows)
    lines = step_table(tmp_path, (0, 1))
    assert [x.split(" | ")[0] for x in lines if x.startswith("| ") and x[2].isdigit()] == [
        "| 1", "| 5", "| 10"
    ]  # fmt: skip
    assert "| 5 | 0.600 | 0.500 |" in lines


def test_the_boxed_answer_table_is_only_for_runs_without_an_answer_marker():
    """A run with an answer marker has the roles' table; the ``\\boxed{}`` answer-vs-format
    table (whose "answer" is another set of tokens) is not printed from its statistics."""
    boxed = {k: 1.0 for k in COEF_COLUMNS} | {"answer_count_share": 0.1}
    roles = {f"{p}{r}{s}": 1.0 for r in ROLES for p, s in (("mean_", ""), ("", "_count_share"))}
    roles |= {f"mean_{r}{s}": 1.0 for r in ROLES for s in ("_pos", "_neg")}
    roles |= {f"{r}_weight_share": 1.0 for r in ROLES}
    heading = "on answer tokens (inside `\\boxed{}`)"
    for stats, has_boxed in ((boxed, True), (roles, False)):
        coefs = {"0": {"start": stats, "final": stats}}
        md = summary_markdown("t", "c", [], [], coefs, ["delta"])
        assert (heading in md) is has_boxed
        assert ("| start | reasoning |" in md) is not has_boxed


def write_rows(rdir, rows):
    rdir.mkdir(parents=True)
    (rdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def demo_sweep(tmp_path_factory):
    """``delta-jax compare`` of the README demo, ``SEEDS`` x delta and dapo, 12 RL steps.

    The demo's own settings (warm-up to the target band, 32 prompts x 8 samples, math
    verifier) with fewer steps, held-out accuracy measured at steps 0 and 12 on 128 problems.
    """
    out = tmp_path_factory.mktemp("sweep")
    argv = [
        "compare", "--config", "configs/demo.yaml", "--losses", "delta", "dapo",
        "--seeds", *map(str, SEEDS), "--out", str(out), "--workers", "2", f"run.steps={STEPS}",
        f"run.eval_every={STEPS}", f"run.save_every={STEPS}", "run.eval_prompts=128",
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as env:  # the runs' processes: XLA's default optimisation
        env.setenv("XLA_FLAGS", optimized()["XLA_FLAGS"])
        assert main(argv) == 0
    return out, argv


@pytest.mark.slow  # the sweep: a warm-up and two 12-step runs, two processes at a time
@pytest.mark.parametrize("seed", SEEDS)
def test_demo_starts_in_the_band_and_rl_raises_the_right_answer(demo_sweep, seed):
    """The README's demo (the DelTA runs of the sweep), shortened to 12 RL steps.

    The full demo's target (held-out accuracy at step 100 >= 1.5x step 0 and >= +0.08,
    docs/evidence.md) takes minutes a seed, so CI checks what it rests on, with looser bounds:

    * the warm-up lands the policy in the band at every seed (issue 16: seeds 1-3 used to start
      at 3-6% held-out accuracy, where RL has almost no signal): step-0 sampled accuracy on the
      128 held-out problems in [0.06, 0.25];
    * RL raises the policy's probability of the right answer on those held-out problems
      (:func:`delta_jax.demo.answer_probability`, the exact chance that one sample is the
      reference response) by at least 10% in 12 steps. Unlike a sampled accuracy after 12
      steps (standard error about 0.03 on 128 problems, against a gain of a few points), it
      has no sampling noise and is paired problem by problem, so a small bound still fails
      when RL does nothing or hurts.
    """
    out, _ = demo_sweep
    rdir = run_dir(out, "delta", seed)
    rows = [json.loads(x) for x in (rdir / "metrics.jsonl").read_text().splitlines()]
    start = rows[0]["eval/avg@1"]
    assert rows[0]["step"] == 0 and 0.06 <= start <= 0.25, start
    records = demo.arithmetic_records(128, seed=seed + 1)  # the run's held-out problems
    ids, mask = demo.reference_batch(demo.build_char_tokenizer(), records, template="short")
    prob = lambda model: float(demo.answer_probability(*nnx.split(model, nnx.Param), ids, mask))
    before = prob(from_pretrained(str(rdir / "demo_model")))
    after_model, _, step = restore_policy(rdir, None)
    after = prob(after_model)
    assert step == STEPS
    assert after >= 1.1 * before, (before, after)


@pytest.mark.slow  # shares the demo sweep; adds one resumed run and two coefficient batches
def test_compare_runs_resumes_and_writes_its_table(demo_sweep):
    out, argv = demo_sweep
    with open(out / "table.csv") as f:
        table = list(csv.DictReader(f))
    assert tuple(table[0]) == TABLE_COLUMNS and [r["loss"] for r in table] == ["delta", "dapo"]
    with open(out / "runs.csv") as f:
        runs = list(csv.DictReader(f))
    assert tuple(runs[0]) == RUN_COLUMNS and len(runs) == 2 * len(SEEDS)
    for r in runs:  # the table is read from each run's own metrics
        rows = [json.loads(x) for x in (out / r["loss"] / f"seed{r['seed']}" / "metrics.jsonl")
                .read_text().splitlines()]  # fmt: skip
        assert rows[-1]["step"] == STEPS
        assert float(r["eval_final"]) == rows[-1]["eval/avg@1"]
        np.testing.assert_allclose(
            float(r["reward_auc"]), np.mean([x["reward_mean"] for x in rows[1:]]), rtol=1e-6
        )
    # The dapo runs load their seed's delta warm-up instead of repeating it: same start.
    start = {(r["loss"], r["seed"]): float(r["eval_start"]) for r in runs}
    for seed in map(str, SEEDS):
        assert start["delta", seed] == start["dapo", seed]
    assert float(table[0]["diff_eval_final_mean"]) == 0.0  # delta minus itself
    coefs = json.loads((out / "coefficients.json").read_text())
    seed = str(SEEDS[0])
    assert set(coefs) == set(map(str, SEEDS)) and "mean_answer" in coefs[seed]["final"]
    assert 0 <= coefs[seed]["start"]["shared_count_share"] <= 1  # both-sides tokens' share
    for when in ("start", "final"):  # each coefficient batch is kept, with its heatmap
        assert (out / "delta" / f"seed{seed}" / "diagnostics" / f"heatmap_{when}.html").exists()
    assert (out / "curves.png").stat().st_size > 0
    summary = (out / "summary.md").read_text()
    assert f"| delta | {len(SEEDS)} |" in summary and f"| dapo | {len(SEEDS)} |" in summary
    # Resume: a finished sweep trains nothing again; an unfinished run resumes from its last
    # checkpoint (here: the final one, so it adds no step) through the trainer.
    last = out / "dapo" / f"seed{SEEDS[-1]}"
    metrics = last / "metrics.jsonl"
    before = {p: p.stat().st_mtime_ns for p in out.glob("*/seed*/metrics.jsonl")}
    (last / "DONE").unlink()
    assert main(argv) == 0
    after = {p: p.stat().st_mtime_ns for p in out.glob("*/seed*/metrics.jsonl")}
    assert {p for p in before if before[p] != after[p]} <= {metrics}
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == list(
        range(STEPS + 1)
    )
    assert (last / "DONE").exists()
