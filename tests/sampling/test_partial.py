"""Partial rollouts in the continuous engine: a ``quota`` of finished prompts stops a call early
and returns the other rows unfinished (their pages freed); a later call continues them
(``carried``) to exactly the tokens an uninterrupted call draws, beside fresh prompts, with
another slot count, speculating or not; rows that had ended pass through; bad requests are
refused before any compilation."""

import dataclasses

import jax
import numpy as np
import pytest

from delta_jax.sampling import Carry, Sampler, Turns
from tests.sampling.helpers import peaked_model

# Prompt lengths around page boundaries (page_size 4), budgets long enough that a quota met
# early leaves several rows mid-way.
PROMPTS = [[5, 9, 2, 17], [7, 1, 4, 4, 8, 3], [20], [3, 3, 6, 2, 9], list(range(30, 43))]
BUDGETS = [18, 6, 28, 12, 22]
N = 2
STOPS = [11, 40]  # sampled rows end at these ids too, so some end early and some run on
SEED = 2**31 + 11  # its int32 bits are negative: the seed goes through the slots as bits


def engine(model, **kw) -> Sampler:
    kw = {"decode_slots": 8, "page_size": 4, "decode_chunk": 4, **kw}
    return Sampler(model, stop_token_ids=(), engine="continuous", **kw)


@pytest.fixture(scope="module")
def model():
    return peaked_model()


@pytest.fixture(scope="module")
def sampler(model):
    return engine(model)


@pytest.fixture(scope="module")
def speculative(model):
    return engine(model, speculate=True, draft_tokens=2)


def _request(greedy: bool) -> dict:
    if greedy:
        return dict(max_new_tokens=BUDGETS, n=N, temperature=0.0)
    return dict(max_new_tokens=BUDGETS, n=N, temperature=1.0, seed=SEED, stop_token_ids=STOPS)


def _check_stopped(out, full, quota: int, seed: int) -> None:
    """``out`` (a call stopped by ``quota``) against the uninterrupted ``full``: ended rows are
    its rows, unfinished ones prefixes of them; at least ``quota`` prompts ended whole."""
    finished = out.finished_array.tolist()
    assert len(finished) == len(PROMPTS) * N
    whole = [all(finished[i * N : (i + 1) * N]) for i in range(len(PROMPTS))]
    assert sum(whole) >= quota
    for r, done in enumerate(finished):
        if done:
            assert out.tokens[r] == full.tokens[r]
        else:
            assert out.tokens[r] == full.tokens[r][: out.lengths[r]]
            assert out.lengths[r] < full.lengths[r]
    stats = out.engine_stats
    assert stats.unfinished == finished.count(False)
    assert stats.free_pages_after == (stats.group_pages - 1,)  # every page freed (scratch kept)
    assert out.key_array.tolist() == [[seed, r // N, r % N] for r in range(len(PROMPTS) * N)]


def _check_continued(out, full) -> None:
    assert out.finished_array.all()
    assert out.lengths == full.lengths
    assert out.tokens == full.tokens
    for got, want in (
        (out.logprobs, full.logprobs),
        (out.untruncated_logprobs, full.untruncated_logprobs),
    ):
        for g, w in zip(got, want, strict=True):
            # The carried prefix's K/V come from the prefill program, not the decode steps: the
            # same values up to float32 rounding (1e-5 absolute plus 1e-5 relative; -4.49 came
            # out 1.05e-5 apart at seed 2**31 + 11).
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_quota_stops_and_carried_rows_continue_as_uninterrupted(sampler, greedy):
    request = _request(greedy)
    full = sampler.generate(PROMPTS, **request)
    stopped = sampler.generate(PROMPTS, quota=1, **request)
    _check_stopped(stopped, full, quota=1, seed=request.get("seed", 0))
    # Several rows stopped mid-way, not only at their start.
    mid = [r for r in range(len(PROMPTS) * N) if 0 < stopped.lengths[r] < full.lengths[r]]
    assert len(mid) >= 3, stopped.lengths
    assert not stopped.finished_array.all()
    carried = [stopped.carry(r) for r in range(len(PROMPTS) * N)]
    out = sampler.generate(PROMPTS, carried=carried, **request)
    _check_continued(out, full)
    # Rows that had ended pass through exactly, log-probs included.
    for r, carry in enumerate(carried):
        if carry.finished:
            assert out.logprobs[r] == list(carry.logprobs)


def test_carried_rows_continue_in_rounds_beside_fresh_prompts_with_other_slots(model, sampler):
    """Carried rows continue at other rows of a request with a fresh prompt first, on a sampler
    with another slot count, over two stopped calls; the fresh rows draw as in a call alone."""
    request = _request(greedy=False)
    full = sampler.generate(PROMPTS, **request)
    first = sampler.generate(PROMPTS, quota=1, **request)
    other = engine(model, decode_slots=3, num_pages=16)  # tight: sequences are preempted
    extra = [[8, 8, 1]]
    budgets = [10] + BUDGETS
    carried = [None] * N + [first.carry(r) for r in range(len(PROMPTS) * N)]
    second = other.generate(
        extra + PROMPTS, **{**request, "max_new_tokens": budgets}, carried=carried, quota=3
    )
    assert not second.finished_array.all()
    carried = [None] * N + [second.carry(r) for r in range(N, (len(PROMPTS) + 1) * N)]
    fresh = second.carry(0), second.carry(1)
    assert [c.prompt for c in fresh] == [0, 0]
    third = other.generate(
        extra + PROMPTS, **{**request, "max_new_tokens": budgets}, carried=list(fresh) + carried[N:]
    )
    assert third.finished_array.all()
    assert second.engine_stats.preemptions  # carried rows preempted and prefilled again
    assert third.tokens[N:] == full.tokens
    assert third.lengths[N:] == full.lengths
    alone = other.generate(extra, **{**request, "max_new_tokens": 10})
    assert third.tokens[:N] == alone.tokens


def test_speculative_continuation_equals_uninterrupted(speculative):
    request = _request(greedy=True)
    full = speculative.generate(PROMPTS, **request)
    stopped = speculative.generate(PROMPTS, quota=2, **request)
    assert stopped.engine_stats.speculative
    _check_stopped(stopped, full, quota=2, seed=0)
    carried = [stopped.carry(r) for r in range(len(PROMPTS) * N)]
    out = speculative.generate(PROMPTS, carried=carried, **request)
    _check_continued(out, full)


def _carry(tokens, finished=False) -> Carry:
    size = len(tokens)
    return Carry(tuple(tokens), (0.0,) * size, (0.0,) * size, 0, 0, 0, finished)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(quota=0), r"quota must be in \[1, 2\]"),
        (dict(quota=3), r"quota must be in \[1, 2\]"),
        (dict(quota=1.0), "quota must be an int"),
        (dict(carried=[None]), "carried has 1 entries; the request has 2 rows"),
        (dict(carried=[None, [1, 2]]), r"carried\[1\] must be a Carry"),
        (dict(carried=[None, _carry([1] * 5)]), r"carried\[1\] has 5 tokens, no room"),
        (dict(carried=[_carry([1] * 6, True), None]), r"carried\[0\] has ended with 6 tokens"),
        (dict(carried=[_carry([], True), None]), r"has ended with 0 tokens"),
        (dict(carried=[_carry([500]), None]), "outside the vocabulary"),
        (
            dict(carried=[Carry((1, 2), (0.0,), (0.0, 0.0), 0, 0, 0), None]),
            "differ in length",
        ),
        (dict(carried=[_carry([1]), None], return_hidden=True), "return_hidden"),
        (
            dict(carried=[dataclasses.replace(_carry([1, 2]), observed=((1, 2),), turns=1), None]),
            r"carried\[0\] has turns or observations; the request is single-turn",
        ),
        (
            dict(
                carried=[dataclasses.replace(_carry([1, 2, 3]), observed=((0, 2),), turns=1), None],
                turns=Turns((3,), 2, lambda row, t: None),
            ),
            "observed must be ordered column ranges",
        ),
        (
            dict(
                carried=[dataclasses.replace(_carry([1, 2, 3]), observed=((1, 2),)), None],
                turns=Turns((3,), 2, lambda row, t: None),
            ),
            "1 observations after 0 turns",
        ),
    ],
)
def test_refusals(sampler, kw, match):
    with pytest.raises(ValueError, match=match):
        sampler.generate([[1, 2, 3], [4, 5]], max_new_tokens=5, **kw)


def test_static_engine_refuses_partial_rollouts(model):
    static = Sampler(model, stop_token_ids=())
    with pytest.raises(ValueError, match="need Sampler.engine='continuous'."):
        static.generate([[1, 2]], max_new_tokens=3, quota=1)
    with pytest.raises(ValueError, match="need Sampler.engine='continuous'."):
        static.generate([[1, 2]], max_new_tokens=3, carried=[_carry([1])])


def test_mesh_data_groups_continue_carried_rows(model, sampler):
    """4 data groups x 2 KV-head shards (2 slots each): rows stopped and carried on the mesh
    (each group writing its carried rows into its own block of the buffers, in rounds of its
    slots) continue to the tokens of one device's uninterrupted call."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "tensor"))
    on_mesh = engine(model, mesh=mesh)
    request = _request(greedy=False)
    full = sampler.generate(PROMPTS, **request)
    stopped = on_mesh.generate(PROMPTS, quota=2, **request)
    assert not stopped.finished_array.all()
    assert stopped.engine_stats.free_pages_after == (stopped.engine_stats.group_pages - 1,) * 4
    carried = [stopped.carry(r) for r in range(len(PROMPTS) * N)]
    out = on_mesh.generate(PROMPTS, carried=carried, **request)
    _check_continued(out, full)


def test_quota_met_by_rows_that_had_ended_runs_no_chunk(sampler):
    request = _request(greedy=True)
    full = sampler.generate(PROMPTS, **request)
    rows = len(PROMPTS) * N
    carried = [full.carry(r) if r < N else None for r in range(rows)]
    assert all(c.finished for c in carried[:N])
    out = sampler.generate(PROMPTS, quota=1, carried=carried, **request)
    assert out.finished_array.tolist() == [True] * N + [False] * (rows - N)
    assert out.tokens[:N] == full.tokens[:N] and out.lengths[N:] == [0] * (rows - N)
    assert out.logprobs[:N] == full.logprobs[:N]
    assert out.engine_stats.chunks == 0 and out.engine_stats.unfinished == rows - N


def test_a_chunk_ends_at_a_row_s_end_while_rows_wait_for_a_slot(model):
    """3 slots, chunks of up to 8 steps, rows of 9, 5 and 3 tokens running (the longest
    first), one of 2 waiting: with a quota the compiled chunk ends at the first row's end (3
    steps, every slot-step drawing a token) so that the waiting row can take the slot; the
    quota (1) is then met. Without the early end the chunk would run 8 steps, 24 slot-steps
    for 16 tokens."""
    three = engine(model, decode_slots=3, decode_chunk=8)
    prompts, request = [[5, 9], [7, 1], [20], [3, 3]], dict(max_new_tokens=[3, 5, 9, 2], n=1)
    out = three.generate(prompts, quota=1, temperature=0.0, **request)
    stats = out.engine_stats
    assert out.finished_array.tolist() == [True, False, False, False]
    assert (stats.chunks, stats.decode_steps, stats.useful_steps) == (1, 9, 9)
    full = three.generate(prompts, temperature=0.0, **request)
    assert full.engine_stats.occupancy < 1.0  # no quota: chunks run on past a row's end
