"""Coefficient statistics (against a hand-written oracle) and the DelTA / learning-curve plots."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from delta_jax.diagnostics import (
    DELTA_KEYS,
    delta_series,
    frequent_token_share,
    plot_delta_stats,
    plot_runs,
    run_batches,
    side_values,
)
from tests.diagnostics.helpers import synthetic_batch, write_metrics


def _share_oracle(batch, top, side=None):
    """Plain-Python count/weight shares of the `top` most frequent ids (ties: smaller id)."""
    toks = []
    for i in range(len(batch.prompts)):
        for j in range(batch.token_ids.shape[1]):
            if batch.mask[i, j]:
                toks.append(
                    (
                        int(batch.token_ids[i, j]),
                        float(batch.coefficients[i, j]),
                        float(batch.advantages[i]),
                    )
                )
    counts = Counter(t for t, _, _ in toks)
    frequent = {t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]}
    if side == "pos":
        toks = [x for x in toks if x[2] > 0]
    elif side == "neg":
        toks = [x for x in toks if x[2] < 0]
    in_top = [x for x in toks if x[0] in frequent]
    rest = [x for x in toks if x[0] not in frequent]
    return dict(
        count_share=len(in_top) / len(toks),
        weight_share=sum(x[1] for x in in_top) / sum(x[1] for x in toks),
        mean_top=np.mean([x[1] for x in in_top]),
        mean_rest=np.mean([x[1] for x in rest]),
    )


@pytest.mark.parametrize("top", [1, 5, 12])
def test_frequent_token_share_matches_oracle(top):
    batch = synthetic_batch(seed=top)
    got = frequent_token_share(batch, top_types=top)
    for side, suffix in ((None, ""), ("pos", "_pos"), ("neg", "_neg")):
        for key, want in _share_oracle(batch, top, side).items():
            assert got[key + suffix] == pytest.approx(want, abs=1e-9), (key, side)


def test_uniform_coefficients_give_equal_shares():
    batch = synthetic_batch()
    flat = dataclasses.replace(batch, coefficients=np.where(batch.mask, 1.0, 0.0))
    got = frequent_token_share(flat, top_types=5)
    assert got["weight_share"] == pytest.approx(got["count_share"], abs=1e-12)
    # The synthetic batch's shared boilerplate is frequent and down-weighted by DelTA.
    real = frequent_token_share(batch, top_types=5)
    assert real["mean_top"] < real["mean_rest"]
    with pytest.raises(ValueError, match="top_types"):
        frequent_token_share(batch, top_types=0)


def test_side_values_partition_the_valid_tokens():
    batch = synthetic_batch()
    sides = side_values(batch)
    assert sum(v.size for v in sides.values()) == int(batch.mask.sum())
    assert sides["zero"].size == 0
    total = sum(v.sum() for v in sides.values())
    assert total == pytest.approx(batch.coefficients[batch.mask].sum(), rel=1e-6)


def _metric_rows(steps, scale):
    rng = np.random.default_rng(int(scale * 10))
    rows = []
    for s in range(1, steps + 1):
        row = {"step": s, "reward_mean": scale * s / steps, "loss": 1.0 / s}
        row.update({k: float(rng.uniform(0.1, 0.9)) for k in DELTA_KEYS})
        if s % 2 == 0:
            row["eval/avg@1"] = scale * s / steps
        rows.append(row)
    return rows


def _png_size(path):
    with Image.open(path) as im:
        return im.size


def test_plot_delta_stats_from_runs_and_batches(tmp_path):
    run = write_metrics(tmp_path / "delta", _metric_rows(6, 1.0))
    for step in (0, 3, 6):
        synthetic_batch(seed=step, step=step).save(run / "diagnostics" / f"batch_{step:06d}.npz")
    assert [b.step for b in run_batches(run)] == [0, 3, 6]
    series = delta_series(run)
    assert set(series) == set(DELTA_KEYS) and series["delta/gamma_pos"][0] == [1, 2, 3, 4, 5, 6]
    out = plot_delta_stats([run], tmp_path / "stats.png")
    width, height = _png_size(out)
    assert width > 4 * height  # five panels side by side
    # Batches alone (e.g. captured before and after RL in the notebook).
    only = plot_delta_stats(
        [],
        tmp_path / "b.png",
        batches=[synthetic_batch(step=0), run / "diagnostics" / "batch_000006.npz"],
        labels=["before", "after"],
    )
    w2, h2 = _png_size(only)
    assert w2 < 2.6 * h2  # two panels
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_delta_stats(
            [write_metrics(tmp_path / "empty", [{"step": 1, "loss": 1.0}])], tmp_path / "none.png"
        )
    with pytest.raises(ValueError, match="labels"):
        plot_delta_stats([], tmp_path / "x.png", batches=[synthetic_batch()], labels=["a", "b"])


def test_plot_runs_compares_runs(tmp_path):
    a = write_metrics(tmp_path / "runs" / "delta", _metric_rows(8, 1.0))
    b = write_metrics(tmp_path / "runs" / "dapo", _metric_rows(8, 0.7))
    out = plot_runs([a, b], tmp_path / "curves.png")
    w, h = _png_size(out)
    assert w > 2.5 * h  # reward_mean, eval/avg@1, loss (response_length_mean absent)
    single = plot_runs([a], tmp_path / "one.png", panels=("loss",))
    w1, h1 = _png_size(single)
    assert w1 < 1.6 * h1


def test_plot_runs_keeps_runs_with_the_same_name(tmp_path, monkeypatch):
    import matplotlib.axes

    a = write_metrics(tmp_path / "a" / "run", _metric_rows(4, 1.0))
    b = write_metrics(tmp_path / "b" / "run", _metric_rows(4, 0.5))
    drawn = []
    real_plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "plot",
        lambda self, *args, **kw: drawn.append(kw.get("label")) or real_plot(self, *args, **kw),
    )
    plot_runs([a, b], tmp_path / "c.png", panels=("reward_mean",))
    assert drawn == [str(a), str(b)]


def test_answer_token_mask_marks_the_boxed_content():
    from delta_jax.diagnostics import answer_token_mask

    pieces = list("Answer: \\boxed{85}")
    assert "".join(np.array(pieces)[answer_token_mask(pieces)]) == "85"
    multi = ["Ans", "wer: \\box", "ed{1", "23}", " Done."]  # pieces spanning the braces
    np.testing.assert_array_equal(answer_token_mask(multi), [0, 0, 1, 1, 0])
    assert not answer_token_mask(list("no answer {1}")).any()
    assert not answer_token_mask(list("\\boxed{12")).any()  # unclosed: nothing counted


def test_answer_token_share_matches_a_loop_oracle():
    from delta_jax.diagnostics import answer_token_share

    batch = synthetic_batch(seed=1)
    got = answer_token_share(batch)
    lam, adv = np.asarray(batch.coefficients, np.float64), np.asarray(batch.advantages)
    for suffix, keep in (
        ("", lambda a: True),
        ("_pos", lambda a: a > 0),
        ("_neg", lambda a: a < 0),
    ):
        ans, fmt = [], []
        for i, pieces in enumerate(batch.pieces):
            if not keep(adv[i]):
                continue
            text, pos = "".join(pieces), 0
            lo = text.rfind("\\boxed{") + len("\\boxed{")
            hi = text.find("}", lo)
            for j, p in enumerate(pieces):
                (ans if lo <= pos < hi else fmt).append(lam[i, j])
                pos += len(p)
        np.testing.assert_allclose(got[f"mean_answer{suffix}"], np.mean(ans), rtol=1e-6)
        np.testing.assert_allclose(got[f"mean_format{suffix}"], np.mean(fmt), rtol=1e-6)
        share = sum(ans) / (sum(ans) + sum(fmt))
        np.testing.assert_allclose(got[f"answer_weight_share{suffix}"], share, rtol=1e-6)
        np.testing.assert_allclose(
            got[f"answer_count_share{suffix}"], len(ans) / (len(ans) + len(fmt)), rtol=1e-9
        )
    # The synthetic batch's digits are its discriminative tokens: DelTA weights them up.
    assert got["mean_answer"] > got["mean_format"]


def test_group_shared_share_against_a_hand_count():
    """Two groups of three: the second is all one side, so only the first counts.

    Group 0 (ids; advantages +, -, 0):  row 0 = 5 7 9 2   row 1 = 5 7 8 2   row 2 = 5 7
    Bigrams of row 0: (s,5) (5,7) (7,9) (9,2); of row 1: (s,5) (5,7) (7,8) (8,2). Shared with
    the other side: row 0 -> T T F F, row 1 -> T T F F; row 2 has no side (Â = 0): F F.
    """
    from delta_jax.diagnostics import CoefficientBatch, group_shared_share

    ids = np.array([[5, 7, 9, 2], [5, 7, 8, 2], [5, 7, 0, 0], [1, 2, 3, 4], [1, 2, 3, 4],
                    [1, 2, 3, 4]])  # fmt: skip
    mask = ids > 0
    lam = np.where(mask, np.arange(1, 25).reshape(6, 4) / 10, 0.0)
    adv = np.array([1.0, -1.0, 0.0, 1.0, 1.0, 1.0])
    batch = CoefficientBatch(
        token_ids=ids, coefficients=lam.astype(np.float32), mask=mask, advantages=adv,
        rewards=np.zeros(6), prompts=["p"] * 6, pieces=[["x"] * int(m.sum()) for m in mask],
        group_size=3,
    )  # fmt: skip
    out = group_shared_share(batch)
    assert out["groups"] == 1
    w = lam[:3][mask[:3]].astype(np.float32).astype(np.float64)  # 10 valid tokens in group 0
    shared = np.array([1, 1, 0, 0, 1, 1, 0, 0, 0, 0], bool)
    assert out["shared_count_share"] == pytest.approx(4 / 10)
    assert out["shared_weight_share"] == pytest.approx(w[shared].sum() / w.sum())
    assert out["mean_shared"] == pytest.approx(w[shared].mean())
    assert out["mean_distinct"] == pytest.approx(w[~shared].mean())
    assert out["shared_count_share_pos"] == pytest.approx(0.5)
    assert out["shared_weight_share_neg"] == pytest.approx((0.5 + 0.6) / (0.5 + 0.6 + 0.7 + 0.8))


def test_marked_answer_roles_follow_the_reward_s_reading():
    from delta_jax.diagnostics import ROLES, marked_answer_roles

    pieces = ["2 x 3", " is 6.", "\nThe final", " answer is", " 6", ".\n", "Bye", "<|im_end|>"]
    roles = [ROLES[k] for k in marked_answer_roles(pieces, "the final answer is")]
    assert roles == [
        "reasoning",
        "reasoning",
        "template",  # overlaps the marker ("\nThe final")
        "template",
        "answer",
        "answer",  # "." then the line's end: the reward reads it
        "reasoning",  # after the marked line
        "template",  # the end of turn
    ]
    # The last occurrence counts, in any case; no marker: no answer token.
    last = marked_answer_roles(
        list("the final answer is 1 THE FINAL ANSWER IS 2"), "The final answer is"
    )
    assert "".join(np.array(list("the final answer is 1 THE FINAL ANSWER IS 2"))[last == 2]) == " 2"
    assert not (
        marked_answer_roles(["no", " marker", "<|im_end|>"], "The final answer is") == 2
    ).any()


def _role_oracle(batch, label_of, names):
    """Loop oracle: count share, weight share and mean λ̄ of each class, all and per side."""
    lam, adv = np.asarray(batch.coefficients, np.float64), np.asarray(batch.advantages)
    out = {}
    for suffix, keep in (
        ("", lambda a: True),
        ("_pos", lambda a: a > 0),
        ("_neg", lambda a: a < 0),
    ):
        toks = [
            (label_of(i, j), lam[i, j])
            for i in range(len(adv))
            if keep(adv[i])
            for j in np.flatnonzero(batch.mask[i])
        ]
        total = sum(v for _, v in toks)
        for k, name in enumerate(names):
            mine = [v for c, v in toks if c == k]
            out[f"{name}_count_share{suffix}"] = len(mine) / len(toks)
            out[f"{name}_weight_share{suffix}"] = sum(mine) / total
            out[f"mean_{name}{suffix}"] = np.mean(mine) if mine else float("nan")
    return out


def test_role_and_position_shares_match_a_loop_oracle():
    from delta_jax.diagnostics import CoefficientBatch, position_shares, role_shares
    from tests.diagnostics.helpers import synthetic_batch

    batch = synthetic_batch(seed=2)
    # "Answer:" as the marker: the answer is the rest of the line ("\boxed{85}").
    got = role_shares(batch, "Answer:")
    # One character a token in every marked response (the unmarked one has "<unk>" pieces).
    assert all(len(p) == 1 for ps in batch.pieces if "Answer:" in "".join(ps) for p in ps)

    def role(i, j):
        at = "".join(batch.pieces[i]).rfind("Answer:")
        if at < 0 or j < at:
            return 0  # reasoning
        return 1 if j < at + len("Answer:") else 2  # the marker, then the rest of the line

    want = _role_oracle(batch, role, ("reasoning", "template", "answer"))
    assert got["marked"] == 7 / 8  # "Ans: ..." has no marker
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-6, err_msg=key)
    # Uniform coefficients: every weight share equals its count share.
    flat = CoefficientBatch(**{**batch.__dict__, "coefficients": np.where(batch.mask, 1.0, 0.0)})
    for name in ("reasoning", "template", "answer"):
        flat_shares = role_shares(flat, "Answer:")
        assert flat_shares[f"{name}_weight_share"] == pytest.approx(
            flat_shares[f"{name}_count_share"]
        )

    thirds = position_shares(batch)
    lengths = batch.mask.sum(1)
    want = _role_oracle(batch, lambda i, j: 3 * j // lengths[i], ("early", "middle", "late"))
    for key, value in want.items():
        np.testing.assert_allclose(thirds[key], value, rtol=1e-6, err_msg=key)
