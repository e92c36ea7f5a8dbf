"""Float64 NumPy oracles shared by the sampling tests (independent of the package code)."""

import jax
import numpy as np
from flax import nnx
from scipy import stats

from delta_jax.models import ModelConfig, Transformer


def truncated_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Exact behaviour distribution over a 1-D ``logits`` vector, in float64.

    Order: temperature, top-k (ties with the k-th value kept), top-p on the renormalised top-k
    survivors (keep while the mass before a token is < top_p; ties with the last kept value kept),
    min-p relative to the most likely token.
    """
    z = np.asarray(logits, np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    keep = np.ones(z.size, bool)
    if top_k:
        kth = np.sort(z)[::-1][min(top_k, z.size) - 1]
        keep &= z >= kth
    if top_p < 1.0:
        renorm = np.where(keep, probs, 0.0)
        renorm /= renorm.sum()
        mass = 0.0
        cutoff = np.inf
        for i in np.argsort(-z, kind="stable"):
            if not keep[i] or mass >= top_p:
                break
            cutoff = z[i]
            mass += renorm[i]
        keep &= z >= cutoff
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max()
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def truncated_logprobs(logits, **kwargs):
    """Row-wise log of :func:`truncated_distribution` for ``[..., V]`` logits (-inf off support)."""
    logits = np.asarray(logits, np.float64)
    flat = logits.reshape(-1, logits.shape[-1])
    with np.errstate(divide="ignore"):
        out = np.log(np.stack([truncated_distribution(row, **kwargs) for row in flat]))
    return out.reshape(logits.shape)


def log_softmax(x, axis=-1):
    x = np.asarray(x, np.float64)
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def chisquare_pvalue(tokens, probs):
    """Chi-square goodness-of-fit p-value of sampled ``tokens`` against ``probs`` ([V]).

    Draws outside the support of ``probs`` are impossible under it, so they give p = 0.
    """
    tokens = np.asarray(tokens)
    counts = np.bincount(tokens, minlength=probs.size)
    support = probs > 0
    if counts[~support].sum():
        return 0.0
    return stats.chisquare(counts[support], probs[support] * tokens.size).pvalue


def peaked_model():
    """The tiny Qwen3 of the sampler tests, its matrices scaled x4 so that the next-token
    distributions are far from uniform (sampling tests then have power)."""
    m = Transformer(ModelConfig.tiny("qwen3", vocab_size=96), rngs=nnx.Rngs(3))
    _, params = nnx.split(m, nnx.Param)
    nnx.update(m, jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, params))
    return m
