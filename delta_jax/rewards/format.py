r"""Format rewards: does the response have the shape the prompt asked for?

Default rule: exactly one complete ``\boxed{...}`` with non-empty content, so a response that
hedges with several boxed answers, or none, scores 0. With ``pattern``, the rule is instead a
regular expression that must match the whole response (``re.fullmatch`` with ``re.DOTALL``,
leading and trailing whitespace ignored), e.g. ``r"<think>.*</think>.*\\boxed\{.+\}.*"``.
"""

from __future__ import annotations

import re

_BOXED = "\\boxed{"


def _complete_boxes(text: str) -> tuple[int, bool]:
    """Number of ``\\boxed{`` openings, and whether all are balanced and non-empty."""
    count, ok, pos = 0, True, text.find(_BOXED)
    while pos >= 0:
        count += 1
        depth, i = 0, pos + len(_BOXED) - 1
        end = -1
        while i < len(text):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    end = i
                    break
            i += 1
        if end < 0 or not text[pos + len(_BOXED) : end].strip():
            ok = False
            break
        pos = text.find(_BOXED, end)
    return count, ok


def score_format(response: str, *, pattern: str | None = None) -> tuple[float, str]:
    r"""Format reward and its reason.

    Args:
      response: the model's full response text.
      pattern: optional regular expression the whole (stripped) response must match; when
        None, the rule is "exactly one complete, non-empty ``\boxed{}``".

    Returns:
      ``(1.0, "format_ok")``, or ``(0.0, reason)`` with reason ``"no_boxed"``,
      ``"multiple_boxed"``, ``"malformed_boxed"`` (unbalanced or empty) or
      ``"pattern_mismatch"``.

    Examples:
      >>> score_format(r"so \boxed{4}")
      (1.0, 'format_ok')
    """
    if not isinstance(response, str):
        raise ValueError(f"response must be str, got {type(response).__name__}")
    if pattern is not None:
        if re.fullmatch(pattern, response.strip(), flags=re.DOTALL):
            return 1.0, "format_ok"
        return 0.0, "pattern_mismatch"
    count, ok = _complete_boxes(response)
    if count == 0:
        return 0.0, "no_boxed"
    if not ok:
        return 0.0, "malformed_boxed"
    if count > 1:
        return 0.0, "multiple_boxed"
    return 1.0, "format_ok"


def format_reward(response: str, *, pattern: str | None = None) -> float:
    r"""1.0 when the response is well formatted (see :func:`score_format`), else 0.0.

    Examples:
      >>> format_reward(r"\boxed{1} or \boxed{2}")
      0.0
    """
    return score_format(response, pattern=pattern)[0]
