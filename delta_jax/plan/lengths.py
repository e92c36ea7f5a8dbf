"""Response-length distributions for the planner's rollout bounds (``delta-jax plan --lengths``).

A distribution draws response lengths in ``[1, cap]`` tokens (``cap``: ``rollout.max_new_tokens``).
``--lengths`` takes one of:

* ``lognormal:mean=M,sigma=S`` -- ``min(cap, ceil(X))`` with ``ln X ~ Normal(mu, S^2)``, ``mu``
  chosen so that the *capped* lengths have mean ``M`` (what a run's ``response_length_mean``
  reports); ``lognormal:median=M,sigma=S`` sets ``mu = ln M`` instead;
* ``quantiles:0.5=900,0.9=6000,0.99=20480`` -- the inverse CDF through those points, linear
  between them and flat outside them;
* ``list:300,1200,20480`` -- each listed length equally likely;
* the path of a run's ``metrics.jsonl`` -- per step, the response-length quantiles the trainer
  records (``response_length_min``, ``_p10``, ``_p25``, ``_p50``, ``_p75``, ``_p90``, ``_p99``,
  ``response_length_max``): each step's inverse CDF through them, a step drawn uniformly.

With ``E[min(X, c)] = e^{mu + S^2/2} Phi((ln c - mu - S^2) / S) + c (1 - Phi((ln c - mu) / S))``
increasing in ``mu``, the mean form solves for ``mu`` by bisection.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from delta_jax.rl.rollout import LENGTH_PERCENTILES

# The quantiles the trainer records per step (rl.rollout), by metric name; 0 and 1: min and max.
METRIC_QUANTILES = {
    "response_length_min": 0.0,
    **{f"response_length_p{q}": q / 100 for q in LENGTH_PERCENTILES},
    "response_length_max": 1.0,
}


def _phi(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def capped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    """``E[min(X, cap)]`` for ``ln X ~ Normal(mu, sigma^2)``."""
    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma**2 / 2) * _phi(z - sigma) + cap * (1 - _phi(z))


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Response lengths in ``[1, cap]``: a capped log-normal (``mu``, ``sigma``), or inverse CDFs
    (``tables``: ``(quantiles, lengths)`` pairs, one drawn uniformly per sequence), or a list of
    lengths (``values``, each equally likely). ``source`` says what was given."""

    cap: int
    source: str
    mu: float = 0.0
    sigma: float = 0.0
    tables: tuple[tuple[tuple[float, ...], tuple[float, ...]], ...] = ()
    values: tuple[int, ...] = ()

    def sample(self, rng: np.random.Generator, shape) -> np.ndarray:
        """Lengths of ``shape`` (int64, each in ``[1, cap]``)."""
        if self.values:
            drawn = rng.choice(np.asarray(self.values, np.float64), size=shape)
        elif self.tables:
            which = rng.integers(len(self.tables), size=shape)
            u = rng.random(shape)
            drawn = np.empty(shape)
            for i, (qs, ls) in enumerate(self.tables):
                drawn[which == i] = np.interp(u[which == i], qs, ls)
        else:
            drawn = np.exp(rng.normal(self.mu, self.sigma, size=shape))
        return np.clip(np.ceil(drawn), 1, self.cap).astype(np.int64)

    @property
    def mean(self) -> float:
        """The mean length (before rounding up to whole tokens)."""
        if self.values:
            return float(np.mean(self.values))
        if self.tables:
            return float(np.mean([_table_mean(qs, ls) for qs, ls in self.tables]))
        return capped_lognormal_mean(self.mu, self.sigma, self.cap)


def _table_mean(qs, ls) -> float:
    """The mean of the inverse CDF through ``(qs, ls)``, flat outside ``[qs[0], qs[-1]]``."""
    q = np.concatenate([[0.0], qs, [1.0]])
    v = np.concatenate([[ls[0]], ls, [ls[-1]]])
    return float(np.sum((q[1:] - q[:-1]) * (v[1:] + v[:-1]) / 2))


def _fields(body: str, spec: str) -> dict[str, float]:
    fields = {}
    for part in body.split(","):
        key, eq, value = part.partition("=")
        try:
            fields[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--lengths {spec}: {part!r} is not key=number") from None
        if not eq:
            raise ValueError(f"--lengths {spec}: {part!r} is not key=number")
    return fields


def lognormal(spec: str, body: str, cap: int) -> Lengths:
    """``lognormal:mean=M,sigma=S`` or ``lognormal:median=M,sigma=S`` (see the module)."""
    fields = _fields(body, spec)
    sigma = fields.pop("sigma", None)
    if sigma is None or len(fields) != 1 or next(iter(fields)) not in ("mean", "median"):
        raise ValueError(f"--lengths {spec}: give mean=M,sigma=S or median=M,sigma=S")
    if not sigma > 0:
        raise ValueError(f"--lengths {spec}: sigma={sigma} must be > 0")
    ((kind, m),) = fields.items()
    if not 0 < m < cap:
        raise ValueError(
            f"--lengths {spec}: {kind}={m} must be in (0, rollout.max_new_tokens={cap})"
        )
    if kind == "median":
        return Lengths(cap, spec, mu=math.log(m), sigma=sigma)
    lo, hi = math.log(m) - 1, math.log(m)  # bracket mu: the capped mean grows with it
    while capped_lognormal_mean(lo, sigma, cap) > m:
        lo -= 1 + sigma**2
    while capped_lognormal_mean(hi, sigma, cap) < m:
        hi += 1 + sigma
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if capped_lognormal_mean(mid, sigma, cap) < m else (lo, mid)
    return Lengths(cap, spec, mu=(lo + hi) / 2, sigma=sigma)


def quantiles(spec: str, body: str, cap: int) -> Lengths:
    """``quantiles:q=L,...``: the inverse CDF through the points (see the module)."""
    points = sorted(_fields(body, spec).items(), key=lambda kv: float(kv[0]))
    try:
        qs = [float(q) for q, _ in points]
    except ValueError:
        raise ValueError(f"--lengths {spec}: quantiles are numbers in [0, 1]") from None
    ls = [length for _, length in points]
    if not all(0 <= q <= 1 for q in qs) or not all(1 <= x <= cap for x in ls):
        raise ValueError(
            f"--lengths {spec}: quantiles must be in [0, 1] and lengths in "
            f"[1, rollout.max_new_tokens={cap}]"
        )
    if any(b < a for a, b in zip(ls, ls[1:], strict=False)):
        raise ValueError(f"--lengths {spec}: lengths must not decrease as the quantile grows")
    return Lengths(cap, spec, tables=((tuple(qs), tuple(ls)),))


def listed(spec: str, body: str, cap: int) -> Lengths:
    """``list:L1,L2,...``: each length equally likely."""
    try:
        values = tuple(int(x) for x in body.split(","))
    except ValueError:
        raise ValueError(f"--lengths {spec}: give whole token counts, e.g. list:300,1200") from None
    if not all(1 <= x <= cap for x in values):
        raise ValueError(f"--lengths {spec}: lengths must be in [1, rollout.max_new_tokens={cap}]")
    return Lengths(cap, spec, values=values)


def from_metrics(path: Path, cap: int) -> Lengths:
    """Per step of a run's ``metrics.jsonl``, the recorded length quantiles' inverse CDF."""
    tables = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line
        if not isinstance(row, dict) or not all(k in row for k in METRIC_QUANTILES):
            continue
        ls = [min(float(row[k]), cap) for k in METRIC_QUANTILES]
        tables.append((tuple(METRIC_QUANTILES.values()), tuple(ls)))
    if not tables:
        raise ValueError(
            f"--lengths {path}: no step records the response-length quantiles "
            f"({', '.join(METRIC_QUANTILES)}); runs record them from this release on"
        )
    return Lengths(cap, f"{path} ({len(tables)} steps)", tables=tuple(tables))


FORMS = {"lognormal": lognormal, "quantiles": quantiles, "list": listed}


def parse_lengths(spec: str, cap: int) -> Lengths:
    """The distribution ``spec`` names (see the module), lengths capped at ``cap``."""
    form, colon, body = spec.partition(":")
    if colon and form in FORMS:
        return FORMS[form](spec, body, cap)
    path = Path(spec)
    if path.is_file():
        return from_metrics(path, cap)
    raise ValueError(
        f"--lengths {spec}: not a file, nor lognormal:mean=M,sigma=S, "
        "lognormal:median=M,sigma=S, quantiles:q=L,... or list:L,..."
    )
