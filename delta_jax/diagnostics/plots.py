"""Learning-curve plots from one or more runs' ``metrics.jsonl``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from delta_jax.diagnostics.metrics_log import read_metrics

DEFAULT_PANELS = ("reward_mean", "eval/avg@1", "loss", "response_length_mean")


def plot_runs(
    run_dirs: Sequence[str | Path],
    out_path: str | Path,
    *,
    panels: Sequence[str] = DEFAULT_PANELS,
) -> Path:
    """Draw one panel per metric with one line per run; write a PNG and return its path.

    Panels whose metric no run has are left out (``reward_mean`` is drawn when none is left).

    Args:
      run_dirs: run directories, each with a ``metrics.jsonl``.
      out_path: the PNG to write.
      panels: metric keys of ``metrics.jsonl``, one panel each.

    Returns:
      ``out_path``.

    Example::

      plot_runs(["runs/delta", "runs/dapo"], "curves.png")  # delta-jax plot runs/delta runs/dapo
    """
    # Lazy: matplotlib (seconds to import) only where a figure is drawn.
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on CPU hosts or in CI
    import matplotlib.pyplot as plt

    names = [Path(d).name or str(d) for d in run_dirs]
    # Runs that share a directory name (a/run, b/run) are told apart by their full path.
    labels = [n if names.count(n) == 1 else str(d) for n, d in zip(names, run_dirs, strict=True)]
    runs = {
        lab: read_metrics(Path(d) / "metrics.jsonl")
        for lab, d in zip(labels, run_dirs, strict=True)
    }
    shown = [p for p in panels if any(p in row for rows in runs.values() for row in rows)]
    shown = shown or ["reward_mean"]
    fig, axes = plt.subplots(1, len(shown), figsize=(4.2 * len(shown), 3.4), squeeze=False)
    for ax, key in zip(axes[0], shown, strict=True):
        for name, rows in runs.items():
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="." if len(xs) < 60 else None, label=name)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
