"""Rollout bounds at a response-length distribution (``delta-jax plan --lengths``): three ways to
schedule an RL step's sequences, each priced with the compiled decode chunk's per-step bound
``t_d`` and the prefill chunk's per-token bound ``t_p`` (:mod:`.roofline`).

Per data group (sampling-mesh row shard) the engine has ``S`` decode slots and a step has ``n``
sequences from ``p`` prompts of ``P`` tokens; ``G`` groups run side by side on ``C`` chips.
Lengths are drawn i.i.d. from the distribution, ``STEPS`` sampled steps with seed ``SEED``.

* synchronous: continuous batching -- a slot takes the group's next sequence when its sequence
  ends -- and the step waits for its last sequence. ``T`` = decode steps until every group's
  sequences end (simulated: :func:`continuous_batching_steps`, the slowest group);
  ``rollout = T t_d + p P t_p``; slot occupancy ``sum(lengths) / (G S T)``.
* partial rollouts (APRIL, arXiv 2509.18521): more sequences in flight than the step needs; the
  step ends when its quota is in and the unfinished ones carry over to the next step, so in the
  steady state every slot decodes every step: ``rollout = n E[L] / S t_d + p P t_p + S (P + A)
  t_p``, the last term the carried sequences' prompt and partial response prefilled again under
  the new weights, ``A = E[L^2] / (2 E[L])`` the mean age of a sequence in a slot at a random
  moment (a slot holds a sequence with probability proportional to its length, and is at a
  uniform point of it).
* asynchronous on split meshes: rollout on ``r = k C / G`` chips (``k`` of the ``G`` data
  groups) and the update on the other ``C - r``, at most ``s`` policy versions between a
  sequence's first token and the update that consumes it. Steady-state step
  ``max(R_k, U C / (C - r), L_max t_d / s)``: ``R_k = (G / k)(n E[L] / S t_d + p P t_p) +
  S (P + A) t_p``, the partial-rollout bound with the step's sequences on ``k`` groups (slots
  kept full; the in-flight sequences prefilled again at each weight sync); the update bound
  ``U`` of the whole slice scaled linearly to ``C - r`` chips (its FLOPs and bytes spread over
  fewer chips: an estimate from the one compiled layout, not a compile of the split, whose
  memory it does not check); ``L_max`` the longest sequence of a step, which spans
  ``L_max t_d / step`` versions. The best ``k`` is reported. The weights' transfer from the
  update chips to the rollout chips is not counted.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from delta_jax.plan.lengths import Lengths

STEPS = 16  # sampled RL steps
SEED = 0


def continuous_batching_steps(lengths, slots: int) -> int:
    """Decode steps until ``lengths`` (in the order they are taken) end on ``slots`` slots, each
    slot taking the next sequence as its own ends.

    Examples:
      >>> continuous_batching_steps([3, 1, 1, 4], slots=2)  # slot 2: 1, then 1, then 4
      6
    """
    ends = [0] * slots
    for length in lengths:
        heapq.heappush(ends, heapq.heappop(ends) + int(length))
    return max(ends)


@dataclasses.dataclass(frozen=True)
class Engine:
    """One data group's share of a step: ``sequences`` from ``prompts`` prompts of
    ``prompt_len`` tokens on ``slots`` decode slots; ``groups`` groups on ``chips`` chips;
    ``decode_step_s`` (``t_d``) and ``prefill_token_s`` (``t_p``) from the roofline."""

    groups: int
    chips: int
    sequences: int
    slots: int
    prompts: int
    prompt_len: int
    decode_step_s: float
    prefill_token_s: float


@dataclasses.dataclass(frozen=True)
class Split:
    """Asynchronous rollout on ``rollout_chips`` (``groups`` data groups), update on the rest."""

    rollout_chips: int
    groups: int
    rollout_s: float
    update_s: float
    tail_s: float  # L_max t_d / s

    @property
    def step_s(self) -> float:
        return max(self.rollout_s, self.update_s, self.tail_s)


@dataclasses.dataclass(frozen=True)
class LengthBounds:
    """The three rollout bounds of a step at a length distribution (see the module)."""

    source: str
    mean: float  # of the sampled lengths
    p50: float
    p99: float
    longest: float  # a step's longest sequence, mean over sampled steps
    cap: int  # rollout.max_new_tokens
    at_cap: float  # fraction of sampled lengths at the cap
    engine: Engine
    sync_steps: float  # T, mean over sampled steps
    sync_occupancy: float
    partial_steps: float  # n E[L] / S
    age: float  # A
    update_s: float
    max_staleness: int
    splits: tuple[Split, ...]

    @property
    def prefill_s(self) -> float:
        e = self.engine
        return e.prompts * e.prompt_len * e.prefill_token_s

    @property
    def reprefill_s(self) -> float:
        e = self.engine
        return e.slots * (e.prompt_len + self.age) * e.prefill_token_s

    @property
    def sync_s(self) -> float:
        return self.sync_steps * self.engine.decode_step_s + self.prefill_s

    @property
    def partial_s(self) -> float:
        return self.partial_steps * self.engine.decode_step_s + self.prefill_s + self.reprefill_s

    @property
    def best_split(self) -> Split | None:
        return min(self.splits, key=lambda s: s.step_s, default=None)

    def lines(self) -> list[str]:
        e, t_d = self.engine, self.engine.decode_step_s * 1e3
        return [
            f"rollout at response lengths {self.source} (capped at {self.cap:,}): mean "
            f"{self.mean:,.0f}, median {self.p50:,.0f}, p99 {self.p99:,.0f}, {self.at_cap:.1%} "
            f"at the cap; a step's longest {self.longest:,.0f} (mean of {STEPS} sampled steps, "
            f"seed {SEED}; {e.sequences} sequences on {e.slots} slots per data group, "
            f"{e.groups} groups):",
            f"  synchronous (slots refilled, the step waits for its last sequence): rollout >= "
            f"{self.sync_s:,.1f} s ({self.sync_steps:,.0f} decode steps x {t_d:.2f} ms + "
            f"prefill {self.prefill_s:,.1f} s; slot occupancy {self.sync_occupancy:.0%}); "
            f"step >= {self.sync_s + self.update_s:,.1f} s",
            f"  partial rollouts (slots kept full, unfinished sequences carried over): rollout "
            f">= {self.partial_s:,.1f} s ({self.partial_steps:,.0f} decode steps x {t_d:.2f} ms "
            f"+ prefill {self.prefill_s:,.1f} s + re-prefill {self.reprefill_s:,.1f} s of "
            f"{e.slots} carried sequences per group, {e.prompt_len:,} prompt + {self.age:,.0f} "
            f"response tokens each; occupancy 100%); step >= "
            f"{self.partial_s + self.update_s:,.1f} s",
            *self._split_lines(),
        ]

    def _split_lines(self) -> list[str]:
        best, e = self.best_split, self.engine
        head = f"  asynchronous on split meshes (max staleness {self.max_staleness}): "
        if best is None:
            return [head + f"no split: the engine has {e.groups} data group (one needs two)"]
        return [
            head + f"best {best.rollout_chips} of {e.chips} chips for the rollout ({best.groups} "
            f"of {e.groups} data groups): rollout >= {best.rollout_s:,.1f} s, update on "
            f"{e.chips - best.rollout_chips} chips >= {best.update_s:,.1f} s (the slice's x "
            f"{e.chips}/{e.chips - best.rollout_chips}: linear in chips, not a compile of the "
            f"split), longest sequence / staleness "
            f"{best.tail_s:,.1f} s; step >= {best.step_s:,.1f} s",
            "    each split (rollout chips: step): "
            + ", ".join(f"{s.rollout_chips}: {s.step_s:,.1f} s" for s in self.splits),
        ]


def sample_steps(lengths: Lengths, engine: Engine) -> np.ndarray:
    """``[STEPS, groups, sequences]`` lengths drawn with seed ``SEED``."""
    rng = np.random.default_rng(SEED)
    return lengths.sample(rng, (STEPS, engine.groups, engine.sequences))


def bounds(
    lengths: Lengths, sampled: np.ndarray, engine: Engine, update_s: float, max_staleness: int
) -> LengthBounds:
    """The three bounds (see the module) of ``sampled`` lengths ``[steps, groups, sequences]``
    on ``engine``, with the update's bound ``update_s`` (whole slice)."""
    if max_staleness < 1:
        raise ValueError(f"--max-staleness={max_staleness} must be >= 1")
    e, flat = engine, sampled.reshape(-1).astype(np.float64)
    makespans = np.array(
        [[continuous_batching_steps(g, e.slots) for g in step] for step in sampled]
    )  # [steps, groups]
    sync = makespans.max(axis=1)  # the step waits for its slowest group
    occupancy = sampled.sum(axis=(1, 2)) / (e.groups * e.slots * sync)
    mean, age = flat.mean(), (flat**2).mean() / (2 * flat.mean())
    partial_steps = e.sequences * mean / e.slots
    longest = float(sampled.max(axis=(1, 2)).mean())
    per_group = partial_steps * e.decode_step_s + e.prompts * e.prompt_len * e.prefill_token_s
    reprefill = e.slots * (e.prompt_len + age) * e.prefill_token_s
    splits = tuple(
        Split(
            rollout_chips=k * e.chips // e.groups,
            groups=k,
            rollout_s=e.groups / k * per_group + reprefill,
            update_s=update_s * e.chips / (e.chips - k * e.chips // e.groups),
            tail_s=longest * e.decode_step_s / max_staleness,
        )
        for k in range(1, e.groups)
    )
    return LengthBounds(
        source=lengths.source,
        mean=float(mean),
        p50=float(np.quantile(flat, 0.5)),
        p99=float(np.quantile(flat, 0.99)),
        longest=longest,
        cap=lengths.cap,
        at_cap=float((flat >= lengths.cap).mean()),
        engine=e,
        sync_steps=float(sync.mean()),
        sync_occupancy=float(occupancy.mean()),
        partial_steps=float(partial_steps),
        age=float(age),
        update_s=update_s,
        max_staleness=max_staleness,
        splits=splits,
    )
