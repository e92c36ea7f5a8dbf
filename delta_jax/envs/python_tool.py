"""PythonTool: the model calls a Python interpreter; its final answer is scored by the verifier.

A turn is read in one of two call formats:

* ``"tool_call"`` (Qwen3 and other Hermes-style chat models): a
  ``<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>`` JSON call; the
  turn ends at ``</tool_call>``, and the tool's schema (:attr:`PythonTool.tools`) goes to the
  chat template so that the system prompt declares it.
* ``"fenced"`` (base models): a fenced block opened by ```` ```python ```` (or ``py``,
  ``python3``); the turn ends at the closing fence on a line of its own (``"\\n```\\n"``).

A turn that holds a call runs it in the reward sandbox (:func:`delta_jax.rewards.execute`: a
wall-clock and CPU deadline, a memory limit, no network, a scrubbed environment, a read-only
filesystem) and answers with its stdout, then its stderr, then a status line when it did not
exit 0, cut middle-out to ``max_observation_tokens``. Only the turn's first call runs: the
declared stop string ends the turn right after it, so a second call only reaches us from a
caller that does not stop there, and running it blind (before the model saw the first
output) is not what the model asked for. Text inside ``<think>...</think>`` is not read.

Everything the model can get wrong is an observation, never an exception: a call that is not
JSON, names another tool, has no ``code`` string or is never closed, code that crashes, hangs,
exhausts memory or exits non-zero. The model reads what went wrong and may try again.

A turn without a call is the final answer: ``done=True``, ``observation=None`` and
``reward=None``, so that the trainer's reward functions (the math verifier, say) score the
episode as they score single-turn responses; the environment gives no reward of its own.

One ``PythonTool`` per episode (make them with a factory, e.g.
``functools.partial(PythonTool, max_tool_calls=3)``): its only state is the episode's count of
calls. Objects of different episodes share nothing mutable, so a thread pool may step many
episodes at once; the turns of one episode are stepped one after the other.

In a run, ``rollout.environment: python_tool`` builds one per episode from the ``rollout`` keys:

* ``rollout.max_turns``: the caller's limit of model turns per episode, and
  ``max_tool_calls=max_turns - 1`` here (the last turn is left for the answer);
* ``rollout.max_observation_tokens``: ``max_observation_tokens`` (with the run's tokenizer);
* ``rollout.tool_timeout_s``: ``timeout_s``;
* ``rollout.tool_call_format``: ``call_format`` (``auto``: ``tool_call`` with a chat template).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from delta_jax.envs.base import StepResult, truncate_middle
from delta_jax.rewards.code import ExecResult, execute

CallFormat = Literal["tool_call", "fenced"]
_STOP_STRINGS = {"tool_call": ("</tool_call>",), "fenced": ("\n```\n",)}
_OPEN_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A call found in a turn: the code to run, or why the call cannot run."""

    code: str | None
    error: str | None = None  # A short reason: "bad_json", "unknown_tool", ...
    message: str = ""  # What the model is told when the call cannot run.


def _answer_part(turn: str) -> str:
    # Qwen3 thinks before it acts: a call written inside the thinking is not a call.
    return turn.rsplit("</think>", 1)[-1]


def parse_tool_call(turn: str, name: str = "python") -> ToolCall | None:
    """The first ``<tool_call>`` JSON call of `turn`, or None when it has none.

    Accepted: ``{"name": name, "arguments": {"code": str}}``, the arguments also as a JSON
    string (as some models write them).
    """
    text = _answer_part(turn)
    start = text.find("<tool_call>")
    if start < 0:
        return None
    start += len("<tool_call>")
    end = text.find("</tool_call>", start)
    if end < 0:
        return ToolCall(None, "unclosed", "Error: the tool call is not closed by </tool_call>.")
    body = text[start:end]
    try:
        call = json.loads(body, strict=False)  # Raw newlines in code strings are common.
        arguments = call.get("arguments") if isinstance(call, dict) else None
        if isinstance(arguments, str):
            arguments = json.loads(arguments, strict=False)
    except json.JSONDecodeError as e:
        return ToolCall(None, "bad_json", f"Error: the tool call is not valid JSON ({e.msg}).")
    except RecursionError:
        return ToolCall(None, "bad_json", "Error: the tool call is not valid JSON (too deep).")
    if not isinstance(call, dict) or call.get("name") != name:
        got = call.get("name") if isinstance(call, dict) else None
        return ToolCall(
            None, "unknown_tool", f"Error: unknown tool {got!r}; the only tool is {name!r}."
        )
    code = arguments.get("code") if isinstance(arguments, dict) else None
    if not isinstance(code, str):
        return ToolCall(
            None, "missing_code", f"Error: the {name} tool needs a string argument 'code'."
        )
    return ToolCall(code)


def parse_fenced_call(turn: str) -> ToolCall | None:
    """The first fenced python block of `turn` as a call, or None when it has none."""
    text = _answer_part(turn)
    opening = _OPEN_FENCE.search(text)
    if opening is None:
        return None
    # The closing fence starts a line; searching from the opening line's newline lets an
    # empty block close at once.
    end = text.find("\n```", opening.end() - 1)
    if end < 0:
        return ToolCall(None, "unclosed", "Error: the code block is not closed by ```.")
    return ToolCall(text[opening.end() : end + 1])


class PythonTool:
    """A Python interpreter as a tool (see the module docstring); one object per episode.

    Args:
      call_format: ``"tool_call"`` (Qwen3's ``<tool_call>`` JSON) or ``"fenced"`` (a
        ```` ```python ```` block, for base models).
      max_tool_calls: calls the episode may make (malformed ones count); a call beyond it is
        not run and ends the episode (``done=True``, no observation). None: no limit of its
        own (the caller's turn limit still holds).
      max_observation_tokens: an observation longer than this is cut middle-out; counted in
        `tokenizer`'s tokens when one is given, else in characters.
      tokenizer: the policy's tokenizer, for counting observation tokens.
      timeout_s: wall-clock (and CPU-seconds) limit of one call.
      memory_mb: address-space limit of the code.
      name: the tool's name in calls and in its schema.
      prompt_key: the row's field :meth:`reset` returns as the first user turn.
      namespaces: as in :func:`delta_jax.rewards.run_code`.

    Examples:
      >>> env = PythonTool(call_format="fenced")
      >>> env.reset({"prompt": "What is 123 * 456?"})
      'What is 123 * 456?'
      >>> env.step("```python\\nprint(123 * 456)\\n```\\n").observation
      '56088'
      >>> env.step("The answer is \\\\boxed{56088}.").done
      True
    """

    def __init__(
        self,
        *,
        call_format: CallFormat = "tool_call",
        max_tool_calls: int | None = None,
        max_observation_tokens: int = 1024,
        tokenizer: Any = None,
        timeout_s: float = 10.0,
        memory_mb: int = 1024,
        name: str = "python",
        prompt_key: str = "prompt",
        namespaces: bool = True,
    ):
        if call_format not in _STOP_STRINGS:
            raise ValueError(f"call_format must be 'tool_call' or 'fenced', got {call_format!r}")
        if max_tool_calls is not None and max_tool_calls < 0:
            raise ValueError(f"max_tool_calls must be >= 0 or None, got {max_tool_calls}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if memory_mb < 64:
            raise ValueError(f"memory_mb must be >= 64 (Python needs it to start), got {memory_mb}")
        truncate_middle("", max_observation_tokens, tokenizer)  # Checks the limit's room.
        self.call_format = call_format
        self.max_tool_calls = max_tool_calls
        self.max_observation_tokens = max_observation_tokens
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.name = name
        self.prompt_key = prompt_key
        self.namespaces = namespaces
        self.stop_strings: tuple[str, ...] = _STOP_STRINGS[call_format]
        self.tools: tuple[Mapping[str, Any], ...] = (
            (self._schema(),) if call_format == "tool_call" else ()
        )
        self.tool_calls = 0

    def _schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": (
                    "Runs Python 3 code in a fresh sandbox (no network, no files kept) and "
                    "returns what it prints to stdout and stderr. Print every result you need."
                ),
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "Python source."}},
                    "required": ["code"],
                },
            },
        }

    def reset(self, row: Mapping[str, Any]) -> str:
        """Starts an episode: the row's prompt is the first user turn."""
        prompt = row.get(self.prompt_key) if isinstance(row, Mapping) else None
        if not isinstance(prompt, str):
            raise ValueError(f"PythonTool.reset: the row has no text field {self.prompt_key!r}")
        self.tool_calls = 0
        return prompt

    def parse(self, turn: str) -> ToolCall | None:
        """The turn's call in this tool's format, or None (a final answer)."""
        if self.call_format == "tool_call":
            return parse_tool_call(turn, self.name)
        return parse_fenced_call(turn)

    def step(self, turn: str) -> StepResult:
        """Runs the turn's call and answers with its output; a turn without one ends it."""
        call = self.parse(turn)
        if call is None:
            return StepResult(None, True, None, {"tool_call": False, "error": None, "exec": None})
        if self.max_tool_calls is not None and self.tool_calls >= self.max_tool_calls:
            info = {"tool_call": True, "error": "too_many_calls", "exec": None}
            return StepResult(None, True, None, info)
        self.tool_calls += 1
        if call.code is None:
            info = {"tool_call": True, "error": call.error, "exec": None}
            return StepResult(self._fit(call.message), False, None, info)
        result = execute(
            call.code,
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            # Enough bytes for the token budget (a token is rarely over 16 bytes); the cut to
            # max_observation_tokens is ours.
            output_window_bytes=max(4096, 16 * self.max_observation_tokens),
            namespaces=self.namespaces,
        )
        error = None if result.reason == "ok" else result.reason
        info = {"tool_call": True, "error": error, "exec": result}
        return StepResult(self._fit(self._describe(result)), False, None, info)

    def _describe(self, result: ExecResult) -> str:
        """stdout, stderr, then a status line when the code did not exit 0."""
        parts = [text.rstrip("\n") for text in (result.stdout, result.stderr) if text.strip()]
        if result.reason == "sandbox_error":
            # The bootstrap's own stderr says nothing the model can act on.
            return "Error: the sandbox failed to run the code."
        status = {
            "ok": None,
            "timeout": f"[timed out after {self.timeout_s:g} s]",
            "memory_limit": f"[memory limit of {self.memory_mb} MB exceeded]",
            "output_limit": "[output too large: stopped]",
            "wrote_outside_sandbox": "[wrote outside its directory: files removed]",
        }.get(result.reason, f"[exit code {result.exit_code}]")
        if status is not None:
            parts.append(status)
        return "\n".join(parts) if parts else "[no output]"

    def _fit(self, text: str) -> str:
        return truncate_middle(text, self.max_observation_tokens, self.tokenizer)
