"""Multi-turn environments and tools, run beside the rollout engine (``reset`` / ``step``).

* :class:`Environment`: the protocol. ``reset(row) -> str`` gives the first user turn,
  ``step(turn) -> StepResult(observation, done, reward)`` answers each model turn, and
  ``stop_strings`` end a model turn.
* :class:`PythonTool`: the built-in environment. The model calls a Python interpreter (Qwen3's
  ``<tool_call>`` JSON, or a fenced block for base models) that runs in the reward sandbox;
  its final answer is scored by the trainer's verifier.
* :func:`render_observation`: an observation as the next text of the context (a ``tool``
  message in the tokenizer's chat template, or a plain ```` ```output ```` block), and
  :func:`truncate_middle`, which cuts a long observation to a token budget.
"""

from delta_jax.envs.base import (
    PLAIN_OBSERVATION,
    Environment,
    StepResult,
    observation_length,
    render_observation,
    truncate_middle,
)
from delta_jax.envs.python_tool import PythonTool, ToolCall, parse_fenced_call, parse_tool_call

__all__ = [
    "PLAIN_OBSERVATION",
    "Environment",
    "PythonTool",
    "StepResult",
    "ToolCall",
    "observation_length",
    "parse_fenced_call",
    "parse_tool_call",
    "render_observation",
    "truncate_middle",
]
