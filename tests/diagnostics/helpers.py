"""Shared builders for the diagnostics tests: synthetic coefficient batches, toy rewards."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax.demo import build_char_tokenizer
from delta_jax.diagnostics import CoefficientBatch
from delta_jax.losses import delta_coefficients, grpo_advantages

RESPONSES = [
    "Answer: \\boxed{85}",  # right
    "Answer: \\boxed{84}",
    "Answer: \\boxed{85}",  # right
    "Ans: \\boxed{7} <b>",  # wrong, with HTML-looking text to escape
    "Answer: \\boxed{12}",  # right
    "Answer: \\boxed{13}",
    "Answer: \\boxed{11}",
    "Answer: \\boxed{12}",  # right
]
REWARDS = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def synthetic_batch(seed: int = 0, *, hidden_size: int = 16, step: int = 3) -> CoefficientBatch:
    """Two prompts x four responses with real DelTA coefficients of random hidden states.

    The hidden state of each token is a component shared by all responses (the token's own
    embedding) plus, for digit tokens, a side-specific direction: so the digits are the
    discriminative tokens and the boilerplate is shared.
    """
    tok = build_char_tokenizer()
    ids = [tok.encode(r) for r in RESPONSES]
    width = max(map(len, ids))
    token_ids = np.zeros((len(ids), width), np.int32)
    mask = np.zeros((len(ids), width), bool)
    for i, row in enumerate(ids):
        token_ids[i, : len(row)] = row
        mask[i, : len(row)] = True
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(128, hidden_size))
    direction = rng.normal(size=hidden_size)
    rewards = np.asarray(REWARDS, np.float32)
    sign = np.where(rewards > 0, 1.0, -1.0)[:, None, None]
    digits = np.isin(token_ids, [tok.convert_tokens_to_ids(c) for c in "0123456789"])
    hidden = table[token_ids] + 2.0 * digits[..., None] * sign * direction
    logprobs = -rng.uniform(0.05, 2.0, size=token_ids.shape)
    advantages = grpo_advantages(jnp.asarray(rewards), 4)
    coefficients = delta_coefficients(
        jnp.asarray(hidden, jnp.float32),
        jnp.asarray(logprobs, jnp.float32),
        advantages,
        jnp.asarray(mask),
    )
    return CoefficientBatch.from_arrays(
        tok,
        token_ids=token_ids,
        coefficients=jax.device_get(coefficients),
        mask=mask,
        advantages=jax.device_get(advantages),
        rewards=rewards,
        prompts=["Q: 47+38=?\nA: "] * 4 + ["Q: 5+7=?\nA: "] * 4,
        group_size=4,
        step=step,
    )


def odd_length_reward(prompt: str, response: str, item) -> float:
    """A reward that splits any batch of random responses into two sides."""
    return float(len(response) % 2 == 1)


def write_metrics(run_dir: Path, rows: list[dict]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir
