r"""Math rewards: the response's last ``\boxed{...}`` against the data set's answer, by math-verify.

Policy (what a rollout must do to earn 1.0):

* The prediction is the content of the **last** ``\boxed{...}`` in the response (braces
  balanced). Earlier boxed answers are drafts: ``\boxed{3} ... so \boxed{5}`` answers 5.
* A response with no complete ``\boxed{...}`` (none, empty, or unbalanced braces) scores 0.0
  with reason ``"no_answer"``; math-verify's anchor-free extraction ("the answer is 5") is not
  used, so the format the prompt asks for is part of the task.
* The gold ``answer`` is plain LaTeX without ``$`` (``\frac{1}{2}``, ``(1, 2]``, ``\{1,2\}``);
  surrounding ``$`` and an enclosing ``\boxed{}`` are tolerated. Both sides go through the same
  math-verify LaTeX parser (wrapped as ``\boxed{...}``), then :func:`math_verify.verify`:
  symbolic equivalence, numbers to 6 decimals, intervals and sets compared as sets, units and
  ``\text{}`` wrappers normalised away, ``x = 5`` compared by its right-hand side.

math-verify's own timeouts use ``signal.alarm``, which only works in the main thread; here they
are used when called from the main thread and disabled elsewhere. The real guard against an
input that hangs the verifier (``\boxed{9^{9^{9^{9}}}}`` hangs in big-integer C code that no
signal interrupts) is the parent-side deadline of :class:`~delta_jax.rewards.RewardScorer`,
which kills the worker.
"""

from __future__ import annotations

import threading

from math_verify import LatexExtractionConfig, parse, verify

_BOX = "\\boxed{"
# Boxed-only extraction: the text we hand over is exactly one \boxed{...}.
_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0),)
_MV_TIMEOUT_S = 5


def extract_last_boxed(text: str) -> str | None:
    r"""Content of the last complete ``\boxed{...}`` of `text`, or None.

    Examples:
      >>> extract_last_boxed(r"first \boxed{3}, then \boxed{\frac{1}{2}}")
      '\\frac{1}{2}'
    """
    start = text.rfind(_BOX)
    if start < 0:
        return None
    open_at = start + len(_BOX) - 1
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i].strip() or None
    # Unbalanced last box: an earlier complete one is not the final answer either.
    return None


def _gold_latex(answer: str) -> str:
    answer = answer.strip()
    if len(answer) >= 2 and answer[0] == "$" and answer[-1] == "$":
        answer = answer.strip("$").strip()
    if "\\boxed" in answer:
        answer = extract_last_boxed(answer) or answer
    return answer


def _parse(latex: str, timeout: int | None):
    return parse(
        "\\boxed{" + latex + "}",
        extraction_config=list(_EXTRACTION),
        parsing_timeout=timeout,
    )


def score_math(response: str, answer: str) -> tuple[float, str]:
    r"""Math reward and its reason.

    Args:
      response: the model's full response text.
      answer: the data set's final answer, plain LaTeX.

    Returns:
      ``(1.0, "correct")``, ``(0.0, "wrong")``, ``(0.0, "no_answer")`` (no complete
      ``\boxed{}``), ``(0.0, "unparsable")`` (the boxed content is not parsable) or
      ``(0.0, "bad_gold")`` (the gold answer is not parsable).

    Examples:
      >>> score_math(r"so the answer is \boxed{0.5}", r"\frac{1}{2}")
      (1.0, 'correct')
    """
    if not isinstance(response, str) or not isinstance(answer, str):
        raise ValueError(
            f"response and answer must be str, got {type(response).__name__} and "
            f"{type(answer).__name__}"
        )
    pred_latex = extract_last_boxed(response)
    if pred_latex is None:
        return 0.0, "no_answer"
    timeout = _MV_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = _parse(_gold_latex(answer), timeout)
    if not gold:
        return 0.0, "bad_gold"
    pred = _parse(pred_latex, timeout)
    if not pred:
        return 0.0, "unparsable"
    ok = verify(gold, pred, timeout_seconds=timeout)
    return (1.0, "correct") if ok else (0.0, "wrong")


def math_reward(response: str, answer: str) -> float:
    r"""1.0 when the response's last ``\boxed{}`` equals `answer` mathematically, else 0.0.

    See the module docstring for the extraction policy; :func:`score_math` also gives the reason.

    Examples:
      >>> math_reward(r"\boxed{\dfrac{1}{2}}", "0.5")
      1.0
    """
    return score_math(response, answer)[0]
