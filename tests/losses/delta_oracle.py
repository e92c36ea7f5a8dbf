"""Float64 NumPy oracle of DELTA_SPEC §3, written straight from the spec.

Deliberately naive: the token vectors ``v`` are formed explicitly, margins are explicit squared
distances ``‖v − μ−‖² − ‖v − μ+‖²`` (not the cheap projection form), and the refinement loop
follows the spec's wording step by step (temperatures recomputed from the margins at the start
of each step).
"""

from __future__ import annotations

import numpy as np


def lm_head_row_vectors(hidden, logprobs):
    """``v = (1 − p) h`` in float64, ``[B, T, H]``."""
    hidden = np.asarray(hidden, np.float64)
    p = np.exp(np.asarray(logprobs, np.float64))
    return (1.0 - p)[..., None] * hidden


def hidden_topk_vectors(lm_head, token_ids, topk_logits, topk_ids):
    """``v = W_y − Σ_{j∈topk} p̃(j) W_j`` in float64, ``[B, T, H]`` (``lm_head`` is ``[H, V]``)."""
    rows = np.asarray(lm_head, np.float64).T  # [V, H]
    logits = np.asarray(topk_logits, np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    own = rows[np.asarray(token_ids)]
    mix = np.einsum("btk,btkh->bth", p, rows[np.asarray(topk_ids)])
    return own - mix


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def delta_oracle(
    v,
    advantages,
    mask,
    *,
    refine_steps=1,
    lam_min=0.8,
    lam_max=1.2,
    assignment="soft",
    adaptive_gamma=True,
    range_map=True,
    normalize="sum",
    eps=1e-8,
):
    """Returns ``(λ̄ [B, T] float64, diagnostics dict)`` for token vectors ``v`` ``[B, T, H]``."""
    v = np.asarray(v, np.float64)
    adv = np.asarray(advantages, np.float64)
    valid = np.asarray(mask) != 0
    adv_tok = np.broadcast_to(adv[:, None], valid.shape)
    pos = valid & (adv_tok > 0)
    neg = valid & (adv_tok < 0)
    vp, vn = v[pos], v[neg]  # [n+, H], [n−, H]
    ap, an = adv_tok[pos], -adv_tok[neg]

    def centroid(vs, w):
        return (w[:, None] * vs).sum(0) / max(w.sum(), eps)

    def margin_pos(vs, mu_p, mu_n):  # Δ+ = ‖v − μ−‖² − ‖v − μ+‖²
        return ((vs - mu_n) ** 2).sum(-1) - ((vs - mu_p) ** 2).sum(-1)

    def temperature(x):
        var = x.var() if x.size else 0.0  # population variance, unweighted
        return np.sqrt(max(var, eps))

    def score(x, gamma):
        return (x > 0).astype(np.float64) if assignment == "hard" else _sigmoid(x / gamma)

    mu_p, mu_n = centroid(vp, ap), centroid(vn, an)
    gamma_p = temperature(margin_pos(vp, mu_p, mu_n))
    gamma_n = temperature(-margin_pos(vn, mu_p, mu_n))
    for _ in range(refine_steps):
        dp = margin_pos(vp, mu_p, mu_n)  # margins at the start of this step
        dn = -margin_pos(vn, mu_p, mu_n)
        alpha_p, alpha_n = score(dp, gamma_p), score(dn, gamma_n)
        mu_p, mu_n = centroid(vp, ap * alpha_p), centroid(vn, an * alpha_n)
        if adaptive_gamma:
            gamma_p, gamma_n = temperature(dp), temperature(dn)
    dp = margin_pos(vp, mu_p, mu_n)
    dn = -margin_pos(vn, mu_p, mu_n)
    alpha_p, alpha_n = score(dp, gamma_p), score(dn, gamma_n)

    lam = np.zeros(valid.shape)
    if range_map:
        lam[valid] = lam_min
        lam[pos] = lam_min + (lam_max - lam_min) * alpha_p
        lam[neg] = lam_min + (lam_max - lam_min) * alpha_n
    else:
        lam[pos] = alpha_p
        lam[neg] = alpha_n
    if normalize == "sum":
        lam = lam * valid.sum() / max(lam.sum(), eps)

    norm_p, norm_n = np.linalg.norm(mu_p), np.linalg.norm(mu_n)
    n_side = (max(pos.sum(), 1), max(neg.sum(), 1))
    diagnostics = {
        "gamma_pos": gamma_p,
        "gamma_neg": gamma_n,
        "centroid_norm_pos": norm_p,
        "centroid_norm_neg": norm_n,
        "centroid_cosine": mu_p @ mu_n / max(norm_p * norm_n, eps),
        "frac_above_one_pos": (lam[pos] > 1).sum() / n_side[0],
        "frac_above_one_neg": (lam[neg] > 1).sum() / n_side[1],
        "sign_accuracy": ((dp > 0).sum() + (dn > 0).sum()) / max(pos.sum() + neg.sum(), 1),
    }
    return lam, diagnostics
