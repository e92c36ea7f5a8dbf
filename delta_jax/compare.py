"""Controlled experiments: N seeds x several losses on one config, summarised with intervals.

``delta-jax compare --config C.yaml --losses delta dapo --seeds 0 1 2 3 4 --out DIR [k=v ...]``
runs ``delta-jax train`` once per (loss, seed) into ``DIR/<loss>/seed<k>`` — the config, the
overrides, ``algo.loss=<loss>`` and ``run.seed=<k>``, nothing else changes — then writes

* ``DIR/runs.csv``: one row per run (held-out accuracy at step 0 and at the last step, area
  under the reward curve, wall time, machine load);
* ``DIR/table.csv`` and ``DIR/summary.md``: per loss, the mean and a 95% t-interval over seeds
  of each quantity, and for every other loss the paired difference to the first one (same
  seed: same warm-up, data order and eval problems, so the pairing removes most seed noise);
* ``DIR/curves.png``: mean curves of the training reward and held-out accuracy, 95% bands;
* DelTA coefficient statistics of each DelTA run, on a batch sampled from its starting policy
  and from its final checkpoint: mean coefficient on answer tokens vs formatting tokens
  (:func:`~delta_jax.diagnostics.answer_token_share`).

Runs go to ``--workers`` processes at once (default: one per two cores). An interrupted sweep
resumes: a finished run (its ``DONE`` file) is skipped, a partial one is restarted with the same
command, which resumes from its last checkpoint exactly like ``delta-jax train`` does; a run
another live sweep is training (its ``RUNNING`` lock) is waited for, not repeated.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from scipy import stats

from delta_jax.config import load_config
from delta_jax.diagnostics import (
    ROLES,
    CaptureSampling,
    answer_token_share,
    capture_batch,
    delta_series,
    group_shared_share,
    position_shares,
    render_heatmap,
    role_shares,
)
from delta_jax.diagnostics.metrics_log import read_metrics
from delta_jax.rl.objectives import delta_options
from delta_jax.rl.setup import build_run_parts, restore_policy

log = logging.getLogger(__name__)

RUN_COLUMNS = ("loss", "seed", "eval_start", "eval_final", "eval_gain", "reward_auc", "wall_s")
SUMMARY_QUANTITIES = ("eval_final", "eval_gain", "reward_auc")
TABLE_COLUMNS = (
    "loss",
    "n",
    *(f"{q}_{s}" for q in SUMMARY_QUANTITIES for s in ("mean", "lo", "hi")),
    *(f"diff_{q}_{s}" for q in SUMMARY_QUANTITIES for s in ("mean", "lo", "hi")),
)
COEF_COLUMNS = (
    "mean_answer",
    "mean_format",
    "mean_answer_pos",
    "mean_format_pos",
    "mean_answer_neg",
    "mean_format_neg",
    "answer_count_share",
    "answer_weight_share",
)
# diagnostics.group_shared_share: tokens both sides of a group write vs where they differ.
SHARED_COLUMNS = (
    "mean_shared",
    "mean_distinct",
    "mean_shared_pos",
    "mean_distinct_pos",
    "mean_shared_neg",
    "mean_distinct_neg",
    "shared_count_share",
    "shared_weight_share",
)


def run_dir(out: Path, loss: str, seed: int) -> Path:
    return Path(out) / loss / f"seed{seed}"


def train_argv(config: str, overrides: Sequence[str], loss: str, seed: int, out: Path):
    """The ``delta-jax train`` command line of one run of the sweep."""
    return [
        sys.executable,
        "-m",
        "delta_jax.cli",
        "train",
        "--config",
        str(config),
        *overrides,
        f"algo.loss={loss}",
        f"run.seed={seed}",
        f"run.dir={run_dir(out, loss, seed)}",
        "run.progress=false",
        "run.tensorboard=false",
    ]


def _claim(rdir: Path) -> bool:
    """Takes ``rdir/RUNNING`` for this process; False while a live process holds it.

    Two sweeps over one directory (a wider sweep started while a narrower one runs) then share
    runs instead of training the same run twice; a lock left by a dead process is taken over.
    """
    lock = rdir / "RUNNING"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            os.kill(int(lock.read_text() or 0), 0)
            return False
        except (ProcessLookupError, ValueError, FileNotFoundError):
            lock.unlink(missing_ok=True)  # stale: its process is gone
            return _claim(rdir)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def _ready(model_dir: Path | None) -> bool:
    return model_dir is None or (
        (model_dir / "config.json").exists() and any(model_dir.glob("*.safetensors"))
    )


def _run_one(argv: list[str], rdir: Path, *, needs: Path | None = None, poll_s: float = 5.0):
    """Runs (or resumes) one training run; writes ``DONE`` with its timing when it succeeds.

    ``needs``: a model directory another run writes (the shared demo warm-up) to wait for.
    """
    done = rdir / "DONE"
    rdir.mkdir(parents=True, exist_ok=True)
    while not done.exists() and not (_ready(needs) and _claim(rdir)):
        time.sleep(poll_s)
    if done.exists():
        return json.loads(done.read_text())
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    try:
        with open(rdir / "train.log", "a") as logf:
            rc = subprocess.run(argv, stdout=logf, stderr=subprocess.STDOUT).returncode
    finally:
        (rdir / "RUNNING").unlink(missing_ok=True)
    info = {
        "rc": rc,
        "wall_s": time.perf_counter() - t0,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "argv": argv[1:],
    }
    if rc == 0:
        done.write_text(json.dumps(info))
    else:
        log.error("run %s failed (rc %d), see %s", rdir, rc, rdir / "train.log")
    return info


def run_sweep(config, overrides, losses, seeds, out, *, workers: int | None = None) -> list[dict]:
    """Runs every (loss, seed) not finished yet, ``workers`` at a time; returns their infos.

    With the built-in demo model, the runs of one seed share one warm-up: the first loss's
    run warms the policy up as ``delta-jax train`` always does, the others load that directory
    (``model.path=``) instead of repeating the same deterministic warm-up.
    """
    out = Path(out)
    workers = workers or max(1, (os.cpu_count() or 2) // 2)
    shared = load_config(config, overrides).model.path == "demo:tiny"
    jobs = [(loss, seed) for seed in seeds for loss in losses]  # first loss of a seed first
    with ThreadPoolExecutor(workers) as pool:
        futures = []
        for loss, seed in jobs:
            extra, needs = [], None
            if shared and loss != losses[0]:
                needs = run_dir(out, losses[0], seed) / "demo_model"
                extra = [f"model.path={needs}"]
            argv = train_argv(config, [*overrides, *extra], loss, seed, out)
            futures.append(pool.submit(_run_one, argv, run_dir(out, loss, seed), needs=needs))
        infos = [f.result() for f in futures]
    failed = [j for j, i in zip(jobs, infos, strict=True) if i["rc"] != 0]
    if failed:
        raise RuntimeError(f"runs failed (see their train.log): {failed}")
    return infos


def run_row(rdir: Path) -> dict:
    """Per-run quantities from ``metrics.jsonl``.

    ``reward_auc`` is the area under the training-reward curve divided by the number of steps
    (the mean reward over the run): it rewards learning early as well as learning much.
    """
    rows = read_metrics(rdir / "metrics.jsonl")
    evals = [(r["step"], r["eval/avg@1"]) for r in rows if r.get("eval/avg@1") is not None]
    rewards = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    if not evals or not rewards:
        raise ValueError(f"{rdir}: metrics.jsonl has no eval/avg@1 or reward_mean rows")
    start = dict(evals).get(0, float("nan"))
    info = json.loads((rdir / "DONE").read_text()) if (rdir / "DONE").exists() else {}
    return {
        "eval_start": start,
        "eval_final": evals[-1][1],
        "eval_gain": evals[-1][1] - start,
        "reward_auc": float(np.mean(rewards)),
        "wall_s": info.get("wall_s", float("nan")),
    }


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """Mean and the two-sided Student-t ``level`` interval of the mean (NaN width for n < 2)."""
    x = np.asarray(values, np.float64)
    mean = float(x.mean()) if x.size else float("nan")
    if x.size < 2:
        return mean, float("nan"), float("nan")
    half = stats.t.ppf(0.5 + level / 2, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size)
    return mean, mean - half, mean + half


def summarize(out, losses, seeds) -> tuple[list[dict], list[dict]]:
    """(per-run rows, per-loss table rows); differences are paired by seed against losses[0]."""
    runs = [
        {"loss": loss, "seed": seed, **run_row(run_dir(out, loss, seed))}
        for loss in losses
        for seed in seeds
    ]
    by = {(r["loss"], r["seed"]): r for r in runs}
    table = []
    for loss in losses:
        row: dict = {"loss": loss, "n": len(seeds)}
        for q in SUMMARY_QUANTITIES:
            vals = [by[loss, s][q] for s in seeds]
            diffs = [by[loss, s][q] - by[losses[0], s][q] for s in seeds]
            for prefix, v in (("", vals), ("diff_", diffs)):
                m, lo, hi = t_interval(v)
                row.update({f"{prefix}{q}_mean": m, f"{prefix}{q}_lo": lo, f"{prefix}{q}_hi": hi})
        table.append(row)
    return runs, table


def _write_csv(path: Path, rows: list[dict], columns: Sequence[str]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


def _curve(rdir: Path, key: str) -> tuple[np.ndarray, np.ndarray]:
    rows = read_metrics(rdir / "metrics.jsonl")
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    xs, ys = zip(*pts, strict=True)
    return np.asarray(xs), np.asarray(ys, np.float64)


def plot_curves(out, losses, seeds, path) -> Path:
    """Mean training reward and held-out accuracy per loss over steps, with 95% t-bands."""
    # Lazy: matplotlib (seconds to import) only where a figure is drawn.
    import matplotlib

    matplotlib.use("Agg")  # headless: pyplot after the backend is chosen
    import matplotlib.pyplot as plt

    keys = ("reward_mean", "eval/avg@1")
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for loss in losses:
            curves = [_curve(run_dir(out, loss, s), key) for s in seeds]
            n = min(len(x) for x, _ in curves)
            xs = curves[0][0][:n]
            band = np.array([t_interval([y[i] for _, y in curves]) for i in range(n)])
            ax.plot(xs, band[:, 0], label=f"{loss} (n={len(seeds)})")
            if len(seeds) > 1:
                ax.fill_between(xs, band[:, 1], band[:, 2], alpha=0.2)
        ax.set_title(f"{key}: mean, 95% t-band over seeds")
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def coefficient_stats(rdir: Path, *, prompts: int = 32, n: int = 8) -> dict[str, dict]:
    """DelTA coefficient shares on a batch from the starting policy and the final checkpoint.

    Both batches use the run's own sampling settings and DelTA options, on the run's first
    ``prompts`` held-out problems, so that start and end (and two runs) see the same prompts.
    Each batch is kept in ``<run>/diagnostics/`` with its token heatmap (HTML).
    """
    config = load_config(rdir / "config.yaml")
    parts = build_run_parts(config)
    parts.close()
    options = delta_options(config.algo)  # the run's DelTA settings, whatever its loss
    out = {}
    for when, step in (("start", 0), ("final", None)):
        model, tokenizer = parts.model, parts.tokenizer
        if step is None:
            model, tokenizer, _ = restore_policy(rdir, None)
        batch = capture_batch(
            model,
            tokenizer,
            parts.eval_prompt_ids[:prompts],
            parts.eval_records[:prompts],
            sampling=CaptureSampling(
                n=n,
                max_new_tokens=config.rollout.max_new_tokens,
                temperature=config.rollout.temperature,
                seed=config.run.seed,
            ),
            reward=config.reward.kind,
            delta_options=options,
        )
        batch.save(rdir / "diagnostics" / f"{when}.npz")
        render_heatmap(batch, rdir / "diagnostics" / f"heatmap_{when}.html", title=f"{when} policy")
        marker = config.data.answer_marker  # roles: the reasoning, the template, the answer
        answers = role_shares(batch, marker) if marker else answer_token_share(batch)  # \boxed
        out[when] = answers | group_shared_share(batch) | position_shares(batch)
    return out


def _fmt(m: float, lo: float, hi: float) -> str:
    if np.isnan(lo):
        return f"{m:.3f}"
    return f"{m:.3f} [{lo:.3f}, {hi:.3f}]"


def summary_markdown(title: str, command: str, runs, table, coefs: dict, losses) -> str:
    """The sweep's results as Markdown: command, table with intervals, per-run rows, DelTA stats."""
    base = losses[0]
    lines = [f"### {title}", "", f"`{command}`", ""]
    lines += [
        "| loss | n | final held-out acc. | gain over step 0 | reward AUC "
        f"| final acc. − {base} (paired) | AUC − {base} (paired) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in table:
        cells = [_fmt(*(r[f"{q}_{s}"] for s in ("mean", "lo", "hi"))) for q in SUMMARY_QUANTITIES]
        diffs = [
            "—" if r["loss"] == base else _fmt(*(r[f"diff_{q}_{s}"] for s in ("mean", "lo", "hi")))
            for q in ("eval_final", "reward_auc")
        ]
        lines.append(f"| {r['loss']} | {r['n']} | " + " | ".join(cells + diffs) + " |")
    lines += ["", "Mean [95% t-interval over seeds]. Per run:", ""]
    lines += ["| loss | seed | acc. step 0 | acc. last | AUC | wall s |", "|---" * 6 + "|"]
    lines += [
        f"| {r['loss']} | {r['seed']} | {r['eval_start']:.3f} | {r['eval_final']:.3f} "
        f"| {r['reward_auc']:.3f} | {r['wall_s']:.0f} |"
        for r in runs
    ]
    # The \boxed{} answer's table (runs without an answer marker: those have the roles' table).
    with_answers = [
        c
        for c in coefs.values()
        if "mean_format" in c["start"] and c["start"]["answer_count_share"]
    ]
    if with_answers:
        lines += [
            "",
            "DelTA coefficients λ̄ on answer tokens (inside `\\boxed{}`) vs formatting tokens, "
            f"on 32 held-out prompts x 8 samples, mean over seeds {', '.join(sorted(coefs))}:",
            "",
        ]
        lines += [
            "| policy | λ̄ answer | λ̄ format | λ̄ answer, Â>0 | λ̄ format, Â>0 | λ̄ answer, Â<0 "
            "| λ̄ format, Â<0 | answer token share | answer weight share |",
            "|---" * 9 + "|",
        ]
        for when in ("start", "final"):
            vals = [np.nanmean([c[when][k] for c in with_answers]) for k in COEF_COLUMNS]
            lines.append(f"| {when} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    lines += shared_token_table(coefs)
    lines += class_table(coefs, ("early", "middle", "late"), "thirds of each response")
    roles = "the final answer (after the answer marker, to its line's end), the template (the "
    roles += "marker, the end of turn) and the reasoning"
    lines += class_table(coefs, ROLES, roles)
    return "\n".join(lines) + "\n"


def class_table(coefs: dict, classes: Sequence[str], what: str) -> list[str]:
    """Markdown: mean λ̄ (all tokens, each side), token share and weight share of each class of
    :func:`~delta_jax.diagnostics.position_shares` / :func:`~delta_jax.diagnostics.role_shares`
    in the coefficient batches, start and final policy, mean over the seeds that have them."""
    have = {k: c for k, c in coefs.items() if f"mean_{classes[0]}" in c["start"]}
    if not have:
        return []
    lines = [
        "",
        f"DelTA coefficients λ̄ by {what}, on 32 held-out prompts x 8 samples, mean over seeds "
        f"{', '.join(sorted(have))}:",
        "",
        "| policy | tokens | λ̄ | λ̄, Â>0 | λ̄, Â<0 | token share | weight share |",
        "|---" * 7 + "|",
    ]
    for when in ("start", "final"):
        for name in classes:
            keys = [f"mean_{name}{s}" for s in ("", "_pos", "_neg")]
            keys += [f"{name}_count_share", f"{name}_weight_share"]
            vals = [np.nanmean([c[when][k] for c in have.values()]) for k in keys]
            lines.append(f"| {when} | {name} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    return lines


def step_table(out: Path, seeds: Sequence[int], every: int = 5) -> list[str]:
    """Markdown: the DelTA runs' centroid cosine cos(μ+, μ−) and sign accuracy of the margins
    at step 1 and every ``every`` steps, mean over seeds (the update's own batches)."""
    series = [delta_series(run_dir(out, "delta", s)) for s in seeds]
    keys = ("delta/centroid_cosine", "delta/sign_accuracy")
    series = [s for s in series if all(k in s for k in keys)]
    if not series:
        return []
    steps = sorted({t for s in series for t in s[keys[0]][0] if t == 1 or t % every == 0})
    lines = ["", "DelTA's centroids over training (the update's batches, mean over seeds):", ""]
    lines += ["| step | " + " | ".join(k.removeprefix("delta/") for k in keys) + " |"]
    lines += ["|---" * (len(keys) + 1) + "|"]
    for t in steps:
        vals = [
            np.nanmean([dict(zip(*s[k], strict=True)).get(t, np.nan) for s in series]) for k in keys
        ]
        lines.append(f"| {t} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    return lines


def shared_token_table(coefs: dict) -> list[str]:
    """Markdown: the shared-token shares (:data:`SHARED_COLUMNS`) of the coefficient batches,
    start and final policy, mean over the seeds that have them (none: no lines)."""
    with_groups = {k: c for k, c in coefs.items() if "shared_count_share" in c["start"]}
    if not with_groups:
        return []
    lines = [
        "",
        "DelTA coefficients λ̄ on tokens both sides of a group write (the same bigram in a "
        "response of the other side: end of turn, common openings, restated problem text) "
        "vs tokens only one side writes, in groups with both sides, on 32 held-out prompts "
        f"x 8 samples, mean over seeds {', '.join(sorted(with_groups))}:",
        "",
        "| policy | λ̄ shared | λ̄ distinct | λ̄ shared, Â>0 | λ̄ distinct, Â>0 "
        "| λ̄ shared, Â<0 | λ̄ distinct, Â<0 | shared token share | shared weight share |",
        "|---" * 9 + "|",
    ]
    for when in ("start", "final"):
        vals = [np.nanmean([c[when][k] for c in with_groups.values()]) for k in SHARED_COLUMNS]
        lines.append(f"| {when} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    return lines


def compare(
    config: str,
    overrides: Sequence[str],
    losses: Sequence[str],
    seeds: Sequence[int],
    out: str | Path,
    *,
    workers: int | None = None,
    title: str | None = None,
    coefficients: bool = True,
) -> Path:
    """Runs the sweep (resuming it), then writes its table, curves, statistics and summary."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    run_sweep(config, overrides, losses, seeds, out, workers=workers)
    runs, table = summarize(out, losses, seeds)
    _write_csv(out / "runs.csv", runs, RUN_COLUMNS)
    _write_csv(out / "table.csv", table, TABLE_COLUMNS)
    plot_curves(out, losses, seeds, out / "curves.png")
    coefs = {}
    if coefficients and "delta" in losses:
        cache = out / "coefficients.json"
        coefs = json.loads(cache.read_text()) if cache.exists() else {}
        for s in seeds:
            if str(s) not in coefs:  # computed once per run, kept across resumed sweeps
                coefs[str(s)] = coefficient_stats(run_dir(out, "delta", s))
                cache.write_text(json.dumps(coefs, indent=1))
    command = " ".join(
        ["delta-jax compare --config", str(config), "--losses", *losses, "--seeds"]
        + [str(s) for s in seeds]
        + ["--out", str(out), *overrides]
    )
    md = summary_markdown(title or out.name, command, runs, table, coefs, list(losses))
    if "delta" in losses:
        md += "\n".join(step_table(out, seeds)) + "\n"
    (out / "summary.md").write_text(md)
    return out / "summary.md"
