"""A self-contained HTML page showing each response token coloured by its DelTA coefficient.

Colour code (one page per sampled batch, no external resources, opens offline):

* the **hue** says which side of the update a token is on: blue for a positive-advantage
  response (``Â > 0``), orange for a negative one (``Â < 0``), grey for ``Â = 0`` (those tokens
  all get ``λ_min`` before normalisation and carry no gradient);
* the **strength** says how large ``λ̄`` is: pale for the smallest coefficient of the batch's
  scored tokens, saturated and dark for the largest. A discriminative token (far from the other
  side's centroid) is dark; boilerplate shared by both sides is pale.

Hovering a token shows its ``λ̄``, token id and side (``title`` tooltip, and a fixed panel
updated by a few lines of inline JavaScript). Blue/orange rather than green/red so that the two
sides stay apart for red-green colour-blind readers.
"""

from __future__ import annotations

import colorsys
import html
from pathlib import Path

import numpy as np

from delta_jax.diagnostics.capture import CoefficientBatch

POSITIVE_HUE = 212  # blue
NEGATIVE_HUE = 24  # orange
_LIGHT_PALE, _LIGHT_DARK = 94.0, 42.0

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 16px 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 6px; }
.summary { font-size: 13px; color: #444; margin-bottom: 10px; }
.legend { display: flex; gap: 28px; align-items: center; font-size: 13px; margin: 8px 0 14px; }
.bar { width: 180px; height: 14px; border: 1px solid #999; display: inline-block;
       vertical-align: middle; margin: 0 6px; }
.group { border-top: 2px solid #ccc; margin-top: 14px; padding-top: 6px; }
.prompt { font-family: ui-monospace, monospace; font-size: 12px; color: #555;
          white-space: pre-wrap; margin-bottom: 4px; }
.row { display: flex; gap: 10px; margin: 3px 0; align-items: baseline; }
.meta { flex: 0 0 190px; font-size: 12px; color: #333; font-family: ui-monospace, monospace; }
.resp { font-family: ui-monospace, monospace; font-size: 15px; line-height: 1.9;
        white-space: pre-wrap; word-break: break-word; }
.tok { padding: 2px 0; border-radius: 2px; }
.tok:hover { outline: 2px solid #000; }
#info { position: fixed; top: 8px; right: 12px; background: #fff; border: 1px solid #888;
        padding: 6px 10px; font: 12px ui-monospace, monospace; min-width: 220px; }
"""

_SCRIPT = """
document.addEventListener('mouseover', function (e) {
  var t = e.target;
  if (!t.classList || !t.classList.contains('tok')) return;
  document.getElementById('info').textContent =
    'λ̄ = ' + t.dataset.lam + '  id ' + t.dataset.id + '  side ' + t.dataset.side;
});
"""


def coefficient_color(lam: float, advantage: float, lo: float, hi: float) -> tuple[int, int, int]:
    """The HSL colour ``(hue, saturation %, lightness %)`` of a token.

    Args:
      lam: the token's ``λ̄``.
      advantage: its response's ``Â`` (the sign picks the hue; 0 gives grey).
      lo: ``λ̄`` drawn palest.
      hi: ``λ̄`` drawn darkest.

    Returns:
      Integers ``(h, s, l)``.

    Examples:
      >>> coefficient_color(1.2, 1.0, 0.8, 1.2)
      (212, 80, 42)
    """
    t = 0.5 if hi <= lo else float(np.clip((lam - lo) / (hi - lo), 0.0, 1.0))
    light = round(_LIGHT_PALE - (_LIGHT_PALE - _LIGHT_DARK) * t)
    if advantage > 0:
        return POSITIVE_HUE, 80, light
    if advantage < 0:
        return NEGATIVE_HUE, 90, light
    return 0, 0, 80


def _token_html(piece: str, tok_id: int, lam: float, adv: float, lo: float, hi: float) -> str:
    h, s, light = coefficient_color(lam, adv, lo, hi)
    side = "+" if adv > 0 else "-" if adv < 0 else "0"
    # Whitespace-only tokens would be invisible: draw their spaces and tabs, keep line breaks.
    if not piece:
        shown = "∅"
    elif not piece.strip():
        shown = piece.replace(" ", "·").replace("\t", "→").replace("\n", "↵\n")
    else:
        shown = piece.replace("\n", "↵\n")
    fg = "#fff" if light < 58 else "#111"
    return (
        f'<span class="tok" style="background:hsl({h},{s}%,{light}%);color:{fg}" '
        f'data-lam="{lam:.4f}" data-id="{tok_id}" data-side="{side}" '
        f'title="λ̄ = {lam:.4f} | token id {tok_id} | side {side}">{html.escape(shown)}</span>'
    )


def _legend(lo: float, hi: float) -> str:
    def bar(hue: int, sat: int) -> str:
        return (
            f'<span class="bar" style="background:linear-gradient(to right, '
            f'hsl({hue},{sat}%,{_LIGHT_PALE:.0f}%), hsl({hue},{sat}%,{_LIGHT_DARK:.0f}%))"></span>'
        )

    return (
        '<div class="legend">'
        f"<span>Â &gt; 0 (positive side): {lo:.3f}{bar(POSITIVE_HUE, 80)}{hi:.3f}</span>"
        f"<span>Â &lt; 0 (negative side): {lo:.3f}{bar(NEGATIVE_HUE, 90)}{hi:.3f}</span>"
        '<span><span class="bar" style="width:28px;background:hsl(0,0%,80%)"></span>'
        "Â = 0</span></div>"
    )


def heatmap_html(batch: CoefficientBatch, *, title: str | None = None, max_rows: int = 64) -> str:
    """The heatmap page of ``batch`` as an HTML string (see the module docstring).

    Args:
      batch: the coefficients and tokens.
      title: page heading (default: the step).
      max_rows: responses shown (whole groups; groups with nonzero advantages first).

    Returns:
      A complete HTML document.
    """
    lam, mask, adv = np.asarray(batch.coefficients), np.asarray(batch.mask), batch.advantages
    scored = mask & (np.asarray(adv)[:, None] != 0)
    values = lam[scored] if scored.any() else lam[mask]
    lo, hi = (float(values.min()), float(values.max())) if values.size else (0.0, 1.0)
    title = title or f"DelTA token coefficients, step {batch.step}"
    pos, neg = mask & (adv[:, None] > 0), mask & (adv[:, None] < 0)
    summary = (
        f"{len(batch.prompts)} responses ({batch.group_size} per prompt), "
        f"{int(mask.sum())} tokens. "
        f"Mean λ̄: positive side {lam[pos].mean() if pos.any() else float('nan'):.4f}, "
        f"negative side {lam[neg].mean() if neg.any() else float('nan'):.4f}, "
        f"all {lam[mask].mean() if mask.any() else float('nan'):.4f}. "
        f"Colour range {lo:.4f} (pale) to {hi:.4f} (dark)."
    )
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1><div class='summary'>{html.escape(summary)}</div>",
        _legend(lo, hi),
        "<div id='info'>hover a token</div>",
    ]
    n = max(batch.group_size, 1)
    groups = list(range(0, len(batch.prompts), n))
    # Groups with a learning signal first: equal rewards give Â = 0, all grey.
    groups.sort(key=lambda g: not np.any(adv[g : g + n] != 0))
    for g in groups[: max(1, max_rows // n)]:
        prompt = html.escape(batch.prompts[g])
        parts.append(f"<div class='group'><div class='prompt'>{prompt}</div>")
        for i in range(g, min(g + n, len(batch.prompts))):
            ids = np.asarray(batch.token_ids[i])[mask[i]]
            lams = lam[i][mask[i]]
            meta = f"reward {batch.rewards[i]:.2f} · Â {adv[i]:+.3f}"
            if lams.size:
                meta += f" · mean λ̄ {lams.mean():.3f}"
            toks = "".join(
                _token_html(p, int(t), float(v), float(adv[i]), lo, hi)
                for p, t, v in zip(batch.pieces[i], ids, lams, strict=True)
            )
            parts.append(
                f"<div class='row'><div class='meta'>{html.escape(meta)}</div>"
                f"<div class='resp'>{toks}</div></div>"
            )
        parts.append("</div>")
    parts.append(f"<script>{_SCRIPT}</script></body></html>")
    return "".join(parts)


def render_heatmap(
    batch: CoefficientBatch | str | Path,
    out_path: str | Path,
    *,
    title: str | None = None,
    max_rows: int = 64,
) -> Path:
    """Writes the heatmap page of a batch (or of a saved ``.npz`` batch); returns its path.

    Example::

      sampling = CaptureSampling(n=8)
      batch = capture_batch(model, tok, enc.ids[:4], enc.records[:4], sampling=sampling)
      render_heatmap(batch, "runs/demo/diagnostics/heatmap.html")
    """
    if not isinstance(batch, CoefficientBatch):
        batch = CoefficientBatch.load(batch)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(heatmap_html(batch, title=title, max_rows=max_rows), encoding="utf-8")
    return out_path


def side_by_side_png(
    batch: CoefficientBatch | str | Path,
    out_path: str | Path,
    *,
    groups: int = 2,
    width: int = 56,
    max_lines: int = 18,
) -> Path:
    """A static figure of the heatmap for documents: for the first ``groups`` groups with both
    sides, the first right response (``Â > 0``) and the first wrong one (``Â < 0``) side by
    side, each token's characters on the page's colours (:func:`coefficient_color`, the batch's
    scored range), wrapped at ``width`` characters and cut after ``max_lines`` lines."""
    # Lazy: matplotlib (seconds to import) only where a figure is drawn.
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    if not isinstance(batch, CoefficientBatch):
        batch = CoefficientBatch.load(batch)
    lam, mask, adv = np.asarray(batch.coefficients), np.asarray(batch.mask), batch.advantages
    scored = lam[mask & (np.asarray(adv)[:, None] != 0)]
    lo, hi = float(scored.min()), float(scored.max())
    n = max(batch.group_size, 1)
    pairs = []
    for g in range(0, len(batch.prompts), n):
        rows = range(g, min(g + n, len(batch.prompts)))
        right = [i for i in rows if adv[i] > 0]
        wrong = [i for i in rows if adv[i] < 0]
        if right and wrong:
            pairs.append((right[0], wrong[0]))
    if not pairs:
        raise ValueError("no group of the batch has both sides")
    pairs = pairs[:groups]
    size = (2 * width * 0.105, len(pairs) * (max_lines + 3) * 0.2)
    fig, axes = plt.subplots(len(pairs), 2, figsize=size, squeeze=False)
    for (right, wrong), row in zip(pairs, axes, strict=True):
        for i, ax in zip((right, wrong), row, strict=True):
            _draw_response(ax, batch, i, lo, hi, width, max_lines)
    fig.suptitle(f"λ̄ from {lo:.2f} (pale) to {hi:.2f} (dark); blue: right, orange: wrong")
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


_CELL_TEXT = {"ha": "center", "va": "center", "fontsize": 6.5, "family": "monospace"}


def _draw_response(ax, batch, i, lo, hi, width, max_lines) -> None:
    """One response's tokens as coloured character cells on ``ax``."""
    # Lazy, as the figure's other matplotlib imports.
    from matplotlib.patches import Rectangle

    lam, mask = np.asarray(batch.coefficients)[i], np.asarray(batch.mask)[i]
    adv = float(batch.advantages[i])
    col, line = 0, 0
    for piece, v in zip(batch.pieces[i], lam[mask], strict=True):
        h, s, light = coefficient_color(float(v), adv, lo, hi)
        colour = colorsys.hls_to_rgb(h / 360, light / 100, s / 100)
        for ch in piece.replace("\n", "↵\n"):
            if ch == "\n" or col >= width:
                col, line = 0, line + 1
                if ch == "\n":
                    continue
            if line < max_lines:
                ax.add_patch(Rectangle((col, -line - 1), 1, 1, facecolor=colour, lw=0))
                fg = "#fff" if light < 58 else "#111"
                ax.text(col + 0.5, -line - 0.5, ch, color=fg, **_CELL_TEXT)
            col += 1
    more = " …" if line >= max_lines else ""
    ax.set_title(
        f"reward {batch.rewards[i]:.2f}, Â {adv:+.2f}, mean λ̄ {lam[mask].mean():.3f}{more}",
        fontsize=8,
        loc="left",
    )
    ax.set_xlim(0, width)
    ax.set_ylim(-max_lines, 0)
    ax.axis("off")
