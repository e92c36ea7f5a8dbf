"""Float64 NumPy oracles for delta_jax.losses.policy and delta_jax.losses.advantages.

Written independently of the JAX code, from the formulas in the papers: plain Python loops over
tokens and groups, explicit case analysis of the clip regions, gradients with respect to the
log-probs derived by hand (and themselves checked against finite differences in the tests).
The oracle does not model the ±20 log-ratio clamp; tests keep log-ratios well inside it.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

DEFAULT_CLIP = {"ppo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def surrogate_token(x, adv, *, loss_type, eps_low, eps_high, dual_c, tau_pos, tau_neg):
    """Value of the per-token surrogate at log-ratio ``x`` and its derivative w.r.t. ``x``."""
    r = math.exp(x)
    if loss_type == "sapo":
        tau = tau_pos if adv > 0 else tau_neg
        s = _sigmoid(tau * (r - 1.0))
        return -adv * s * 4.0 / tau, -adv * 4.0 * s * (1.0 - s) * r
    if adv > 0:
        if r > 1.0 + eps_high:
            return -adv * (1.0 + eps_high), 0.0
        return -adv * r, -adv * r
    if adv < 0:
        if r < 1.0 - eps_low:
            return -adv * (1.0 - eps_low), 0.0
        if dual_c is not None and r > dual_c:
            return -adv * dual_c, 0.0
        return -adv * r, -adv * r
    return 0.0, 0.0


def kl_token(lp: float, ref: float, estimator: str):
    """KL(π‖π_ref) estimator and its derivative w.r.t. ``lp``."""
    d = ref - lp
    if estimator == "k1":
        return -d, 1.0
    if estimator == "k2":
        return 0.5 * d * d, -d
    return math.exp(d) - d - 1.0, 1.0 - math.exp(d)


def policy_loss_ref(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    *,
    coefficients=None,
    loss_type="ppo",
    clip_eps_low=None,
    clip_eps_high=None,
    dual_clip_c=10.0,
    aggregation="token-mean",
    normalizer=None,
    max_response_length=None,
    sapo_tau_pos=1.0,
    sapo_tau_neg=1.05,
    token_mask=None,
    rollout_logprobs=None,
    tis_cap=None,
    ref_logprobs=None,
    kl_coef=0.0,
    kl_estimator="k3",
    entropy=None,
    entropy_coef=0.0,
):
    """Returns ``(loss, d loss / d logprobs, d loss / d entropy or None, metrics)``."""
    lp = np.asarray(logprobs, np.float64)
    old = np.asarray(old_logprobs, np.float64)
    m = np.asarray(mask) != 0
    n_rows, n_cols = lp.shape
    adv = np.asarray(advantages, np.float64)
    if adv.ndim == 1:
        adv = np.repeat(adv[:, None], n_cols, axis=1)
    default = DEFAULT_CLIP.get(loss_type, (0.0, 0.0))
    eps_low = default[0] if clip_eps_low is None else clip_eps_low
    eps_high = default[1] if clip_eps_high is None else clip_eps_high
    dual_c = None if loss_type == "sapo" else dual_clip_c

    lengths = [int(m[i].sum()) for i in range(n_rows)]
    n_valid = sum(lengths)
    n_seqs = sum(1 for n in lengths if n > 0)
    if aggregation == "token-mean":
        denom = n_valid if normalizer is None else normalizer
    else:
        denom = n_seqs if normalizer is None else normalizer
    denom = denom if denom > 0 else 1.0
    const = n_cols if max_response_length is None else max_response_length

    def scale(i):
        if aggregation == "token-mean" or aggregation == "seq-mean-token-sum":
            return 1.0 / denom
        if aggregation == "seq-mean-token-mean":
            return 1.0 / (lengths[i] * denom)
        return 1.0 / (const * denom)

    loss = 0.0
    pg = 0.0
    grad = np.zeros_like(lp)
    grad_ent = None if entropy is None else np.zeros_like(lp)
    rec = {
        k: [] for k in ("ratio", "upper", "lower", "dual", "akl", "w", "cut", "kl", "ent", "coef")
    }
    for i in range(n_rows):
        if lengths[i] == 0:
            continue
        seq_x = sum(lp[i, t] - old[i, t] for t in range(n_cols) if m[i, t]) / lengths[i]
        for t in range(n_cols):
            if not m[i, t]:
                continue
            a = adv[i, t] * (1.0 if coefficients is None else float(coefficients[i, t]))
            tok_x = lp[i, t] - old[i, t]
            x = seq_x if loss_type == "gspo" else tok_x
            value, dvalue = surrogate_token(
                x,
                a,
                loss_type=loss_type,
                eps_low=eps_low,
                eps_high=eps_high,
                dual_c=dual_c,
                tau_pos=sapo_tau_pos,
                tau_neg=sapo_tau_neg,
            )
            r = math.exp(x)
            rec["ratio"].append(r)
            rec["upper"].append(float(a > 0 and r > 1 + eps_high))
            rec["lower"].append(float(a < 0 and r < 1 - eps_low))
            rec["dual"].append(float(dual_c is not None and a < 0 and r > dual_c))
            rec["akl"].append(math.exp(tok_x) - 1.0 - tok_x)
            if coefficients is not None:
                rec["coef"].append(float(coefficients[i, t]))
            if rollout_logprobs is not None:
                w = math.exp(old[i, t] - float(rollout_logprobs[i, t]))
                rec["cut"].append(float(tis_cap is not None and w > tis_cap))
                w = w if tis_cap is None else min(w, tis_cap)
                rec["w"].append(w)
                value, dvalue = value * w, dvalue * w
            keep = 1.0 if token_mask is None else float(token_mask[i, t] != 0)
            s = scale(i) * keep
            total, dtotal = value, dvalue
            if ref_logprobs is not None:
                k, dk = kl_token(lp[i, t], float(ref_logprobs[i, t]), kl_estimator)
                rec["kl"].append(k)
                total, dtotal = total + kl_coef * k, dtotal + kl_coef * dk
            if entropy is not None:
                h = float(entropy[i, t])
                rec["ent"].append(h)
                total -= entropy_coef * h
                grad_ent[i, t] = -entropy_coef * s
            pg += s * value
            loss += s * total
            grad[i, t] = s * dtotal

    def mean(xs):
        return float(np.mean(xs)) if xs else 0.0

    metrics = {
        "pg_loss": pg,
        "approx_kl": mean(rec["akl"]),
        "ratio_mean": mean(rec["ratio"]),
        "ratio_min": min(rec["ratio"], default=0.0),
        "ratio_max": max(rec["ratio"], default=0.0),
    }
    if loss_type != "sapo":
        metrics["clip_frac_upper"] = mean(rec["upper"])
        metrics["clip_frac_lower"] = mean(rec["lower"])
        if dual_c is not None:
            metrics["dual_clip_frac"] = mean(rec["dual"])
    if coefficients is not None:
        c = np.array(rec["coef"])
        metrics.update(
            coef_mean=float(c.mean()), coef_min=c.min(), coef_max=c.max(), coef_std=c.std()
        )
    if rollout_logprobs is not None:
        metrics["tis_weight_mean"] = mean(rec["w"])
        metrics["tis_weight_max"] = max(rec["w"], default=0.0)
        if tis_cap is not None:
            metrics["tis_truncated_fraction"] = mean(rec["cut"])
    if ref_logprobs is not None:
        metrics["kl"] = mean(rec["kl"])
    if entropy is not None:
        metrics["entropy"] = mean(rec["ent"])
    return loss, grad, grad_ent, metrics


def forking_mask_ref(entropy, mask, top_q):
    """Top ``ceil(q n)`` valid tokens by entropy, ties to the earlier row-major position."""
    ent = np.asarray(entropy, np.float64)
    m = np.asarray(mask) != 0
    cells = [(-ent[i, t], i * ent.shape[1] + t, i, t) for i, t in zip(*np.nonzero(m), strict=True)]
    cells.sort()
    k = math.ceil(Fraction(str(top_q)) * len(cells))
    out = np.zeros(ent.shape, bool)
    for _, _, i, t in cells[:k]:
        out[i, t] = True
    return out


# --- advantages -------------------------------------------------------------------------------


def _group_lists(rewards, group_size):
    r = [float(x) for x in rewards]
    return [r[g : g + group_size] for g in range(0, len(r), group_size)]


def _std(xs, ddof):
    mu = sum(xs) / len(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - ddof))


def grpo_ref(rewards, group_size, eps=1e-6, ddof=1):
    out = []
    for g in _group_lists(rewards, group_size):
        mu, sd = sum(g) / len(g), _std(g, ddof)
        out += [(x - mu) / (sd + eps) for x in g]
    return np.array(out)


def dr_grpo_ref(rewards, group_size):
    return np.array([x - sum(g) / len(g) for g in _group_lists(rewards, group_size) for x in g])


def rloo_ref(rewards, group_size):
    out = []
    for g in _group_lists(rewards, group_size):
        for i, x in enumerate(g):
            others = [y for j, y in enumerate(g) if j != i]
            out.append(x - sum(others) / len(others))
    return np.array(out)


def whiten_ref(values, weights, eps):
    """Weighted whitening; an item of weight w counts as w copies (Bessel: n − 1)."""
    n = sum(weights)
    mu = sum(w * v for v, w in zip(values, weights, strict=True)) / n if n > 0 else 0.0
    var = sum(w * (v - mu) ** 2 for v, w in zip(values, weights, strict=True)) / max(n - 1, 1)
    return np.array([(v - mu) / math.sqrt(var + eps) for v in values])


def reinforce_pp_ref(rewards, group_size, lengths=None, eps=1e-8):
    a = dr_grpo_ref(rewards, group_size)
    weights = [1.0] * len(a) if lengths is None else [float(n) for n in lengths]
    return whiten_ref(list(a), weights, eps)


def informative_ref(rewards, group_size):
    return np.array([len(set(g)) > 1 for g in _group_lists(rewards, group_size)])


def overlong_ref(lengths, max_len, buffer, factor):
    out = []
    for n in lengths:
        if n <= max_len - buffer:
            out.append(0.0)
        elif n <= max_len:
            out.append(-(n - (max_len - buffer)) / buffer * factor)
        else:
            out.append(-factor)
    return np.array(out)
