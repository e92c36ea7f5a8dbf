"""DelTA coefficient statistics over training, and their plots.

Two sources:

* ``<run_dir>/metrics.jsonl``: the per-step scalars the trainer logs from
  ``delta_coefficients(..., return_diagnostics=True)`` under ``delta/`` (:data:`DELTA_KEYS`):
  temperatures ``γ±``, the cosine between the refined centroids ``μ+`` and ``μ−``, centroid
  norms, the share of each side's tokens with ``λ̄ > 1`` and the sign accuracy of the margins;
* saved :class:`~delta_jax.diagnostics.capture.CoefficientBatch` files
  (``<run_dir>/diagnostics/*.npz``, or batches given directly): the distribution of ``λ̄`` on
  each side, and how much of the total coefficient weight sits on the batch's most frequent
  token types (formatting, restated problem text...) compared with their share of the tokens.
  With ``λ̄ ≡ 1`` (plain DAPO) the two shares are equal; DelTA moves weight off tokens that both
  sides share, so on frequent tokens the weight share drops below the count share.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from delta_jax.diagnostics.capture import CoefficientBatch
from delta_jax.diagnostics.metrics_log import read_metrics

DELTA_KEYS = (
    "delta/gamma_pos",
    "delta/gamma_neg",
    "delta/centroid_cosine",
    "delta/centroid_norm_pos",
    "delta/centroid_norm_neg",
    "delta/frac_above_one_pos",
    "delta/frac_above_one_neg",
    "delta/sign_accuracy",
)


def frequent_token_share(batch: CoefficientBatch, *, top_types: int = 20) -> dict[str, float]:
    r"""Coefficient weight on the batch's ``top_types`` most frequent token types vs the rest.

    With ``F`` the set of the most frequent token ids among valid tokens (ties broken by the
    smaller id) and sums over valid tokens::

      count_share  = |{t : id_t ∈ F}| / |valid|
      weight_share = Σ_{id_t ∈ F} λ̄_t / Σ_t λ̄_t
      mean_top     = mean of λ̄ over tokens in F,   mean_rest = over the others

    The same three per side (``_pos``: ``Â > 0``, ``_neg``: ``Â < 0``) restricted to that side's
    tokens (``F`` stays the batch's).

    Args:
      batch: a coefficient batch.
      top_types: how many token types count as "most frequent".

    Returns:
      ``{"count_share", "weight_share", "mean_top", "mean_rest", ... _pos, ... _neg,
      "top_types"}``; NaN where a set is empty.
    """
    if top_types < 1:
        raise ValueError(f"top_types must be >= 1, got {top_types}")
    mask = np.asarray(batch.mask, bool)
    ids = np.asarray(batch.token_ids)[mask]
    lam = np.asarray(batch.coefficients, np.float64)[mask]
    adv = np.broadcast_to(np.asarray(batch.advantages)[:, None], mask.shape)[mask]
    types, counts = np.unique(ids, return_counts=True)
    order = np.lexsort((types, -counts))  # most frequent first, then smaller id
    top = np.isin(ids, types[order[:top_types]])
    out: dict[str, float] = {"top_types": float(min(top_types, len(types)))}
    names = ("count_share", "weight_share", "mean_top", "mean_rest")
    return out | _class_shares(top, lam, adv, names)


def _class_shares(in_class, lam, adv, names: Sequence[str]) -> dict[str, float]:
    """Count share, coefficient-weight share and mean ``λ̄`` in / out of a token class, over
    all tokens and per side (``_pos``: ``Â > 0``, ``_neg``: ``Â < 0``); NaN where a set is
    empty. ``names``: the four quantities' names, in that order."""
    count, weight, mean_in, mean_out = names
    out: dict[str, float] = {}
    for suffix, sel in (("", np.ones_like(in_class)), ("_pos", adv > 0), ("_neg", adv < 0)):
        t, w = in_class[sel], lam[sel]
        total = w.sum()
        out[f"{count}{suffix}"] = float(t.mean()) if t.size else float("nan")
        out[f"{weight}{suffix}"] = float(w[t].sum() / total) if total > 0 else float("nan")
        out[f"{mean_in}{suffix}"] = float(w[t].mean()) if t.any() else float("nan")
        out[f"{mean_out}{suffix}"] = float(w[~t].mean()) if (~t).any() else float("nan")
    return out


def group_shared_share(batch: CoefficientBatch) -> dict[str, float]:
    r"""Coefficient weight on what both sides of a group write vs where they differ.

    In each group (``group_size`` consecutive rows) holding responses of both sides
    (``Â > 0`` and ``Â < 0``), a valid token is *shared* when the same token after the same
    previous token (a bigram; the first token's previous is the response start) also occurs in
    a response of the other side: the end-of-turn token, the group's common opening, restated
    problem text, phrases every response uses. The other tokens are where right and wrong
    responses differ. With ``S`` the shared tokens, over the valid tokens of those groups::

      shared_count_share  = |S| / |valid|
      shared_weight_share = Σ_{t ∈ S} λ̄_t / Σ_t λ̄_t
      mean_shared         = mean λ̄ over S,   mean_distinct = over the others

    and the same per side. Under plain DAPO (``λ̄ ≡ 1``) the weight share equals the count
    share; DelTA damping shared tokens shows as ``shared_weight_share < shared_count_share``.
    ``groups`` is the number of groups with both sides.
    """
    mask = np.asarray(batch.mask, bool)
    ids = np.asarray(batch.token_ids)
    adv = np.asarray(batch.advantages)
    n = batch.group_size
    shared, lam, side = [], [], []
    groups = 0
    for g in range(len(adv) // n):
        rows = range(g * n, (g + 1) * n)
        if not (
            (adv[rows.start : rows.stop] > 0).any() and (adv[rows.start : rows.stop] < 0).any()
        ):
            continue
        groups += 1
        bigrams = {
            i: list(zip([-1, *ids[i][mask[i]][:-1]], ids[i][mask[i]], strict=True)) for i in rows
        }
        by_side = {s: set() for s in (1, -1)}
        for i in rows:
            if adv[i] != 0:
                by_side[int(np.sign(adv[i]))].update(bigrams[i])
        for i in rows:
            other = by_side[-int(np.sign(adv[i]))] if adv[i] != 0 else set()
            shared += [b in other for b in bigrams[i]]
            lam += list(np.asarray(batch.coefficients, np.float64)[i][mask[i]])
            side += [adv[i]] * len(bigrams[i])
    names = ("shared_count_share", "shared_weight_share", "mean_shared", "mean_distinct")
    shares = _class_shares(np.asarray(shared, bool), np.asarray(lam), np.asarray(side), names)
    return {"groups": float(groups)} | shares


def side_values(batch: CoefficientBatch) -> dict[str, np.ndarray]:
    """``λ̄`` of the valid tokens of each side: ``{"positive", "negative", "zero"}``."""
    mask = np.asarray(batch.mask, bool)
    adv = np.asarray(batch.advantages)[:, None]
    lam = np.asarray(batch.coefficients)
    return {
        "positive": lam[mask & (adv > 0)],
        "negative": lam[mask & (adv < 0)],
        "zero": lam[mask & (adv == 0)],
    }


def run_batches(run_dir: str | Path) -> list[CoefficientBatch]:
    """The batches saved under ``<run_dir>/diagnostics/`` (``*.npz``), by step."""
    files = sorted((Path(run_dir) / "diagnostics").glob("*.npz"))
    return sorted((CoefficientBatch.load(f) for f in files), key=lambda b: b.step)


def delta_series(run_dir: str | Path) -> dict[str, tuple[list[int], list[float]]]:
    """``{key: (steps, values)}`` for every :data:`DELTA_KEYS` entry present in the run."""
    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    out = {}
    for key in DELTA_KEYS:
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            out[key] = ([p[0] for p in pts], [float(p[1]) for p in pts])
    return out


def plot_delta_stats(
    run_dirs: Sequence[str | Path] = (),
    out_path: str | Path = "delta_stats.png",
    *,
    batches: Sequence[CoefficientBatch | str | Path] = (),
    labels: Sequence[str] | None = None,
    top_types: int = 20,
) -> Path:
    """One figure of DelTA statistics: ``λ̄`` histograms, frequent-token weight, cos(μ+, μ−), γ±.

    Panels (each drawn only when its data exists):

    1. histograms of ``λ̄`` per side for every batch (the given ones, else each run's last);
    2. weight share vs count share of the ``top_types`` most frequent tokens, per batch step
       (the runs' saved batches; the given ones when no run has any);
    3. ``delta/centroid_cosine`` over steps, one line per run;
    4. ``delta/gamma_pos`` (solid) and ``delta/gamma_neg`` (dashed) over steps;
    5. ``delta/frac_above_one_pos/neg`` and ``delta/sign_accuracy`` over steps.

    Args:
      run_dirs: runs whose ``metrics.jsonl`` and ``diagnostics/*.npz`` to read.
      out_path: PNG to write.
      batches: extra batches (objects or ``.npz`` paths), e.g. captured before and after RL.
      labels: one label per entry of ``batches`` (default ``"step <s>"``).
      top_types: the "most frequent tokens" of panel 2.

    Returns:
      ``out_path``.
    """
    # Lazy: matplotlib (seconds to import) only where a figure is drawn.
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on CPU hosts or in CI
    import matplotlib.pyplot as plt

    given = [b if isinstance(b, CoefficientBatch) else CoefficientBatch.load(b) for b in batches]
    if labels is not None and len(labels) != len(given):
        raise ValueError(f"labels has {len(labels)} entries for {len(given)} batches")
    named = list(zip(labels or [f"step {b.step}" for b in given], given, strict=True))
    series = {Path(d).name or str(d): delta_series(d) for d in run_dirs}
    saved = {Path(d).name or str(d): run_batches(d) for d in run_dirs}
    if not named:
        named = [(f"{run} step {bs[-1].step}", bs[-1]) for run, bs in saved.items() if bs]
    share_curves = {run: bs for run, bs in saved.items() if bs}
    if given and not share_curves:  # given batches usually are the runs' saved ones
        share_curves["given batches"] = given

    panels = []
    if named:
        panels.append("hist")
    if share_curves:
        panels.append("share")
    for panel, keys in (
        ("cosine", ("delta/centroid_cosine",)),
        ("gamma", ("delta/gamma_pos", "delta/gamma_neg")),
        ("fractions", ("delta/frac_above_one_pos", "delta/sign_accuracy")),
    ):
        if any(k in s for s in series.values() for k in keys):
            panels.append(panel)
    if not panels:
        raise ValueError(
            "nothing to plot: no delta/* metrics in the runs' metrics.jsonl and no coefficient "
            "batches (give batches=... or save them under <run_dir>/diagnostics/)"
        )
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "hist":
            _histograms(ax, named)
        elif panel == "share":
            _shares(ax, share_curves, top_types)
        else:
            _metric_lines(ax, panel, series)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def _histograms(ax, named: list[tuple[str, CoefficientBatch]]) -> None:
    values = [v for _, b in named for v in side_values(b).values() if v.size]
    lo, hi = min(v.min() for v in values), max(v.max() for v in values)
    bins = np.linspace(lo, hi if hi > lo else lo + 1e-3, 31)
    styles = ["-", "--", ":", "-."]
    colours = {"positive": "tab:blue", "negative": "tab:orange", "zero": "tab:gray"}
    for j, (label, batch) in enumerate(named):
        for side, vals in side_values(batch).items():
            if vals.size:
                ax.hist(
                    vals,
                    bins=bins,
                    histtype="step",
                    density=True,
                    color=colours[side],
                    linestyle=styles[j % len(styles)],
                    label=f"{label}: {side}",
                )
    ax.set_title("λ̄ per side")
    ax.set_xlabel("λ̄")
    ax.legend(fontsize=7)


def _shares(ax, curves: dict[str, list[CoefficientBatch]], top_types: int) -> None:
    for j, (name, bs) in enumerate(curves.items()):
        steps = [b.step for b in bs]
        stats = [frequent_token_share(b, top_types=top_types) for b in bs]
        colour = f"C{j}"
        ax.plot(
            steps,
            [s["weight_share"] for s in stats],
            "o-",
            color=colour,
            label=f"{name}: weight share",
        )
        ax.plot(
            steps,
            [s["count_share"] for s in stats],
            "s--",
            color=colour,
            alpha=0.6,
            label=f"{name}: token share",
        )
    ax.set_title(f"top-{top_types} frequent tokens")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)


_TITLES = {
    "cosine": "cos(μ+, μ−)",
    "gamma": "γ+ (solid), γ− (dashed)",
    "fractions": "share λ̄>1 (+ solid, − dashed); sign acc. dotted",
}
_LINES = {
    "cosine": (("delta/centroid_cosine", "-"),),
    "gamma": (("delta/gamma_pos", "-"), ("delta/gamma_neg", "--")),
    "fractions": (
        ("delta/frac_above_one_pos", "-"),
        ("delta/frac_above_one_neg", "--"),
        ("delta/sign_accuracy", ":"),
    ),
}


def _metric_lines(ax, panel: str, series: dict[str, dict]) -> None:
    for j, (run, s) in enumerate(series.items()):
        for key, style in _LINES[panel]:
            if key in s:
                steps, vals = s[key]
                ax.plot(
                    steps,
                    vals,
                    style,
                    color=f"C{j}",
                    marker="." if len(steps) < 60 else None,
                    label=f"{run}: {key.removeprefix('delta/')}",
                )
    ax.set_title(_TITLES[panel])
    ax.set_xlabel("step")
    ax.legend(fontsize=7)


def answer_token_mask(pieces: Sequence[str]) -> np.ndarray:
    r"""Which tokens of a response carry its final answer: those inside the last ``\boxed{...}``.

    A token is an answer token when the text it adds overlaps the braces' content; every other
    token (``Answer: \boxed{``, the closing brace, any chain-of-thought template) is formatting
    shared by right and wrong responses. No ``\boxed{`` (or no closing brace): no answer token.
    """
    text = "".join(pieces)
    start = text.rfind("\\boxed{")
    out = np.zeros(len(pieces), bool)
    if start < 0:
        return out
    lo = start + len("\\boxed{")
    hi = text.find("}", lo)
    if hi < 0:
        return out
    ends = np.cumsum([len(p) for p in pieces])
    begins = ends - np.array([len(p) for p in pieces])
    return (begins < hi) & (ends > lo) & (ends > begins)


def answer_token_share(batch: CoefficientBatch) -> dict[str, float]:
    r"""Coefficient weight on answer tokens (inside ``\boxed{}``) vs formatting tokens.

    With ``A`` the answer tokens of :func:`answer_token_mask` and sums over valid tokens::

      answer_count_share  = |A| / |valid|
      answer_weight_share = Σ_{t ∈ A} λ̄_t / Σ_t λ̄_t
      mean_answer         = mean λ̄ over A,   mean_format = over the other tokens

    and the same per side (``_pos``: ``Â > 0``, ``_neg``: ``Â < 0``). Under plain DAPO
    (``λ̄ ≡ 1``) weight share equals count share; DelTA moving credit from shared formatting
    to the discriminative answer shows as ``mean_answer > mean_format``.
    """
    mask = np.asarray(batch.mask, bool)
    answer = np.zeros(mask.shape, bool)
    for i, pieces in enumerate(batch.pieces):
        answer[i, np.flatnonzero(mask[i])] = answer_token_mask(pieces)
    lam = np.asarray(batch.coefficients, np.float64)[mask]
    adv = np.broadcast_to(np.asarray(batch.advantages)[:, None], mask.shape)[mask]
    names = ("answer_count_share", "answer_weight_share", "mean_answer", "mean_format")
    return _class_shares(answer[mask], lam, adv, names)


ROLES = ("reasoning", "template", "answer")
_SPECIAL_PIECE = re.compile(r"^<\|[^|<>]*\|>$")


def marked_answer_roles(pieces: Sequence[str], marker: str) -> np.ndarray:
    """Each token's role in a response that ends on a marked answer (``data.answer_marker``):
    the index into :data:`ROLES` of every piece.

    As the reward reads it, the *answer* is the text after the marker's last occurrence (any
    case) up to the end of that line; a token whose text overlaps it is an answer token. A
    token overlapping that occurrence of the marker itself, or a special token (``<|...|>``,
    the chat template's end of turn), is a *template* token: text every response writes
    whatever its answer. Every other token is *reasoning*. No marker: no answer token.
    """
    text = "".join(pieces)
    ends = np.cumsum([len(p) for p in pieces], dtype=np.int64)
    begins = ends - np.array([len(p) for p in pieces], np.int64)
    roles = np.zeros(len(pieces), np.int8)
    special = np.array([bool(_SPECIAL_PIECE.match(p.strip())) for p in pieces], bool)
    start = text.lower().rfind(marker.lower()) if marker else -1
    if start >= 0:
        lo = start + len(marker)
        line_end = text.find("\n", lo)
        hi = len(text) if line_end < 0 else line_end
        overlaps = lambda a, b: (begins < b) & (ends > a) & (ends > begins)  # noqa: E731
        roles[overlaps(start, lo)] = ROLES.index("template")
        roles[overlaps(lo, hi) & ~special] = ROLES.index("answer")
    roles[special] = ROLES.index("template")
    return roles


def role_shares(batch: CoefficientBatch, marker: str) -> dict[str, float]:
    r"""Coefficient weight on the final answer, the template and the reasoning of each response
    (:func:`marked_answer_roles`). For each role ``r`` over valid tokens::

      r_count_share  = |r| / |valid|
      r_weight_share = Σ_{t ∈ r} λ̄_t / Σ_t λ̄_t
      mean_r         = mean λ̄ over the role's tokens

    and the same per side (``_pos``, ``_neg``). ``marked`` is the fraction of responses with
    the marker.
    """
    mask = np.asarray(batch.mask, bool)
    roles = np.full(mask.shape, -1, np.int8)
    for i, pieces in enumerate(batch.pieces):
        roles[i, np.flatnonzero(mask[i])] = marked_answer_roles(pieces, marker)
    marked = [marker.lower() in "".join(p).lower() for p in batch.pieces]
    return {"marked": float(np.mean(marked))} | _partition_shares(batch, roles, ROLES)


def position_shares(batch: CoefficientBatch, parts: Sequence[str] = ("early", "middle", "late")):
    r"""Coefficient weight by position in the response: token ``j`` of a response of ``L``
    valid tokens is in part ``⌊len(parts)·j / L⌋`` (thirds by default). Per part, the count
    share, weight share and mean ``λ̄`` of :func:`role_shares`, over all tokens and per side."""
    mask = np.asarray(batch.mask, bool)
    part = np.full(mask.shape, -1, np.int8)
    for i in range(mask.shape[0]):
        valid = np.flatnonzero(mask[i])
        part[i, valid] = np.arange(len(valid)) * len(parts) // max(len(valid), 1)
    return _partition_shares(batch, part, parts)


def _partition_shares(batch: CoefficientBatch, label: np.ndarray, names: Sequence[str]):
    """:func:`_class_shares` of each class ``label == k`` (named ``names[k]``) over valid tokens:
    ``<name>_count_share``, ``<name>_weight_share``, ``mean_<name>`` (all tokens and per side)."""
    mask = np.asarray(batch.mask, bool)
    lam = np.asarray(batch.coefficients, np.float64)[mask]
    adv = np.broadcast_to(np.asarray(batch.advantages)[:, None], mask.shape)[mask]
    out: dict[str, float] = {}
    for k, name in enumerate(names):
        quantities = (f"{name}_count_share", f"{name}_weight_share", f"mean_{name}", "_rest")
        shares = _class_shares(label[mask] == k, lam, adv, quantities)
        out |= {key: v for key, v in shares.items() if not key.startswith("_rest")}
    return out
