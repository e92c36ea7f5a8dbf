"""Verifiable rewards: math (math-verify), sandboxed code execution, format, reasoning-gym
tasks' own verifiers, custom functions.

:class:`RewardSet` sums several named functions with weights (callables in the batched TRL /
Tunix convention included); :class:`RewardScorer` scores a whole rollout batch in a process pool
with per-item deadlines and crash isolation; the functions below are the per-item rewards it
runs. :func:`execute` runs code once in the code sandbox for a tool call
(:class:`delta_jax.envs.PythonTool`). The DAPO overlong
penalty lives with the advantages (:func:`delta_jax.losses.advantages.overlong_penalty`).
"""

from delta_jax.rewards.batch import RewardBatch, RewardScorer, concat_batches
from delta_jax.rewards.code import CodeResult, ExecResult, execute, extract_code, run_code
from delta_jax.rewards.custom import load_reward_fn
from delta_jax.rewards.format import format_reward, score_format
from delta_jax.rewards.functions import RewardSet, reward_name
from delta_jax.rewards.gym import extract_gym_answer, score_gym
from delta_jax.rewards.math import extract_last_boxed, math_reward, score_math
from delta_jax.rewards.noise import FlippedRewards

__all__ = [
    "CodeResult",
    "ExecResult",
    "FlippedRewards",
    "RewardBatch",
    "RewardScorer",
    "RewardSet",
    "execute",
    "extract_code",
    "extract_gym_answer",
    "extract_last_boxed",
    "format_reward",
    "load_reward_fn",
    "math_reward",
    "reward_name",
    "run_code",
    "score_format",
    "score_gym",
    "concat_batches",
    "score_math",
]
