"""From prompts to a scored rollout batch whose tensors stay on device.

Sampling -> decoding -> rewards (+ DAPO overlong penalty) -> group advantages, with DAPO's
dynamic sampling: groups whose rewards are all equal carry no learning signal, so further rounds
of prompts are sampled until the batch holds ``prompts_per_step`` informative groups or the round
limit is hit (then the batch is filled with uninformative groups, counted, so its shape — and the
compiled update — never changes). With an :class:`~delta_jax.envs.episodes.EpisodeRunner` each
response is a multi-turn episode: environments answer turns on the host while the engine decodes,
observations are written into the responses as context (``Rollout.action_mask``).

The host reads the sampled token ids (the rewards need text) and the lengths; the sequences,
log-probs and hidden states stay on device, gathered into the fixed padded layout (prompt ``P``,
response ``G``) by one jitted program.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import Counter
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax.data import PromptRecord
from delta_jax.envs.episodes import EpisodeRunner, episode_row
from delta_jax.losses import advantages as adv_lib
from delta_jax.rewards import concat_batches
from delta_jax.rl.compilation import CompileCounter
from delta_jax.rl.partial import Clock, PartialRollouts

# Percentiles of a step's response lengths recorded beside their mean, min and max.
LENGTH_PERCENTILES = (10, 25, 50, 75, 90, 99)


@dataclasses.dataclass
class Rollout:
    """A scored rollout batch of ``B = prompts x n`` sequences (prompt-major).

    A response is the ``lengths`` tokens after the prompt. In a single-turn rollout the policy
    drew all of them; in a multi-turn one they interleave the policy's turns (actions) with
    observations an environment wrote (a tool's output), which are context: ``action_mask``
    marks the actions, and only they carry a loss, enter DelTA's statistics, or need the
    sampler's log-prob and hidden state (at an observation ``rollout_logprobs`` may hold
    anything, ``hidden`` any finite value). Single-turn rollouts leave ``action_mask`` None.
    """

    sequences: jax.Array  # int32[B, P + G] device: left-padded prompt ++ right-padded response
    rollout_logprobs: jax.Array  # f32[B, G] device: sampler's untruncated log-probs
    hidden: jax.Array | None  # [B, G, H] device: sampler hidden states, when asked for
    prompt_lengths: np.ndarray  # int32[B]
    lengths: np.ndarray  # int32[B] response tokens
    rewards: np.ndarray  # f32[B] (overlong penalty included)
    advantages: np.ndarray  # f32[B]
    records: list[PromptRecord]  # one per row
    responses: list[str]
    stats: dict[str, float]
    action_mask: jax.Array | None = None  # bool[B, G] device: True where the policy drew the
    # response token (read before ``lengths`` only); None: single-turn, every token is an action


# A rollout's fields that live on device (None where a run has none).
DEVICE_FIELDS = ("sequences", "rollout_logprobs", "hidden", "action_mask")


def rollout_to_host(rollout: Rollout) -> dict:
    """``rollout`` as host values (NumPy arrays; records as dicts), e.g. for a checkpoint's
    host document through :func:`~delta_jax.rl.host_state.pack`; see :func:`rollout_from_host`.
    Single-process runs (a device array is read whole)."""
    host = {
        k: None if getattr(rollout, k) is None else np.asarray(getattr(rollout, k))
        for k in DEVICE_FIELDS
    }
    return {
        **host,
        "prompt_lengths": np.asarray(rollout.prompt_lengths),
        "lengths": np.asarray(rollout.lengths),
        "rewards": np.asarray(rollout.rewards),
        "advantages": np.asarray(rollout.advantages),
        "records": [dataclasses.asdict(r) for r in rollout.records],
        "responses": list(rollout.responses),
        "stats": dict(rollout.stats),
    }


def rollout_from_host(host: dict) -> Rollout:
    """The rollout :func:`rollout_to_host` gave (device fields as NumPy arrays: place them)."""
    return Rollout(
        **{k: host[k] for k in (*DEVICE_FIELDS, "prompt_lengths", "lengths", "rewards")},
        advantages=host["advantages"],
        records=[PromptRecord(**r) for r in host["records"]],
        responses=list(host["responses"]),
        stats=dict(host["stats"]),
    )


ADVANTAGE_FNS: dict[str, Callable] = {
    "grpo": adv_lib.grpo_advantages,
    "dr_grpo": adv_lib.dr_grpo_advantages,
    "rloo": adv_lib.rloo_advantages,
    "reinforce_pp": adv_lib.reinforce_pp_baseline_advantages,
}


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """What each rollout batch is: its layout, how it is sampled, and how it is scored.

    Attributes:
      n: samples per prompt (a group).
      prompt_len: ``P``, the prompt width of the layout (prompts are left-padded or cut to it).
      gen_len: ``G``, the response budget and width.
      sampling: the further ``Sampler.generate`` keywords (temperature, top_p, top_k,
        stop_token_ids).
      advantage: the group advantage, a key of :data:`ADVANTAGE_FNS`.
      overlong: DAPO's overlong penalty ``(buffer, factor)``; None or a buffer of 0: none.
      dynamic_rounds: further sampling rounds of dynamic sampling (0: none).
      return_hidden: keep the sampler's hidden states (DelTA's coefficients from the sampler).
    """

    n: int
    prompt_len: int
    gen_len: int
    sampling: dict
    advantage: str
    overlong: tuple[int, float] | None
    dynamic_rounds: int
    return_hidden: bool


@functools.partial(jax.jit, static_argnames=("prompt_len", "gen_len"))
def _padded_rows(outputs, rows, *, prompt_len: int, gen_len: int):
    """Rows ``rows`` of the sampler outputs of every round, in the fixed ``P`` / ``G`` layout."""

    def fit(x, width, left):  # crop or pad axis 1 to ``width``
        have = x.shape[1]
        if have >= width:
            return x[:, have - width :] if left else x[:, :width]
        pad = [(0, 0)] * x.ndim
        pad[1] = (width - have, 0) if left else (0, width - have)
        return jnp.pad(x, pad)

    cat = lambda xs: jnp.concatenate(xs)[rows]
    sequences = cat(
        [
            jnp.concatenate([fit(p, prompt_len, True), fit(t, gen_len, False)], 1)
            for p, t, *_ in outputs
        ]
    )
    logprobs = cat([fit(o[2], gen_len, False) for o in outputs])
    hidden = None if outputs[0][3] is None else cat([fit(o[3], gen_len, False) for o in outputs])
    mask = None if outputs[0][4] is None else cat([fit(o[4], gen_len, False) for o in outputs])
    return sequences, logprobs, hidden, mask


def collect_rollout(
    *,
    sampler,
    params,
    scorer,
    tokenizer,
    prompt_batches: Iterator[list[tuple[list[int], PromptRecord]]],
    spec: RolloutSpec,
    seed: int,
    episodes: EpisodeRunner | None = None,
    partial: PartialRollouts | None = None,
    clock: Clock | None = None,
) -> Rollout:
    """Sample, score and assemble one rollout batch (see module docstring) as ``spec`` says;
    with ``episodes`` each response is a multi-turn episode (:mod:`delta_jax.envs.episodes`).

    With ``partial`` (partial rollouts, :mod:`delta_jax.rl.partial`) each sampler call continues
    the buffer's groups and asks for the over-provision too (the first call of a run reads the
    prompt batches that fill it), stops once a batch's worth of groups has ended and keeps the
    rest; ``clock`` is the policy's version (updates applied, in RL steps) and the updates that
    land before the batch is trained (an asynchronous run's rollout ahead: 1; None: version 0,
    no lag).
    """
    clock = clock or Clock(0)
    dynamic_rounds = spec.dynamic_rounds
    stats: Counter = Counter()
    kept: list[Group] = []
    spare: list[Group] = []
    outputs, offset, wanted = [], 0, None
    take_skipped = getattr(prompt_batches, "take_skipped", lambda: 0)
    for round_ in range(dynamic_rounds + 1):
        pairs = next(prompt_batches)
        wanted = wanted or len(pairs)
        while partial is not None and len(pairs) < partial.fresh_needed:
            pairs = pairs + next(prompt_batches)  # the first call: the over-provision's prompts
        # Rows the prompt source passed over (bad rows, prompts too long) for this step.
        stats["data/skipped"] += take_skipped()
        call = _Call(seed * 1000 + round_, episodes, partial, clock)
        out, groups = _sample_and_score(
            sampler, params, scorer, tokenizer, pairs, spec, call, stats
        )
        outputs.append(
            (
                out.prompt_array,
                out.token_array,
                out.untruncated_logprob_array,
                out.hidden_array,
                out.action_mask_array,
            )
        )
        for group in groups:
            group.rows = offset + group.rows
            (kept if group.informative or dynamic_rounds == 0 else spare).append(group)
        offset += out.token_array.shape[0]
        stats["dynamic/rounds"] = round_ + 1
        if len(kept) >= wanted:
            break
    if len(kept) < wanted:
        stats["dynamic/uninformative_filled"] = wanted - len(kept)
        kept.extend(spare[: wanted - len(kept)])
    kept = kept[:wanted]
    if stats.get("engine/decode_steps"):
        stats["rollout/occupancy"] = stats["engine/useful_steps"] / stats["engine/decode_steps"]
    _speculation_stats(stats)
    for key in [k for k in stats if k.startswith("engine/")]:
        stats.pop(key)
    if episodes is not None:  # per-episode means over every round's episodes
        observed, written = stats.pop("rollout/observation_tokens"), stats.pop("response_tokens")
        stats["rollout/observation_share"] = observed / max(1, written)
        count = stats.pop("episode/count")
        for key in [k for k in stats if k.startswith("episode/")]:
            stats[key] /= count
    stats["dynamic/informative_groups"] = sum(g.informative for g in kept)
    # Every round's slot filled (the first round's arrays stand in for the rounds not run, and
    # no kept row points at them), so the assembly compiles once whatever the rounds taken.
    outputs += outputs[:1] * (dynamic_rounds + 1 - len(outputs))
    return _assemble(kept, tuple(outputs), spec, dict(stats))


def _assemble(kept: list[Group], outputs, spec: RolloutSpec, stats) -> Rollout:
    """The kept groups' rows in the fixed layout (on device), with advantages and statistics."""
    n, gen_len = spec.n, spec.gen_len
    rows = np.concatenate([g.rows for g in kept])
    sequences, logprobs, hidden, action_mask = _padded_rows(
        outputs, rows, prompt_len=spec.prompt_len, gen_len=gen_len
    )
    joined = lambda key: [x for g in kept for x in getattr(g, key)]
    rewards = np.concatenate([g.rewards for g in kept]).astype(np.float32)
    lengths = np.asarray(joined("lengths"), np.int32)
    for name in kept[0].components:
        stats[f"reward/{name}"] = float(np.mean([x for g in kept for x in g.components[name]]))
    stats.update(
        {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "response_length_mean": float(lengths.mean()),
            "response_length_max": float(lengths.max()),
            "response_clip_fraction": float((lengths >= gen_len).mean()),
            # The length distribution in a few numbers (the planner's --lengths reads them).
            "response_length_min": float(lengths.min()),
            **{
                f"response_length_p{q}": float(np.percentile(lengths, q))
                for q in LENGTH_PERCENTILES
            },
        }
    )
    return Rollout(
        sequences=sequences,
        rollout_logprobs=logprobs,
        hidden=hidden,
        prompt_lengths=np.asarray([len(g.prompt_ids) for g in kept for _ in range(n)], np.int32),
        lengths=lengths,
        rewards=rewards,
        advantages=np.asarray(ADVANTAGE_FNS[spec.advantage](jnp.asarray(rewards), n), np.float32),
        records=joined("records"),
        responses=joined("texts"),
        stats=stats,
        action_mask=action_mask,
    )


@dataclasses.dataclass
class Group:
    """A prompt's ``n`` samples after scoring: the host-side results, and where its rows are
    (in its sampler call's output, then among every round's outputs once the round is placed)."""

    prompt_ids: list[int]
    rewards: np.ndarray  # f32[n]
    lengths: list[int]
    records: list[PromptRecord]
    texts: list[str]
    components: dict[str, np.ndarray]  # each reward function's own rewards [n], by name
    rows: np.ndarray  # int [n]

    @property
    def informative(self) -> bool:
        """Whether its rewards differ (a group whose rewards are all equal has no gradient)."""
        return bool(np.ptp(self.rewards) > 0)


class _RewardStream:
    """Rewards scored while the engine decodes: each unit (a row, or a prompt's rows for a
    batched function) goes to the reward pool as soon as its rows have ended."""

    def __init__(self, scorer, tokenizer, records, n: int, episodes):
        self.scorer, self.tokenizer, self.episodes = scorer, tokenizer, episodes
        self.items = [{"answer": r.answer, "tests": r.tests, **r.extra} for r in records]
        self.prompts = [r.prompt for r in records]
        self.texts: list[str] = [""] * len(records)
        self.unit = scorer.unit(n)
        self.pending: list = [None] * (len(records) // self.unit)
        self.ended = [0] * len(self.pending)

    def sample_done(self, row: int, tokens: list[int], *, ended_before: bool = False) -> None:
        """A row ended (the host's only read of its tokens); ``ended_before``: in an earlier
        call (a carried row), whose episode was finished then."""
        if self.episodes is not None and not ended_before:  # its last turn, for environments
            self.episodes.finish(row, tokens)  # that score episodes
        self.texts[row] = self.tokenizer.batch_decode([tokens], skip_special_tokens=True)[0]
        u = row // self.unit
        self.ended[u] += 1
        if self.ended[u] == self.unit:
            rows = slice(u * self.unit, (u + 1) * self.unit)
            self.pending[u] = self.scorer.submit(
                self.prompts[rows], self.texts[rows], self.items[rows], group_size=self.unit
            )

    def finish(self, groups: list[int], n: int):
        """The rewards of prompt-major ``groups`` of ``n`` rows, in that order (waits for
        their units still being scored)."""
        rows = [r for g in groups for r in range(g * n, (g + 1) * n)]
        units = dict.fromkeys(r // self.unit for r in rows)  # in order, once each
        batch = concat_batches([self.pending[u].result() for u in units])
        pick = lambda xs: [xs[r] for r in rows]
        return self.scorer.finish(batch, pick(self.prompts), pick(self.texts))


def _count_engine(stats: Counter, out, episodes, rows: int) -> None:
    """How full the continuous engine's slots and pool were, and the episodes' statistics."""
    if out.engine_stats is not None:
        es = out.engine_stats
        stats["engine/useful_steps"] += es.useful_steps
        stats["engine/decode_steps"] += es.decode_steps
        stats["rollout/preemptions"] += es.preemptions
        stats["rollout/pages_peak"] = max(stats["rollout/pages_peak"], *es.high_water_pages)
        if es.speculative is not None:  # a sampler with drafts: did this call speculate?
            stats["engine/drafting_calls"] += 1
            stats["engine/speculative_calls"] += es.speculative
        if es.verify_steps:  # speculative rollouts
            stats["engine/verify_steps"] += es.verify_steps
            for source in es.drafted:
                stats[f"engine/drafted/{source}"] += es.drafted[source]
                stats[f"engine/accepted/{source}"] += es.accepted[source]
    if episodes is not None:
        for key, value in episodes.stats().items():  # means; summed here, divided at the end
            stats[key] += value * rows
        stats["episode/count"] += rows
        stats["rollout/observation_tokens"] += out.engine_stats.observation_tokens
        stats["response_tokens"] += sum(out.lengths)
        stats["time/tool_wait"] += out.engine_stats.wait_s


def _speculation_stats(stats: Counter) -> None:
    """Speculative rollouts' metrics: the fraction of sampler calls that speculated
    (``rollout.speculate: auto`` decides per call), tokens per verify step, the verify steps
    saved (tokens minus verify steps), and each draft source's drafted tokens and acceptance
    rate."""
    if stats.get("engine/drafting_calls"):
        stats["speculate/on"] = stats["engine/speculative_calls"] / stats["engine/drafting_calls"]
    if not stats.get("engine/verify_steps"):
        return
    tokens, steps = stats["engine/useful_steps"], stats["engine/verify_steps"]
    stats["speculate/tokens_per_step"] = tokens / steps
    stats["speculate/steps_saved"] = tokens - steps
    for key in [k for k in stats if k.startswith("engine/drafted/")]:
        source = key.rsplit("/", 1)[1]
        drafted = stats[key]
        stats[f"speculate/drafted/{source}"] = drafted
        stats[f"speculate/acceptance/{source}"] = (
            stats[f"engine/accepted/{source}"] / drafted if drafted else 0.0
        )


@dataclasses.dataclass(frozen=True)
class _Call:
    """One sampler call's own settings: its seed, the episodes' runner (multi-turn), the
    partial-rollout buffer and the staleness clock (partial rollouts)."""

    seed: int
    runner: EpisodeRunner | None
    partial: PartialRollouts | None
    clock: Clock


def _sample_and_score(sampler, params, scorer, tokenizer, pairs, spec: RolloutSpec, call, stats):
    """One sampler call and its rewards; returns the output and the groups it gives (every
    prompt's; with partial rollouts, the finished groups the buffer returns)."""
    n, gen_len, overlong = spec.n, spec.gen_len, spec.overlong
    t0, compiling = time.perf_counter(), CompileCounter.seconds
    keywords: dict = {"n": n, "seed": call.seed}
    plan = None
    if call.partial is not None:  # the held groups first, then ``pairs``
        version, lag = call.clock
        plan = call.partial.plan(pairs, version=version, seed=call.seed % 2**32, lag=lag)
        pairs = list(zip(plan.prompts, plan.records, strict=True))
        keywords = plan.generate_kwargs()
    records = [rec for _, rec in pairs for _ in range(n)]
    runner = call.runner
    episodes = None
    if runner is not None:  # held episodes (partial rollouts) continue where they stopped
        held = plan.episodes if plan is not None else None
        episodes = runner.start([episode_row(r) for r in records], held)
    stream = _RewardStream(scorer, tokenizer, records, n, episodes)
    for row, carry in enumerate((plan and plan.carried) or ()):
        if carry is not None and carry.finished:  # ended in an earlier call: no callback
            stream.sample_done(row, list(carry.tokens), ended_before=True)
    out = sampler.generate(
        [ids for ids, _ in pairs],
        max_new_tokens=gen_len,
        return_hidden=spec.return_hidden,
        params=params,
        on_sample_done=stream.sample_done,
        turns=None if episodes is None else episodes.turns,
        **keywords,
        **spec.sampling,
    )
    t1 = time.perf_counter()
    given = list(range(len(pairs)))
    if plan is not None:
        finished, partial_stats = call.partial.take(plan, out, episodes)
        given = [int(g.rows[0]) // n for g in finished]
        for key, value in partial_stats.metrics().items():
            stats[key] += value
    scored = stream.finish(given, n)
    stats["time/rollout"] += t1 - t0 - (CompileCounter.seconds - compiling)  # compiles apart
    # What the step waits for after the last token: the rewards not computed while decoding.
    stats["time/reward_tail"] += time.perf_counter() - t1
    stats.update({f"reward_reason/{k}": v for k, v in scored.counts.items()})
    _count_engine(stats, out, episodes, len(records))
    rewards = np.asarray(scored.rewards, np.float32)
    components = dict(scored.components)
    rows = np.concatenate([np.arange(g * n, (g + 1) * n) for g in given])
    own = None if episodes is None else episodes.rewards()
    if own is not None:  # environments that score their episodes add their reward
        own = np.asarray(own)[rows]
        rewards, components["environment"] = rewards + own, own
    lengths = np.asarray(out.lengths)[rows]
    if overlong is not None and overlong[0] > 0:
        rewards = rewards + np.asarray(
            adv_lib.overlong_penalty(
                jnp.asarray(lengths),
                max_response_length=gen_len,
                buffer=overlong[0],
                factor=overlong[1],
            )
        )
    cut = lambda x, i: x[i * n : (i + 1) * n]
    return out, [
        Group(
            prompt_ids=pairs[g][0],
            rewards=cut(rewards, i),
            lengths=cut(lengths, i).tolist(),
            records=cut(records, g),
            texts=cut(stream.texts, g),
            components={k: cut(v, i) for k, v in components.items()},
            rows=cut(rows, i),
        )
        for i, g in enumerate(given)
    ]
