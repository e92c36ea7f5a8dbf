"""From prompts to a scored, padded rollout batch (host side of one RL step).

Sampling -> decoding -> rewards (+ DAPO overlong penalty) -> group advantages, with DAPO's
dynamic sampling: groups whose rewards are all equal carry no learning signal, so further rounds
of prompts are sampled until the batch holds ``prompts_per_step`` informative groups or the round
limit is hit (then the batch is filled with uninformative groups, counted, so its shape — and the
compiled update — never changes).

All arrays leave here padded to fixed training shapes (prompt ``P``, response ``G``) so the
jitted update compiles once per run.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax.data import PromptRecord
from delta_jax.losses import advantages as adv_lib


@dataclasses.dataclass
class Rollout:
    """A scored rollout batch of ``B = prompts x n`` rows (prompt-major)."""

    input_ids: np.ndarray  # int32[B, P + G]: left-padded prompt ++ right-padded response
    attention_mask: np.ndarray  # bool[B, P + G]
    response_mask: np.ndarray  # bool[B, G]
    rollout_logprobs: np.ndarray  # f32[B, G]: sampler's untruncated log-probs
    rewards: np.ndarray  # f32[B] (overlong penalty included)
    advantages: np.ndarray  # f32[B]
    lengths: np.ndarray  # int32[B]
    hidden: jax.Array | None  # [B, G, H] sampler hidden states, when asked for
    records: list[PromptRecord]  # one per row
    responses: list[str]
    response_tokens: list[list[int]]
    stats: dict[str, float]


ADVANTAGE_FNS: dict[str, Callable] = {
    "grpo": adv_lib.grpo_advantages,
    "dr_grpo": adv_lib.dr_grpo_advantages,
    "rloo": adv_lib.rloo_advantages,
    "reinforce_pp": adv_lib.reinforce_pp_baseline_advantages,
}


def pad_rows(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    prompt_len: int,
    gen_len: int,
    pad_id: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Left-pad prompts to ``prompt_len`` and right-pad responses to ``gen_len``."""
    rows = len(prompts)
    ids = np.full((rows, prompt_len + gen_len), pad_id, np.int32)
    mask = np.zeros((rows, prompt_len + gen_len), bool)
    response_mask = np.zeros((rows, gen_len), bool)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if len(p) > prompt_len or len(r) > gen_len:
            raise ValueError(
                f"row {i}: prompt {len(p)} > {prompt_len} or response {len(r)} > {gen_len}"
            )
        ids[i, prompt_len - len(p) : prompt_len] = p
        mask[i, prompt_len - len(p) : prompt_len] = True
        ids[i, prompt_len : prompt_len + len(r)] = r
        mask[i, prompt_len : prompt_len + len(r)] = True
        response_mask[i, : len(r)] = True
    return ids, mask, response_mask


def collect_rollout(
    *,
    sampler,
    params,
    scorer,
    tokenizer,
    prompt_batches: Iterator[list[tuple[list[int], PromptRecord]]],
    n: int,
    prompt_len: int,
    gen_len: int,
    sampling: dict,
    seed: int,
    advantage: str,
    overlong: tuple[int, float] | None,
    dynamic_rounds: int,
    return_hidden: bool,
) -> Rollout:
    """Sample, score and assemble one rollout batch (see module docstring)."""
    stats: Counter = Counter()
    kept: list[dict] = []  # per-group dicts of rows
    spare: list[dict] = []
    wanted = None
    t_sample = t_reward = 0.0
    for round_ in range(dynamic_rounds + 1):
        pairs = next(prompt_batches)
        wanted = wanted or len(pairs)
        t0 = time.perf_counter()
        out = sampler.generate(
            [ids for ids, _ in pairs],
            n=n,
            max_new_tokens=gen_len,
            seed=seed * 1000 + round_,
            return_hidden=return_hidden,
            params=params,
            **sampling,
        )
        texts = tokenizer.batch_decode(out.tokens, skip_special_tokens=True)
        t1 = time.perf_counter()
        records = [rec for _, rec in pairs for _ in range(n)]
        items = [{"answer": r.answer, "tests": r.tests, **r.extra} for r in records]
        scored = scorer.score([r.prompt for r in records], texts, items)
        t2 = time.perf_counter()
        t_sample += t1 - t0
        t_reward += t2 - t1
        stats.update({f"reward/{k}": v for k, v in scored.counts.items()})
        rewards = np.asarray(scored.rewards, np.float32)
        if overlong is not None and overlong[0] > 0:
            rewards = rewards + np.asarray(
                adv_lib.overlong_penalty(
                    jnp.asarray(out.lengths),
                    max_response_length=gen_len,
                    buffer=overlong[0],
                    factor=overlong[1],
                )
            )
        informative = np.asarray(adv_lib.informative_groups(jnp.asarray(rewards), n))
        hidden = out.hidden_array if return_hidden else None
        for g, (prompt_ids, _) in enumerate(pairs):
            rows = slice(g * n, (g + 1) * n)
            group = dict(
                prompt_ids=prompt_ids,
                tokens=out.tokens[rows],
                logprobs=out.untruncated_logprobs[rows],
                rewards=rewards[rows],
                lengths=list(out.lengths[rows]),
                records=records[rows],
                texts=texts[rows],
                hidden=None if hidden is None else hidden[rows],
            )
            (kept if informative[g] or dynamic_rounds == 0 else spare).append(group)
        stats["dynamic/rounds"] = round_ + 1
        if len(kept) >= wanted:
            break
    if len(kept) < wanted:
        stats["dynamic/uninformative_filled"] = wanted - len(kept)
        kept.extend(spare[: wanted - len(kept)])
    kept = kept[:wanted]
    stats["dynamic/informative_groups"] = int(sum(np.ptp(g["rewards"]) > 0 for g in kept))

    prompts = [g["prompt_ids"] for g in kept for _ in range(n)]
    tokens = [t for g in kept for t in g["tokens"]]
    ids, mask, response_mask = pad_rows(
        prompts, tokens, prompt_len=prompt_len, gen_len=gen_len, pad_id=tokenizer.pad_token_id
    )
    logprobs = np.zeros((len(tokens), gen_len), np.float32)
    for i, lp in enumerate(g_lp for g in kept for g_lp in g["logprobs"]):
        logprobs[i, : len(lp)] = lp
    rewards = np.concatenate([g["rewards"] for g in kept]).astype(np.float32)
    advantages = np.asarray(ADVANTAGE_FNS[advantage](jnp.asarray(rewards), n), np.float32)
    hidden = None
    if return_hidden:
        hidden = jnp.concatenate([g["hidden"] for g in kept], axis=0)
        pad = gen_len - hidden.shape[1]
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))) if pad > 0 else hidden[:, :gen_len]
    lengths = np.asarray([n_ for g in kept for n_ in g["lengths"]], np.int32)
    stats.update(
        {
            "time/rollout": t_sample,
            "time/reward": t_reward,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "response_length_mean": float(lengths.mean()),
            "response_length_max": float(lengths.max()),
            "response_clip_fraction": float((lengths >= gen_len).mean()),
        }
    )
    return Rollout(
        input_ids=ids,
        attention_mask=mask,
        response_mask=response_mask,
        rollout_logprobs=logprobs,
        rewards=rewards,
        advantages=advantages,
        lengths=lengths,
        hidden=hidden,
        records=[r for g in kept for r in g["records"]],
        responses=[t for g in kept for t in g["texts"]],
        response_tokens=tokens,
        stats=dict(stats),
    )
