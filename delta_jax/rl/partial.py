"""Partial rollouts on the host: the buffer of groups a step's sampler call left
unfinished, carried into the next call.

A step asks the continuous engine for ``groups + extra`` groups (the over-provision) with
``quota=groups``: the call stops once ``groups`` prompts have all their ``n`` samples ended, and
the rows still running come back unfinished (:mod:`delta_jax.sampling.partial`).
:class:`PartialRollouts` plans each such call and takes its output back:

* :meth:`~PartialRollouts.plan` lays out the request: the groups carried from the last call
  first (each row a :class:`~delta_jax.sampling.output.Carry`: unfinished rows continue from
  their tokens with their own RNG identity, rows that had ended pass through as they are), then
  the prompts of groups dropped for staleness (sampled afresh), then new prompts up to
  ``groups + extra``.
* :meth:`~PartialRollouts.take` returns ``groups`` finished groups (all ``n`` samples ended;
  the oldest first, in request order) and keeps every other group of the request for the next
  call, the finished surplus included (it passes through the next call and counts towards its
  quota). So after the first call the buffer holds ``extra`` groups and each call needs
  ``groups`` new prompts.

Every row keeps the policy version that drew its first token (the version is an int the
caller passes per call, e.g. the number of updates applied); a group's staleness is the version
it is trained against minus its oldest token's: the call's version plus the call's ``lag`` (the
updates that land between the call and the update that trains its groups: 0 for a synchronous
run, 1 for an asynchronous run's rollout ahead). With ``max_staleness`` a carried group more
than that many versions behind is dropped when the next call is planned (counted), and its
prompt is sampled again from the start in that call: every group a call returns has all its
tokens within ``max_staleness`` versions of the policy that trains it. Under unchanged
weights the groups returned are exactly those an uninterrupted call with each group's seed and
position would have drawn (the engine's continuation is exact).

The buffer is host state of the run: :meth:`~PartialRollouts.state_dict` (NumPy arrays and a
list of record dicts) and :meth:`~PartialRollouts.from_state_dict` round-trip it exactly, and
so do :meth:`~PartialRollouts.to_json` and :meth:`~PartialRollouts.from_json` through a JSON
document (the checkpoint's host item): arrays as base64 bytes, records' tuples, dicts and NumPy
values tagged, so that a record comes back as it was.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, NamedTuple

import numpy as np

from delta_jax.data import PromptRecord
from delta_jax.rl.host_state import pack, unpack
from delta_jax.sampling import Carry, SamplerOutput

__all__ = ["Clock", "FinishedGroup", "HeldGroup", "PartialRollouts", "PartialStats", "RolloutPlan"]

# A prompt as the training batches give it: its token ids and its record.
Pair = tuple[list[int], PromptRecord]

NO_TOKEN = -1  # the version of a row that has no token yet


class Clock(NamedTuple):
    """A sampler call on the staleness clock (in RL steps): ``version``, the updates applied to
    the policy it samples with; ``lag``, the updates that land before the update that trains
    its groups (0: the next one; an asynchronous run's rollout ahead: 1)."""

    version: int
    lag: int = 0


@dataclasses.dataclass(frozen=True)
class HeldGroup:
    """A group kept between calls.

    Attributes:
      prompt_ids: the prompt's token ids.
      record: its prompt record.
      rows: its ``n`` rows so far (finished or not), in sample order.
      versions: per row, the policy version that drew its first token (``NO_TOKEN``: none yet).
      episodes: multi-turn rows: per row, its episode to continue (the environment as the
        call left it, :meth:`delta_jax.envs.Episodes.episode`, or its state from a checkpoint);
        None for single-turn rows.
    """

    prompt_ids: tuple[int, ...]
    record: PromptRecord
    rows: tuple[Carry, ...]
    versions: tuple[int, ...]
    episodes: tuple[Any, ...] | None = None

    @property
    def oldest(self) -> int | None:
        """The version of its oldest token (None while no row has a token)."""
        drawn = [v for v in self.versions if v != NO_TOKEN]
        return min(drawn) if drawn else None


@dataclasses.dataclass(frozen=True, eq=False)  # rows is an array
class FinishedGroup:
    """A group whose ``n`` samples have all ended, as a call's output gives it.

    Attributes:
      prompt_ids, record: its prompt.
      rows: int [n], its rows in the output of the call that returned it (prompt-major), to
        gather the output's device arrays.
      tokens, logprobs, untruncated_logprobs: its rows' generated ids and log-probs (the
        tokens drawn in earlier calls included).
      versions: per row, the policy version that drew its first token.
      staleness: the version that trains it (the call's plus its lag) minus the oldest of
        ``versions``.
    """

    prompt_ids: tuple[int, ...]
    record: PromptRecord
    rows: np.ndarray
    tokens: list[list[int]]
    logprobs: list[list[float]]
    untruncated_logprobs: list[list[float]]
    versions: tuple[int, ...]
    staleness: int

    @property
    def lengths(self) -> list[int]:
        """Generated tokens per row."""
        return [len(t) for t in self.tokens]


@dataclasses.dataclass(frozen=True)
class RolloutPlan:
    """One sampler call planned by :meth:`PartialRollouts.plan`; run it as
    ``sampler.generate(plan.prompts, max_new_tokens=..., **plan.generate_kwargs(), ...)``.

    Attributes:
      prompts: one token-id list per group: the carried groups, the re-queued prompts of the
        groups dropped for staleness, then the new prompts.
      records: their records.
      carried: per row, its :class:`Carry` (carried groups) or None (fresh rows); None when no
        row is carried.
      quota: groups the call must finish (None when every group must: no over-provision).
      seed: the call's seed (the RNG identity of its fresh rows).
      version: the policy version the call samples with.
      lag: updates between the call and the update that trains its groups.
      n: samples per prompt.
      carried_groups: the held groups the call continues (its leading groups).
      dropped: groups dropped for staleness (their prompts are among the fresh ones).
      serial: the buffer state it was planned from (a plan is taken once, in order).
      episodes: multi-turn: per row, the held episode to continue or None (a fresh row), the
        ``held`` of :meth:`delta_jax.envs.EpisodeRunner.start`; None when no row holds one.
    """

    prompts: list[list[int]]
    records: list[PromptRecord]
    carried: list[Carry | None] | None
    quota: int | None
    seed: int
    version: int
    lag: int
    n: int
    carried_groups: tuple[HeldGroup, ...]
    dropped: int
    serial: int
    episodes: list[Any] | None = None

    def generate_kwargs(self) -> dict:
        """The partial-rollout keywords of ``Sampler.generate`` for this call."""
        return {"n": self.n, "seed": self.seed, "quota": self.quota, "carried": self.carried}


@dataclasses.dataclass(frozen=True)
class PartialStats:
    """What one call did to the buffer.

    Attributes:
      returned: groups returned (the buffer's ``groups``).
      finished: groups whose samples had all ended after the call (the returned ones and a
        finished surplus kept for the next call).
      carried: groups kept for the next call (unfinished, or a finished surplus).
      carried_tokens: tokens held in the kept groups' rows.
      dropped: carried groups dropped for staleness when the call was planned.
      staleness: returned groups by staleness (versions behind the policy that trains them).
    """

    returned: int
    finished: int
    carried: int
    carried_tokens: int
    dropped: int
    staleness: dict[int, int]

    def metrics(self) -> dict[str, float]:
        """Flat metrics (``partial/...``), one per staleness seen."""
        out = {
            "partial/groups_returned": float(self.returned),
            "partial/groups_finished": float(self.finished),
            "partial/groups_carried": float(self.carried),
            "partial/tokens_carried": float(self.carried_tokens),
            "partial/groups_dropped": float(self.dropped),
        }
        out.update({f"partial/staleness_{age}": float(c) for age, c in self.staleness.items()})
        return out


def _count(name: str, value, low: int) -> int:
    """``value`` as an int, checked to be one and at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


class PartialRollouts:
    """The buffer of partial groups between a run's sampler calls (see the module docstring).

    Args:
      n: samples per prompt.
      groups: finished groups each call returns (the step's quota), >= 1.
      extra: the over-provision, further groups asked for in each call, >= 0 (0: every call
        runs all its groups to the end, nothing is carried).
      max_staleness: the most versions a returned group's oldest token may be behind the
        policy that trains it (None: no bound).
    """

    def __init__(self, n: int, groups: int, extra: int, max_staleness: int | None = None):
        self.n = _count("n", n, 1)
        self.groups = _count("groups", groups, 1)
        self.extra = _count("extra", extra, 0)
        self.max_staleness = None
        if max_staleness is not None:
            self.max_staleness = _count("max_staleness", max_staleness, 0)
        self.held: tuple[HeldGroup, ...] = ()
        self.version = NO_TOKEN  # the version of the last call taken (-1: none yet)
        self._serial = 0

    @property
    def size(self) -> int:
        """Groups in every request: ``groups + extra``."""
        return self.groups + self.extra

    @property
    def fresh_needed(self) -> int:
        """New prompts the next :meth:`plan` takes (``size`` minus the groups held; groups
        dropped for staleness are sampled again in their place)."""
        return self.size - len(self.held)

    def plan(self, fresh: list[Pair], *, version: int, seed: int, lag: int = 0) -> RolloutPlan:
        """The next sampler call: the held groups first (those more than ``max_staleness``
        versions behind ``version + lag`` dropped and their prompts sampled afresh), then
        ``fresh``.

        Args:
          fresh: ``fresh_needed`` new ``(prompt ids, record)`` pairs.
          version: the policy version the call samples with (never below the last call's).
          lag: updates applied between this call and the update that trains the groups it
            returns (0: the next update; an asynchronous run's rollout ahead: 1), at most
            ``max_staleness`` (a fresh token would be too old already).
          seed: the call's seed, a uint32 not used by any held row (fresh rows drawn with the
            same seed and position as a held row would repeat its random numbers).

        Raises:
          ValueError: a wrong number of new prompts, a record that is not a ``PromptRecord``,
            a version below the last call's, a lag above ``max_staleness``, or a seed out of
            range or held by a carried row.
        """
        version = _count("version", version, 0)
        lag = _count("lag", lag, 0)
        seed = _count("seed", seed, 0)
        bound = self.max_staleness
        if bound is not None and lag > bound:
            raise ValueError(f"lag {lag} is above max_staleness {bound}: nothing could be returned")
        if version < self.version:
            raise ValueError(f"version {version} is below the last call's ({self.version})")
        if seed >= 2**32:
            raise ValueError(f"seed must be a uint32, got {seed}")
        if seed in {c.seed for g in self.held for c in g.rows}:
            raise ValueError(f"seed {seed} was the seed of a carried row: pass a new seed")
        if len(fresh) != self.fresh_needed:
            raise ValueError(
                f"plan needs {self.fresh_needed} new prompts ({self.size} groups, "
                f"{len(self.held)} held), got {len(fresh)}"
            )
        for i, (_, record) in enumerate(fresh):
            if not isinstance(record, PromptRecord):
                raise ValueError(f"fresh[{i}]: the record must be a PromptRecord")
        trained = version + lag  # the version the call's groups are trained against
        stale = lambda g: bound is not None and g.oldest is not None and trained - g.oldest > bound
        kept = tuple(g for g in self.held if not stale(g))
        again = [(list(g.prompt_ids), g.record) for g in self.held if stale(g)]
        pairs = [(list(g.prompt_ids), g.record) for g in kept] + again + list(fresh)
        fresh_rows = [None] * (len(pairs) - len(kept)) * self.n
        carried = [c for g in kept for c in g.rows] + fresh_rows
        episodes = None
        if any(g.episodes is not None for g in kept):
            episodes = [e for g in kept for e in g.episodes or (None,) * self.n] + fresh_rows
        return RolloutPlan(
            prompts=[list(map(int, ids)) for ids, _ in pairs],
            records=[record for _, record in pairs],
            carried=carried if kept else None,
            quota=self.groups if self.extra else None,
            seed=seed,
            version=version,
            lag=lag,
            n=self.n,
            carried_groups=kept,
            dropped=len(again),
            serial=self._serial,
            episodes=episodes,
        )

    def take(
        self, plan: RolloutPlan, output: SamplerOutput, episodes=None
    ) -> tuple[list[FinishedGroup], PartialStats]:
        """The output of ``plan``'s call: returns ``groups`` finished groups (the first in
        request order: the oldest) and the call's statistics; keeps the other groups (with
        their rows' episodes, for a multi-turn call: ``episodes``, the call's
        :class:`~delta_jax.envs.Episodes`).

        Raises:
          ValueError: a plan not made from the buffer's current state, or an output that is not
            the continuous engine's answer to it (rows, RNG identities, too few finished
            groups).
        """
        if plan.serial != self._serial:
            raise ValueError(
                "this plan is not from the buffer's current state: take each plan once, in order"
            )
        whole = self._check_output(plan, output)
        n, returned, kept = self.n, [], []
        for g, (ids, record) in enumerate(zip(plan.prompts, plan.records, strict=True)):
            rows = np.arange(g * n, (g + 1) * n)
            old = plan.carried_groups[g].versions if g < len(plan.carried_groups) else None
            versions = _versions(old, [output.lengths[r] for r in rows], plan.version)
            if whole[g] and len(returned) < self.groups:
                trained = plan.version + plan.lag
                returned.append(_finished(ids, record, rows, output, versions, trained))
            else:
                carries = tuple(output.carry(int(r)) for r in rows)
                held = None if episodes is None else tuple(episodes.episode(int(r)) for r in rows)
                kept.append(HeldGroup(tuple(ids), record, carries, versions, held))
        self.held, self.version = tuple(kept), plan.version
        self._serial += 1
        stats = PartialStats(
            returned=len(returned),
            finished=sum(whole),
            carried=len(kept),
            carried_tokens=sum(len(c.tokens) for g in kept for c in g.rows),
            dropped=plan.dropped,
            staleness=dict(sorted(Counter(g.staleness for g in returned).items())),
        )
        return returned, stats

    def _check_output(self, plan: RolloutPlan, output: SamplerOutput) -> list[bool]:
        """Checks that ``output`` answers ``plan``; returns per group whether all its rows
        ended."""
        if output.finished_array is None or output.key_array is None:
            raise ValueError("take needs the output of Sampler(engine='continuous')")
        rows = len(plan.prompts) * self.n
        if output.num_rows != rows:
            raise ValueError(f"the output has {output.num_rows} rows; the plan has {rows}")
        carried = plan.carried or [None] * rows
        want = [
            (c.seed, c.prompt, c.sample) if c is not None else (plan.seed, r // self.n, r % self.n)
            for r, c in enumerate(carried)
        ]
        if [tuple(k) for k in np.asarray(output.key_array).tolist()] != want:
            raise ValueError("the output's rows were not drawn as the plan says (RNG identities)")
        finished = np.asarray(output.finished_array, bool).reshape(-1, self.n)
        whole = finished.all(axis=1).tolist()
        need = self.groups if plan.quota is not None else len(whole)
        if sum(whole) < need:
            raise ValueError(f"the output has {sum(whole)} finished groups; the call needs {need}")
        return whole

    def state_dict(self) -> dict:
        """The buffer as NumPy arrays and a list of record dicts (for a checkpoint); see
        :meth:`from_state_dict`."""
        rows = [c for g in self.held for c in g.rows]
        bound = NO_TOKEN if self.max_staleness is None else self.max_staleness
        return {
            "config": np.asarray([self.n, self.groups, self.extra, bound], np.int64),
            "version": np.asarray(self.version, np.int64),
            "prompt_ids": _flat([g.prompt_ids for g in self.held], np.int32),
            "prompt_lengths": np.asarray([len(g.prompt_ids) for g in self.held], np.int64),
            "records": [dataclasses.asdict(g.record) for g in self.held],
            "tokens": _flat([c.tokens for c in rows], np.int32),
            "logprobs": _flat([c.logprobs for c in rows], np.float32),
            "untruncated": _flat([c.untruncated for c in rows], np.float32),
            "lengths": np.asarray([len(c.tokens) for c in rows], np.int64),
            "keys": np.asarray([(c.seed, c.prompt, c.sample) for c in rows], np.int64).reshape(
                -1, 3
            ),
            "finished": np.asarray([c.finished for c in rows], bool),
            "versions": np.asarray([v for g in self.held for v in g.versions], np.int64),
            # Multi-turn rows: their observations' columns, turns and episodes.
            "observed": np.asarray([span for c in rows for span in c.observed], np.int64).reshape(
                -1, 2
            ),
            "observed_counts": np.asarray([len(c.observed) for c in rows], np.int64),
            "turns": np.asarray([c.turns for c in rows], np.int64),
            "episodes": [
                None if g.episodes is None else [_episode_state(e) for e in g.episodes]
                for g in self.held
            ],
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> PartialRollouts:
        """The buffer :meth:`state_dict` saved.

        Raises:
          ValueError: a state with missing entries or entries that do not fit together.
        """
        missing = sorted(set(_STATE_KEYS) - set(state))
        if missing:
            raise ValueError(f"the partial-rollout state lacks {', '.join(missing)}")
        n, groups, extra, bound = (int(x) for x in np.asarray(state["config"]).reshape(4))
        buffer = cls(n, groups, extra, None if bound == NO_TOKEN else bound)
        buffer.version = int(state["version"])
        prompt_lengths, lengths = np.asarray(state["prompt_lengths"]), np.asarray(state["lengths"])
        held, rows = len(prompt_lengths), len(lengths)
        if len(state["records"]) != held or rows != held * n or held > extra:
            raise ValueError(
                f"the partial-rollout state has {held} groups, {len(state['records'])} records "
                f"and {rows} rows; n is {n} and at most {extra} groups are held"
            )
        prompts = _split(state["prompt_ids"], prompt_lengths, "prompt_ids")
        tokens = _split(state["tokens"], lengths, "tokens")
        logprobs = _split(state["logprobs"], lengths, "logprobs")
        untruncated = _split(state["untruncated"], lengths, "untruncated")
        keys, finished = np.asarray(state["keys"]), np.asarray(state["finished"])
        versions = np.asarray(state["versions"])
        if keys.shape != (rows, 3) or finished.shape != (rows,) or versions.shape != (rows,):
            raise ValueError(f"keys, finished and versions must cover the state's {rows} rows")
        observed, turns, episodes = _turn_state(state, rows, held)
        carries = [
            Carry(tuple(t), tuple(lp), tuple(u), *(int(k) for k in key), bool(f), obs, int(turn))
            for t, lp, u, key, f, obs, turn in zip(
                tokens, logprobs, untruncated, keys, finished, observed, turns, strict=True
            )
        ]
        buffer.held = tuple(
            HeldGroup(
                tuple(prompts[g]),
                PromptRecord(**state["records"][g]),
                tuple(carries[g * n : (g + 1) * n]),
                tuple(int(v) for v in versions[g * n : (g + 1) * n]),
                None if episodes[g] is None else tuple(episodes[g]),
            )
            for g in range(held)
        )
        return buffer

    def to_json(self) -> Any:
        """:meth:`state_dict` as a JSON value (see the module docstring)."""
        return pack(self.state_dict())

    @classmethod
    def from_json(cls, doc: Any) -> PartialRollouts:
        """The buffer :meth:`to_json` saved.

        Raises:
          ValueError: a document that is not such a state.
        """
        state = unpack(doc)
        if not isinstance(state, dict):
            raise ValueError("the partial-rollout state is not a JSON state of the buffer")
        return cls.from_state_dict(state)


_STATE_KEYS = (
    "config",
    "version",
    "prompt_ids",
    "prompt_lengths",
    "records",
    "tokens",
    "logprobs",
    "untruncated",
    "lengths",
    "keys",
    "finished",
    "versions",
)


def _episode_state(episode) -> dict:
    """A held episode as its state (a live one's :meth:`state`; a restored state as it is)."""
    return episode if isinstance(episode, dict) else episode.state()


def _turn_state(state: dict, rows: int, groups: int):
    """The multi-turn entries of a state: per row its observations and turns, per group its
    episodes' states (None: single-turn); a state saved without them has none."""
    counts = np.asarray(state.get("observed_counts", np.zeros(rows, np.int64)))
    turns = np.asarray(state.get("turns", np.zeros(rows, np.int64)))
    spans = np.asarray(state.get("observed", np.zeros((0, 2), np.int64))).reshape(-1, 2)
    episodes = state.get("episodes", [None] * groups)
    if counts.shape != (rows,) or turns.shape != (rows,) or len(spans) != counts.sum():
        raise ValueError(f"observed_counts and turns must cover the state's {rows} rows")
    if len(episodes) != groups:
        raise ValueError(f"episodes has {len(episodes)} entries for {groups} groups")
    ends = np.cumsum(counts)
    observed = [
        tuple((int(a), int(b)) for a, b in spans[end - c : end])
        for c, end in zip(counts, ends, strict=True)
    ]
    return observed, turns.tolist(), episodes


def _finished(ids, record, rows, output: SamplerOutput, versions, trained: int) -> FinishedGroup:
    return FinishedGroup(
        prompt_ids=tuple(ids),
        record=record,
        rows=rows,
        tokens=[output.tokens[r] for r in rows],
        logprobs=[output.logprobs[r] for r in rows],
        untruncated_logprobs=[output.untruncated_logprobs[r] for r in rows],
        versions=versions,
        staleness=trained - min(versions),
    )


def _versions(old: tuple[int, ...] | None, lengths: list[int], version: int) -> tuple[int, ...]:
    """Each row's first-token version after a call at ``version``: a carried row's own when it
    had a token before (``old``), else ``version`` when it has one now."""
    old = old or (NO_TOKEN,) * len(lengths)
    return tuple(
        v if v != NO_TOKEN else (version if size else NO_TOKEN)
        for v, size in zip(old, lengths, strict=True)
    )


def _flat(lists, dtype) -> np.ndarray:
    """Ragged lists as one flat array (their lengths kept beside it)."""
    return np.asarray([x for values in lists for x in values], dtype)


def _split(flat, lengths: np.ndarray, name: str) -> list[list]:
    """The lists :func:`_flat` joined, as Python values."""
    flat = np.asarray(flat)
    if flat.ndim != 1 or flat.size != int(lengths.sum()) or (lengths < 0).any():
        raise ValueError(f"{name} holds {flat.size} values; its lengths sum to {lengths.sum()}")
    ends = np.cumsum(lengths)
    return [flat[end - size : end].tolist() for size, end in zip(lengths, ends, strict=True)]
