"""Speculative rollouts in the continuous engine: drafts from the rollout's own text, verified
several tokens per step, change how fast tokens come and never which.

References: the engine without speculation (itself tested against ``transformers`` and full
forwards), and the model's exact next-token law (float64 NumPy) for a goodness-of-fit test of
the tokens drawn at drafted positions.
"""

import collections

import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax.sampling import Sampler
from delta_jax.sampling.speculation.auto_speculation import AutoSpeculation
from delta_jax.sampling.speculation.speculate import DRAFT_OUTCOMES
from tests.sampling.helpers import chisquare_pvalue, peaked_model, truncated_distribution
from tests.sampling.test_sampler import ATOL, _forward

PROMPTS = [[5, 9, 2, 17], [7, 1, 4, 4, 8, 3], [20], [3, 3, 6, 2, 9], list(range(30, 43))]
BUDGETS = [14, 9, 17, 12, 15]


@pytest.fixture(scope="module")
def model():
    return peaked_model()


def engine(model, **kw) -> Sampler:
    kw = {"decode_slots": 4, "page_size": 4, "decode_chunk": 4, "attention": "xla", **kw}
    return Sampler(model, stop_token_ids=(), engine="continuous", **kw)


# The reference without speculation, one sampler for the module: its compiled programs are
# reused. A sampler that speculates is never shared: it keeps earlier requests' rollouts as
# drafts, so its outputs' statistics depend on what it ran before.
@pytest.fixture(scope="module")
def plain(model):
    return engine(model)


SAMPLED = dict(max_new_tokens=BUDGETS, n=3, temperature=0.5, seed=5, return_hidden=True)


@pytest.fixture(scope="module")
def plain_sampled(plain):
    """The rollout of ``SAMPLED`` without drafts, the reference of every draft layout."""
    return plain.generate(PROMPTS, **SAMPLED)


def _same_outputs(a, b):
    """Same tokens; log-probs and hidden states within the whole-model tolerance (``ATOL``: a
    verify step attends for several positions at once, another order of float32 sums; in
    float64, ``tests/sampling/test_x64.py`` checks them against the full forward to 1e-9)."""
    assert a.tokens == b.tokens
    for name in ("logprob_array", "untruncated_logprob_array", "hidden_array"):
        np.testing.assert_allclose(
            np.asarray(getattr(a, name)), np.asarray(getattr(b, name)), atol=ATOL, err_msg=name
        )


# A line of 3 drafted tokens per verify step on the XLA and the dense path; tries of 3 nodes
# up to 2 deep (on both) and of 6 nodes up to 3 deep.
DRAFTS = {
    "xla": ("xla", 3, 0),
    "dense": ("dense", 3, 0),
    "xla-trie": ("xla", 3, 2),
    "dense-trie": ("dense", 3, 2),
    "trie6": ("dense", 6, 3),
}


@pytest.mark.parametrize("drafts", ["xla", "dense", "xla-trie", "dense-trie"])
def test_same_tokens_log_probs_and_hidden_states_with_and_without_drafts(
    model, plain_sampled, drafts
):
    """Sampled: 4 slots for 15 sequences (slots refilled) and a pool small enough to preempt:
    the same outputs as decoding one token per step, in fewer verify steps than tokens, on the
    XLA path and on the dense CPU path (whose views hold a verify step's rejected tokens in
    columns no later query sees), with a line or a trie of drafts. (Greedy:
    ``test_drafts_come_from_siblings_and_earlier_requests`` and ``test_x64.py``; the TPU
    kernel: ``test_pallas_interpret.py``.)"""
    attention, k, depth = DRAFTS[drafts]
    kw, plain = SAMPLED, plain_sampled
    spec = dict(speculate=True, draft_tokens=k, draft_depth=depth, attention=attention)
    tight = engine(model, num_pages=13, **spec)
    tight = tight.generate(PROMPTS, **kw)
    _same_outputs(plain, tight)
    stats = tight.engine_stats
    assert stats.preemptions > 0 and plain.engine_stats.preemptions == 0
    # A preempted sequence's tokens are drawn again: the engine counts them again.
    assert stats.useful_steps > sum(BUDGETS) * 3
    accepted, drafted = sum(stats.accepted.values()), sum(stats.drafted.values())
    assert 0 < accepted < drafted  # drafts were accepted and rejected
    assert stats.verify_steps < stats.useful_steps
    roomy = engine(model, decode_slots=16, **spec)
    roomy = roomy.generate(PROMPTS, **kw)
    _same_outputs(plain, roomy)
    s = roomy.engine_stats
    # A live slot's verify step emits one token and each accepted draft.
    assert s.verify_steps + sum(s.accepted.values()) == s.useful_steps == sum(BUDGETS) * 3
    assert s.tokens_per_verify_step > 1
    # Each token's draft outcome: the accepted drafts are the engine's count; a verify step
    # rejects at most one drafted token at an emitted index (the rest it scored lie past it).
    outcome = np.asarray(roomy.drafted_array)
    assert plain.drafted_array is None and outcome.dtype == np.int8
    assert (outcome == DRAFT_OUTCOMES["accepted"]).sum() == sum(s.accepted.values())
    rejected = (outcome == DRAFT_OUTCOMES["rejected"]).sum()
    assert 0 < rejected <= sum(s.drafted.values()) - sum(s.accepted.values())
    lengths = np.asarray(roomy.lengths)
    assert not outcome[np.arange(outcome.shape[1]) >= lengths[:, None]].any()


def test_drafts_come_from_siblings_and_earlier_requests(model, plain):
    """A request's samples draft from each other (4 slots for 8 sequences: the samples with
    the smaller budgets start after the others and follow their text); the same prompts
    requested again draft from the first request's rollouts (greedy: the very same text),
    kept by the sampler. On the dense CPU path, what ``attention="auto"`` picks on CPU."""
    sampler = engine(model, decode_slots=4, speculate=True, draft_tokens=4, attention="auto")
    kw = dict(max_new_tokens=[12, 24, 12, 24] * 2, n=4, temperature=0.0)
    first = sampler.generate(PROMPTS[:2], **kw)
    again = sampler.generate(PROMPTS[:2], **kw)
    assert again.tokens == first.tokens == plain.generate(PROMPTS[:2], **kw).tokens
    assert first.engine_stats.accepted["siblings"] > 0
    assert first.engine_stats.accepted["history"] == 0
    assert again.engine_stats.accepted["history"] > 0
    assert again.engine_stats.tokens_per_verify_step > first.engine_stats.tokens_per_verify_step
    # Greedy on a text it has seen: nearly every draft is accepted.
    assert again.engine_stats.tokens_per_verify_step > 3.0


@pytest.mark.parametrize("drafts", ["xla", "trie6"])
def test_drawn_tokens_at_drafted_positions_follow_the_models_law(model, drafts):
    """Goodness of fit at drafted positions: 512 samples of one prompt, drafted from the
    history of an earlier request (another seed), so most positions after the first are
    verified drafts (a line of them, or a trie: several drafted tokens at one index). The
    second and third tokens after the modal prefix are tested against the model's exact law
    given that prefix (chi-square, significance level 1e-3), and against a wrong law (the
    first position's), which the test must reject."""
    prompt = [3, 1, 4, 1, 5]
    kw = dict(temperature=1.0, top_k=8)
    attention, k, depth = DRAFTS[drafts]
    spec = dict(speculate=True, draft_tokens=k, draft_depth=depth, attention=attention)
    sampler = engine(model, decode_slots=64, decode_chunk=3, **spec)
    sampler.generate([prompt], max_new_tokens=3, n=64, seed=1, **kw)  # the history
    out = sampler.generate([prompt] * 8, max_new_tokens=3, n=64, seed=2, **kw)
    stats = out.engine_stats
    assert stats.accepted["history"] > 100 and stats.drafted["history"] > stats.accepted["history"]
    tokens = np.asarray(out.token_array)[:, :3]

    def law(prefix):
        ids = jnp.asarray([prompt + prefix], jnp.int32)
        logits = np.asarray(_forward(model, ids, jnp.ones_like(ids, bool))[0][0, -1], np.float64)
        return truncated_distribution(logits, **kw)

    first = collections.Counter(tokens[:, 0].tolist()).most_common(1)[0][0]
    rows = tokens[tokens[:, 0] == first]
    assert len(rows) > 100
    assert chisquare_pvalue(rows[:, 1], law([first])) > 1e-3
    assert chisquare_pvalue(rows[:, 1], law([])) < 1e-6  # the test has power
    second = collections.Counter(rows[:, 1].tolist()).most_common(1)[0][0]
    rows = rows[rows[:, 1] == second]
    assert len(rows) > 50
    assert chisquare_pvalue(rows[:, 2], law([first, second])) > 1e-3


def test_a_tight_pool_never_preempts_an_older_sequence_for_a_younger_one(model, plain, monkeypatch):
    """Two samples of a long answer on a pool that holds one of them and the chunks' pages
    ahead (a verify step's 7 per step): the younger one, not the one growing, gives way, so the
    oldest always runs and the call ends (before, the two preempted each other in turn and the
    call never ended: bounded here by the chunks run), with plain decoding's tokens."""
    from delta_jax.sampling.engine import scheduler

    chunks, decode = [0], scheduler.Scheduler._decode

    def bounded(self, state, steps):
        chunks[0] += 1
        assert chunks[0] < 400, "the engine ran 400 chunks: sequences preempt each other"
        return decode(self, state, steps)

    monkeypatch.setattr(scheduler.Scheduler, "_decode", bounded)
    kw = dict(max_new_tokens=[14, 9, 40, 12, 15], n=3, temperature=0.5, seed=5)
    plain = plain.generate(PROMPTS, **kw)
    tight = engine(model, num_pages=20, speculate=True, draft_tokens=6).generate(PROMPTS, **kw)
    assert tight.tokens == plain.tokens
    assert tight.engine_stats.preemptions > 0


def test_speculative_decoding_is_refused_where_it_cannot_run(model):
    with pytest.raises(ValueError, match="needs engine='continuous'"):
        Sampler(model, speculate=True)
    with pytest.raises(ValueError, match="draft_tokens must be an int >= 0"):
        engine(model, speculate=True, draft_tokens=-1)
    for speculate in (True, "auto"):
        with pytest.raises(ValueError, match="needs draft_tokens >= 1, got 0"):
            engine(model, speculate=speculate, draft_tokens=0)
    with pytest.raises(ValueError, match=r"draft_depth must be an int in \[0, draft_tokens=3\]"):
        engine(model, speculate=True, draft_tokens=3, draft_depth=4)
    with pytest.raises(ValueError, match="speculate must be True, False or 'auto'"):
        engine(model, speculate="sometimes")
    # Without speculation the drafts' fields are not used (a run's config holds them anyway).
    plain = Sampler(model, speculate=False, draft_tokens=4, draft_depth=9)
    assert (plain.speculate, plain.draft_tokens, plain.draft_depth) == (False, 0, 0)
    assert engine(model, speculate=True).draft_tokens == 4  # the config's default


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (dict(draft_tokens=3), dict(speculate=True, draft_tokens=3)),
        (dict(draft_tokens=3, speculate="always"), dict(speculate=True, draft_tokens=3)),
        (dict(speculate="always"), dict(speculate=True)),
    ],
    ids=["draft_tokens-alone", "always-with-draft_tokens", "always"],
)
def test_the_earlier_spellings_warn_and_speculate_as_before(model, old, new):
    """``Sampler(draft_tokens=k)`` without ``speculate``, and ``speculate="always"``, speculate
    for one more release, with a ``DeprecationWarning`` at the caller's line."""
    with pytest.warns(DeprecationWarning, match="pass speculate=True instead") as caught:
        sampler = engine(model, **old)
    assert {w.filename for w in caught} == {__file__}
    kw = dict(max_new_tokens=BUDGETS[:2], n=3, temperature=0.0)
    out, want = (
        sampler.generate(PROMPTS[:2], **kw),
        engine(model, **new).generate(PROMPTS[:2], **kw),
    )
    assert (sampler.speculate, sampler.draft_tokens) == (True, new.get("draft_tokens", 4))
    assert out.tokens == want.tokens and out.engine_stats.speculative
    assert out.engine_stats.verify_steps == want.engine_stats.verify_steps > 0


def test_auto_measures_both_ways_then_runs_the_faster_and_probes_the_other():
    auto = AutoSpeculation("tpu", probe_every=4)
    ways = []

    def request(seconds_per_token):
        way = auto.next()
        ways.append(way)
        auto.record(way, seconds_per_token[way] * 100, 100)

    for _ in range(10):  # speculation twice as fast
        request({True: 1.0, False: 2.0})
    # Each way twice (a first request compiles, then one measured), then the faster one, the
    # other every 4th request.
    assert ways == [True, True, False, False, True, True, True, False, True, True]
    assert auto.seconds_per_token == {True: 1.0, False: 2.0}
    for _ in range(6):  # the acceptance falls: speculation now slower
        request({True: 3.0, False: 2.0})
    # Its running mean passes the plain one's after two requests (1 -> 2 -> 2.5): plain runs,
    # speculation only as the probe.
    assert ways[10:] == [True, False, True, False, False, True]
    assert not auto.faster() and auto.seconds_per_token[True] > 2.0
    cpu = AutoSpeculation("cpu")
    assert not any(cpu.next() for _ in range(20))


def test_auto_never_speculates_on_cpu_and_switches_per_request_elsewhere(model, plain):
    kw = dict(max_new_tokens=12, n=4, temperature=0.0)
    plain = plain.generate(PROMPTS[:2], **kw)
    sampler = engine(model, draft_tokens=3, speculate="auto")
    out = sampler.generate(PROMPTS[:2], **kw)
    assert out.tokens == plain.tokens
    assert out.engine_stats.speculative is False and out.engine_stats.verify_steps == 0
    assert plain.engine_stats.speculative is None  # no drafts at all
    # The accelerators' policy, run here: each way twice, then the faster one; the same tokens
    # whichever way a request goes.
    sampler._speculation.auto = auto = AutoSpeculation("gpu")
    ways, faster = [], []
    for _ in range(5):
        faster.append(auto.faster())
        out = sampler.generate(PROMPTS[:2], **kw)
        assert out.tokens == plain.tokens
        ways.append(out.engine_stats.speculative)
        assert (out.engine_stats.verify_steps > 0) == out.engine_stats.speculative
    assert ways == [True, True, False, False, faster[4]]
