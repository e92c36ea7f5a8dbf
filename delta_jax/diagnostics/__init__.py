"""Diagnostics: the metrics log (JSONL), DelTA token heatmaps, coefficient statistics over
training, learning curves.

Typical use::

  sampling = CaptureSampling(n=8)
  batch = capture_batch(model, tokenizer, enc.ids[:4], enc.records[:4], sampling=sampling)
  render_heatmap(batch, "runs/demo/diagnostics/heatmap.html")
  plot_delta_stats(["runs/demo"], "runs/demo/delta_stats.png", batches=[batch])
  plot_runs(["runs/delta", "runs/dapo"], "curves.png")
"""

from delta_jax.diagnostics.capture import (
    CaptureSampling,
    CoefficientBatch,
    capture_batch,
    token_pieces,
)
from delta_jax.diagnostics.heatmap import (
    coefficient_color,
    heatmap_html,
    render_heatmap,
    side_by_side_png,
)
from delta_jax.diagnostics.plots import plot_runs
from delta_jax.diagnostics.stats import (
    DELTA_KEYS,
    ROLES,
    answer_token_mask,
    answer_token_share,
    delta_series,
    frequent_token_share,
    group_shared_share,
    marked_answer_roles,
    plot_delta_stats,
    position_shares,
    role_shares,
    run_batches,
    side_values,
)

__all__ = [
    "DELTA_KEYS",
    "ROLES",
    "CaptureSampling",
    "CoefficientBatch",
    "answer_token_mask",
    "answer_token_share",
    "capture_batch",
    "coefficient_color",
    "delta_series",
    "frequent_token_share",
    "group_shared_share",
    "heatmap_html",
    "marked_answer_roles",
    "plot_delta_stats",
    "plot_runs",
    "position_shares",
    "render_heatmap",
    "role_shares",
    "run_batches",
    "side_by_side_png",
    "side_values",
    "token_pieces",
]
