r"""Evaluation metrics: from scored samples to avg@k, unbiased pass@k, maj@k and weighted averages.

NumPy and the standard library only; the sampling and scoring that make a :class:`SampleScores`
are :mod:`delta_jax.eval`'s, which re-exports everything here.

For a problem with ``n`` samples of which ``c`` are correct (reward 1):

* ``avg@n``  — the mean reward over all samples of all problems (the paper's metric, DELTA_SPEC
  §7: avg@16 at temperature 1.0, top-p 0.7);
* ``pass@k`` — the unbiased estimator ``1 − C(n − c, k) / C(n, k)`` of the chance that at least
  one of ``k`` samples drawn without replacement from the ``n`` is correct, averaged over
  problems (``k <= n``);
* ``maj@n``  — 1 when the most frequent final answer among the ``n`` samples is correct (math
  only). Answers are the last ``\boxed{}`` of each response; every correct sample votes for the
  gold answer (the verifier has already found them equal to it, whatever their spelling), wrong
  ones vote for their answer string after light normalisation (spaces, ``\left``/``\right``,
  ``\dfrac``...). Samples without an answer do not vote; a tie goes to the answer seen first.

:func:`weighted_average` weights each benchmark by its number of problems, as the paper's "Avg"
column (30 questions per set, 33 for HMMT26-Feb).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from math import comb

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``c`` correct out of ``n`` samples.

    ``pass@k = 1 − C(n − c, k) / C(n, k)``: one minus the chance that ``k`` samples drawn
    without replacement from the ``n`` are all wrong.

    Args:
      n: samples drawn, ``n >= 1``.
      c: correct samples, ``0 <= c <= n``.
      k: the k of pass@k, ``1 <= k <= n``.

    Returns:
      A float in ``[0, 1]``.

    Examples:
      >>> pass_at_k(4, 1, 2)
      0.5
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


_LATEX_NOISE = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\:|\\ |\$|\s+")


def normalize_answer(answer: str) -> str:
    r"""A light canonical spelling of a final answer, for counting votes.

    Removes whitespace, ``$``, ``\left``/``\right`` and spacing commands, maps ``\dfrac`` and
    ``\tfrac`` to ``\frac`` and drops a trailing period. Equivalent answers spelled differently
    (``0.5`` vs ``\frac12``) still count apart; correct ones are merged by :func:`majority_correct`.

    Examples:
      >>> normalize_answer(r"\left( 1, \dfrac{1}{2} \right).")
      '(1,\\frac{1}{2})'
    """
    out = _LATEX_NOISE.sub("", answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac"))
    return out.rstrip(".")


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """Whether the majority vote over one problem's samples picks a correct answer.

    Args:
      answers: ``[n]`` extracted final answers (None: the sample has none and does not vote).
      correct: ``[n]`` whether each sample was scored correct.

    Returns:
      True when the gold answer gets the most votes (ties: the answer seen first wins).
    """
    if len(answers) != len(correct):
        raise ValueError(f"answers and correct differ in length: {len(answers)} vs {len(correct)}")
    votes: Counter = Counter()
    first: dict[str, int] = {}
    for i, (ans, ok) in enumerate(zip(answers, correct, strict=True)):
        if ok:
            key = "\x00gold"  # cannot collide with a normalised answer string
        elif ans is None:
            continue
        else:
            key = normalize_answer(ans)
        votes[key] += 1
        first.setdefault(key, i)
    if not votes:
        return False
    winner = min(votes, key=lambda key: (-votes[key], first[key]))
    return winner == "\x00gold"


@dataclasses.dataclass(frozen=True)
class SampleScores:
    """Scored samples of ``P`` problems, ``k`` each (problem-major).

    Attributes:
      rewards: float64 ``[P, k]``.
      answers: ``P`` lists of ``k`` extracted final answers (None where there is none).
      lengths: int ``[P, k]`` response lengths in tokens.
      reasons: reason counts of the scorer (``"correct"``, ``"no_answer"``, ``"timeout"``...).
      texts: the ``P · k`` decoded responses.
    """

    rewards: np.ndarray
    answers: list[list[str | None]]
    lengths: np.ndarray
    reasons: dict[str, int]
    texts: list[str]


def summarize(
    scores: SampleScores,
    *,
    pass_ks: Sequence[int] | None = None,
    majority: bool = True,
    prefix: str = "",
) -> dict[str, float]:
    """avg@k, pass@k for each of ``pass_ks`` (default: k), maj@k and the mean response length.

    A sample counts as correct for pass@k and maj@k when its reward is at least 1.
    """
    p, k = scores.rewards.shape
    correct = (scores.rewards >= 1.0).sum(axis=1)
    out = {f"{prefix}avg@{k}": float(scores.rewards.mean())}
    for kk in pass_ks or (k,):
        out[f"{prefix}pass@{kk}"] = float(np.mean([pass_at_k(k, int(c), kk) for c in correct]))
    if majority:
        votes = [
            majority_correct(scores.answers[i], list(scores.rewards[i] >= 1.0)) for i in range(p)
        ]
        out[f"{prefix}maj@{k}"] = float(np.mean(votes))
    out[f"{prefix}response_length_mean"] = float(scores.lengths.mean())
    return out


def default_pass_ks(k: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to ``k``, and ``k`` itself."""
    ks = {1 << i for i in range(k.bit_length()) if 1 << i <= k}
    return tuple(sorted(ks | {k}))


def weighted_average(scores: Mapping[str, float], counts: Mapping[str, int]) -> float:
    """``Σ_b counts[b] · scores[b] / Σ_b counts[b]`` over the benchmarks ``b`` of ``scores``.

    Examples:
      >>> weighted_average({"a": 10.0, "b": 20.0}, {"a": 30, "b": 10})
      12.5
    """
    missing = sorted(set(scores) - set(counts))
    if missing or not scores:
        raise ValueError(
            f"need a count for every benchmark; scores {sorted(scores)}, counts {sorted(counts)}"
        )
    total = sum(counts[b] for b in scores)
    if total <= 0:
        raise ValueError(f"counts must add up to > 0, got {dict(counts)}")
    return sum(counts[b] * float(scores[b]) for b in scores) / total
