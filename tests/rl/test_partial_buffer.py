"""The buffer of partial groups (:mod:`delta_jax.rl.partial`) over the continuous engine: the
groups each call returns are whole and are those uninterrupted calls draw; the others are carried
into the next call; groups too stale are dropped and their prompts sampled again; the state
round-trips exactly and continues to the same results; bad input is refused.

One tiny model and one request shape (4 groups of 2 samples on 4 slots, so that rows also wait
unstarted in the queue when a quota stops a call)."""

import copy
import dataclasses

import numpy as np
import pytest

from delta_jax.data import PromptRecord
from delta_jax.rl.partial import PartialRollouts
from delta_jax.sampling import Sampler
from tests.sampling.helpers import peaked_model

N, GROUPS, EXTRA = 2, 2, 2
STOPS = [11, 40]  # sampled rows end at these ids too: some end early, some run to the budget
REQUEST = dict(max_new_tokens=24, temperature=1.0, stop_token_ids=STOPS)
_rng = np.random.default_rng(5)
PAIRS = [
    (_rng.integers(1, 96, int(_rng.integers(3, 10))).tolist(), PromptRecord(f"q{i}", str(i), row=i))
    for i in range(40)
]


@pytest.fixture(scope="module")
def sampler():
    return Sampler(
        peaked_model(),
        engine="continuous",
        stop_token_ids=(),
        decode_slots=4,
        page_size=4,
        decode_chunk=4,
    )


class Source:
    """The training prompts in order; counts what was handed out."""

    def __init__(self):
        self.given = 0

    def take(self, count: int) -> list:
        out = PAIRS[self.given : self.given + count]
        self.given += count
        return out


def call(buffer, sampler, source, *, version: int, seed: int):
    """One planned call: ``(plan, output, groups returned, statistics)``."""
    plan = buffer.plan(source.take(buffer.fresh_needed), version=version, seed=seed)
    out = sampler.generate(plan.prompts, **REQUEST, **plan.generate_kwargs())
    groups, stats = buffer.take(plan, out)
    return plan, out, groups, stats


def test_groups_come_back_whole_as_uninterrupted_calls_draw_them(sampler):
    """Five calls at rising versions: each returns GROUPS whole groups and keeps EXTRA; every
    returned group equals the rows of an uninterrupted call with its seed and position; no
    prompt is lost or returned twice."""
    buffer, source = PartialRollouts(N, GROUPS, EXTRA), Source()
    origin, returned, carried_tokens, ages = {}, [], 0, set()
    for c in range(5):
        plan, out, groups, stats = call(buffer, sampler, source, version=c, seed=100 + c)
        assert plan.quota == GROUPS and len(plan.prompts) == GROUPS + EXTRA
        for p in range(len(plan.carried_groups), len(plan.prompts)):  # fresh here
            origin[plan.records[p].row] = (plan, p)
        assert len(groups) == stats.returned == GROUPS
        assert stats.carried == len(buffer.held) == EXTRA and stats.finished >= GROUPS
        assert stats.carried_tokens == sum(len(r.tokens) for g in buffer.held for r in g.rows)
        assert sum(stats.staleness.values()) == GROUPS
        for group in groups:
            assert out.finished_array[group.rows].all() and len(group.rows) == N
            assert group.tokens == [out.tokens[r] for r in group.rows]
            assert group.staleness == c - min(group.versions)
            ages.add(group.staleness)
        returned += groups
        carried_tokens += stats.carried_tokens
        assert buffer.version == c
    assert carried_tokens > 0 and max(ages) >= 1  # groups were carried mid-way, across versions
    uninterrupted = {}  # by seed: the plan's prompts, every row to its end
    for group in returned:
        plan, p = origin[group.record.row]
        if plan.seed not in uninterrupted:
            uninterrupted[plan.seed] = sampler.generate(
                plan.prompts, n=N, seed=plan.seed, **REQUEST
            )
        full = uninterrupted[plan.seed]
        rows = range(p * N, (p + 1) * N)
        assert group.tokens == [full.tokens[r] for r in rows]
        for got, want in zip(group.logprobs, (full.logprobs[r] for r in rows), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)  # see test_partial.py
    seen = [g.record.row for g in returned] + [g.record.row for g in buffer.held]
    assert sorted(seen) == list(range(source.given))


def test_stale_groups_are_dropped_and_their_prompts_sampled_again(sampler):
    buffer, source = PartialRollouts(N, GROUPS, EXTRA, max_staleness=1), Source()
    call(buffer, sampler, source, version=0, seed=7)
    _, _, _, stats = call(buffer, sampler, source, version=1, seed=8)  # 1 behind: kept
    assert stats.dropped == 0
    held = buffer.held
    stale = [g for g in held if g.oldest is not None]  # 3 - oldest >= 2 for all of them
    assert stale, "no held group has a token: pick another seed"
    plan, out, groups, stats = call(buffer, sampler, source, version=3, seed=9)
    assert plan.dropped == stats.dropped == len(stale)
    kept = [g for g in held if g.oldest is None]
    assert list(plan.carried_groups) == kept
    # The dropped prompts follow the kept groups, as fresh rows, before the new prompts.
    again = slice(len(kept), len(kept) + len(stale))
    assert plan.records[again] == [g.record for g in stale]
    assert plan.prompts[again] == [list(g.prompt_ids) for g in stale]
    assert all(c is None for c in (plan.carried or [None] * 99)[len(kept) * N :])
    assert out.key_array[len(kept) * N].tolist() == [9, len(kept), 0]
    assert all(g.staleness <= 1 for g in groups)


def test_a_lag_counts_the_updates_before_a_call_s_groups_are_trained(sampler):
    """An asynchronous run samples one update ahead (lag 1): the same calls as the test above,
    but a returned group's staleness and the bound count the update between the call and the
    one that trains it, so the groups that test kept at version 1 are dropped here."""
    buffer, source = PartialRollouts(N, GROUPS, EXTRA, max_staleness=1), Source()
    plan = buffer.plan(source.take(buffer.fresh_needed), version=0, seed=7, lag=1)
    groups, stats = buffer.take(
        plan, sampler.generate(plan.prompts, **REQUEST, **plan.generate_kwargs())
    )
    assert plan.lag == 1 and stats.staleness == {1: GROUPS}  # fresh tokens, trained a version on
    assert [g.staleness for g in groups] == [1] * GROUPS
    started = [g for g in buffer.held if g.oldest is not None]
    assert started, "no held group has a token: pick another seed"
    with pytest.raises(ValueError, match="lag 2 is above max_staleness 1: nothing could be"):
        buffer.plan(PAIRS[30 : 30 + buffer.fresh_needed], version=1, seed=8, lag=2)
    plan = buffer.plan(source.take(buffer.fresh_needed), version=1, seed=8, lag=1)
    assert plan.dropped == len(started)  # 1 + 1 - 0 = 2 versions behind the update
    assert list(plan.carried_groups) == [g for g in buffer.held if g.oldest is None]


def test_state_round_trip_continues_to_the_same_results(sampler):
    buffer, source = PartialRollouts(N, GROUPS, EXTRA, max_staleness=3), Source()
    for c in range(2):
        call(buffer, sampler, source, version=c, seed=20 + c)
    state = buffer.state_dict()
    restored = PartialRollouts.from_state_dict(copy.deepcopy(state))
    assert restored.held == buffer.held and restored.version == buffer.version
    assert (restored.n, restored.groups, restored.extra, restored.max_staleness) == (N, 2, 2, 3)
    again = restored.state_dict()
    assert state.keys() == again.keys()
    for key, value in state.items():
        if isinstance(value, np.ndarray):
            assert value.dtype == again[key].dtype
            np.testing.assert_array_equal(value, again[key])
        else:
            assert value == again[key]
    twin = copy.copy(source)
    first = call(buffer, sampler, source, version=2, seed=30)
    second = call(restored, sampler, twin, version=2, seed=30)
    assert first[0].prompts == second[0].prompts and first[0].carried == second[0].carried
    assert [g.tokens for g in first[2]] == [g.tokens for g in second[2]]
    assert [g.logprobs for g in first[2]] == [g.logprobs for g in second[2]]
    assert restored.held == buffer.held


def test_without_over_provision_every_group_runs_to_its_end(sampler):
    buffer, source = PartialRollouts(N, GROUPS + EXTRA, 0), Source()
    plan, out, groups, stats = call(buffer, sampler, source, version=0, seed=3)
    assert plan.quota is None and plan.carried is None
    assert out.finished_array.all() and len(groups) == GROUPS + EXTRA and not buffer.held
    assert stats.carried == stats.carried_tokens == 0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(n=0, groups=1, extra=0), "n must be an int >= 1"),
        (dict(n=2, groups=0, extra=0), "groups must be an int >= 1"),
        (dict(n=2, groups=1, extra=-1), "extra must be an int >= 0"),
        (dict(n=2, groups=1, extra=1.0), "extra must be an int"),
        (dict(n=2, groups=1, extra=1, max_staleness=-1), "max_staleness must be an int >= 0"),
        (dict(n=True, groups=1, extra=1), "n must be an int"),
    ],
)
def test_bad_settings_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        PartialRollouts(**kw)


def test_bad_plans_and_outputs_are_refused(sampler):
    buffer, source = PartialRollouts(N, GROUPS, EXTRA), Source()
    with pytest.raises(ValueError, match=r"plan needs 4 new prompts \(4 groups, 0 held\), got 3"):
        buffer.plan(PAIRS[:3], version=0, seed=1)
    with pytest.raises(ValueError, match=r"fresh\[1\]: the record must be a PromptRecord"):
        buffer.plan([PAIRS[0], ([1, 2], {"prompt": "x"}), *PAIRS[2:4]], version=0, seed=1)
    with pytest.raises(ValueError, match="seed must be a uint32"):
        buffer.plan(PAIRS[:4], version=0, seed=2**32)
    plan, out, _, _ = call(buffer, sampler, source, version=3, seed=1)
    with pytest.raises(ValueError, match="take each plan once"):
        buffer.take(plan, out)
    with pytest.raises(ValueError, match=r"version 2 is below the last call's \(3\)"):
        buffer.plan(PAIRS[4:6], version=2, seed=5)
    with pytest.raises(ValueError, match="seed 1 was the seed of a carried row"):
        buffer.plan(PAIRS[4:6], version=3, seed=1)
    held, plan = buffer.held, buffer.plan(PAIRS[4:6], version=3, seed=2)
    fresh = sampler.generate(plan.prompts, n=N, seed=2, **REQUEST)  # the carried rows not given
    with pytest.raises(ValueError, match="not drawn as the plan says"):
        buffer.take(plan, fresh)
    short = sampler.generate(plan.prompts[:3], n=N, seed=2, **REQUEST)
    with pytest.raises(ValueError, match="the output has 6 rows; the plan has 8"):
        buffer.take(plan, short)
    out = sampler.generate(plan.prompts, **REQUEST, **plan.generate_kwargs())
    static = dataclasses.replace(out, finished_array=None, key_array=None)  # as the static gives
    with pytest.raises(ValueError, match="needs the output of Sampler.engine='continuous'."):
        buffer.take(plan, static)
    assert buffer.held is held  # the refused outputs changed nothing
    buffer.take(plan, out)


def test_bad_states_are_refused():
    state = PartialRollouts(N, GROUPS, EXTRA).state_dict()
    with pytest.raises(ValueError, match="lacks keys, versions"):
        PartialRollouts.from_state_dict(
            {k: v for k, v in state.items() if k not in ("keys", "versions")}
        )
    broken = {
        **state,
        "prompt_lengths": np.asarray([3]),
        "records": [{"prompt": "a", "answer": None}],
    }
    with pytest.raises(ValueError, match="has 1 groups, 1 records and 0 rows"):
        PartialRollouts.from_state_dict(broken)


def test_a_state_whose_arrays_disagree_is_refused(sampler):
    buffer, source = PartialRollouts(N, GROUPS, EXTRA), Source()
    call(buffer, sampler, source, version=0, seed=1)
    state = buffer.state_dict()
    cut = {**state, "logprobs": state["logprobs"][:-1]}
    with pytest.raises(ValueError, match="logprobs holds"):
        PartialRollouts.from_state_dict(cut)
    with pytest.raises(ValueError, match="keys, finished and versions must cover"):
        PartialRollouts.from_state_dict({**state, "versions": state["versions"][:-1]})
    with pytest.raises(ValueError, match="observed_counts and turns must cover"):
        PartialRollouts.from_state_dict({**state, "turns": state["turns"][:-1]})
    with pytest.raises(ValueError, match="episodes has 1 entries for 2 groups"):
        PartialRollouts.from_state_dict({**state, "episodes": [None]})
    # A state saved before multi-turn rows were carried (no such entries): single-turn rows.
    multi_turn = ("observed", "observed_counts", "turns", "episodes")
    old = PartialRollouts.from_state_dict({k: v for k, v in state.items() if k not in multi_turn})
    assert old.held == buffer.held
