"""The token heatmap page: its markup, its colour code, and a real render in headless Chromium."""

from __future__ import annotations

import colorsys
import html
import re
import shutil
import subprocess

import numpy as np
import pytest

from delta_jax.diagnostics import coefficient_color, heatmap_html, render_heatmap
from delta_jax.diagnostics.heatmap import NEGATIVE_HUE, POSITIVE_HUE
from tests.diagnostics.helpers import synthetic_batch

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


@pytest.fixture(scope="module")
def batch():
    return synthetic_batch()


def test_page_has_one_span_per_token_with_value_id_and_side(batch):
    page = heatmap_html(batch)
    spans = re.findall(
        r'<span class="tok" style="background:hsl\((\d+),(\d+)%,(\d+)%\)[^"]*" '
        r'data-lam="([-\d.]+)" data-id="(\d+)" data-side="([+\-0])" '
        r'title="([^"]*)">(.*?)</span>',
        page,
        flags=re.S,
    )
    assert len(spans) == int(batch.mask.sum())
    k = 0
    for i in range(len(batch.prompts)):
        for j in np.flatnonzero(batch.mask[i]):
            hue, _, _, lam, tok_id, side, title, _ = spans[k]
            assert float(lam) == pytest.approx(batch.coefficients[i, j], abs=5e-5)
            assert int(tok_id) == batch.token_ids[i, j]
            assert side == ("+" if batch.advantages[i] > 0 else "-")
            assert int(hue) == (POSITIVE_HUE if side == "+" else NEGATIVE_HUE)
            assert html.unescape(title) == f"λ̄ = {lam} | token id {tok_id} | side {side}"
            k += 1
    # Token text is escaped: "<unk>" pieces never become tags.
    assert "&lt;unk&gt;" in page and "<unk>" not in page
    assert "<script>" in page and "http" not in page.replace("http-equiv", "")  # self-contained


def test_colour_code():
    lo, hi = 0.8, 1.3
    lights = [coefficient_color(v, 1.0, lo, hi)[2] for v in np.linspace(lo, hi, 6)]
    assert lights == sorted(lights, reverse=True) and lights[0] > lights[-1]  # larger = darker
    assert coefficient_color(1.0, 2.0, lo, hi)[0] == POSITIVE_HUE
    assert coefficient_color(1.0, -0.1, lo, hi)[0] == NEGATIVE_HUE
    assert coefficient_color(1.0, 0.0, lo, hi)[1] == 0  # zero advantage: grey
    assert coefficient_color(5.0, 1.0, lo, hi) == coefficient_color(hi, 1.0, lo, hi)  # clipped


def _hue_clusters(png_path):
    """Pixels of the screenshot grouped by hue (saturated pixels only) and their lightness."""
    from PIL import Image

    rgb = np.asarray(Image.open(png_path).convert("RGB"), np.float64) / 255.0
    flat = rgb.reshape(-1, 3)
    hls = np.array([colorsys.rgb_to_hls(*px) for px in flat[::3]])  # every 3rd pixel: fast
    hue, light, sat = hls[:, 0] * 360, hls[:, 1], hls[:, 2]
    coloured = sat > 0.35

    def near(h):
        return coloured & (np.abs((hue - h + 180) % 360 - 180) < 12)

    return near(POSITIVE_HUE), near(NEGATIVE_HUE), coloured, light


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")
def test_heatmap_renders_coloured_tokens_in_chromium(batch, tmp_path):
    page = render_heatmap(batch, tmp_path / "heatmap.html")
    shot = tmp_path / "heatmap.png"
    cmd = [
        CHROMIUM,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1100,900",
        f"--screenshot={shot}",
        page.resolve().as_uri(),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    blue, orange, coloured, light = _hue_clusters(shot)
    # Both sides' colours are on the page, in amounts that only token backgrounds explain
    # (the legend bars alone are ~180x14 px each, i.e. ~840 sampled pixels).
    assert blue.sum() > 2000 and orange.sum() > 2000, (blue.sum(), orange.sum())
    # Nearly every saturated pixel belongs to one of the two hue clusters.
    assert (blue | orange).sum() > 0.95 * coloured.sum()
    # Different λ̄ give different shades: no single lightness level dominates a side (a page
    # with λ̄ ≡ 1 puts ~70% of each side's pixels on one level; this batch ~20%).
    for side in (blue, orange):
        levels, counts = np.unique(np.round(light[side] * 20), return_counts=True)
        assert (counts > 100).sum() >= 3, dict(zip(levels, counts, strict=True))
        assert counts.max() < 0.5 * counts.sum(), dict(zip(levels, counts, strict=True))


def test_groups_with_signal_come_first_and_max_rows(batch):
    import dataclasses

    adv = batch.advantages.copy()
    adv[:4] = 0.0  # the first prompt's group has no learning signal
    page = heatmap_html(dataclasses.replace(batch, advantages=adv))
    prompts = re.findall(r"<div class='prompt'>(.*?)</div>", page, flags=re.S)
    assert [html.unescape(p) for p in prompts] == [batch.prompts[4], batch.prompts[0]]
    one_group = heatmap_html(batch, max_rows=4)
    assert one_group.count("<div class='row'>") == 4


def test_side_by_side_figure_puts_a_right_and_a_wrong_response_in_their_colours(batch, tmp_path):
    """The documents' figure: each group's first right response (blue) beside its first wrong
    one (orange), in the page's shades; a batch without both sides in a group is refused."""
    from delta_jax.diagnostics import CoefficientBatch, side_by_side_png

    png = side_by_side_png(batch, tmp_path / "pairs.png", groups=2, width=24)
    blue, orange, coloured, light = _hue_clusters(png)
    assert blue.sum() > 300 and orange.sum() > 300, (blue.sum(), orange.sum())
    assert (blue | orange).sum() > 0.95 * coloured.sum()
    for side in (blue, orange):  # several λ̄, several shades
        assert len(np.unique(np.round(light[side] * 20))) >= 3
    one_side = CoefficientBatch(**{**batch.__dict__, "advantages": np.abs(batch.advantages)})
    with pytest.raises(ValueError, match="both sides"):
        side_by_side_png(one_side, tmp_path / "none.png")
