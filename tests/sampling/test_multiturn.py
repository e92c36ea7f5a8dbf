"""Multi-turn requests on the continuous engine: a sequence whose turn ends waits for the host's
observation without a decode slot, keeps its pages, and continues in place.

The reference is ``transformers`` greedy ``generate`` re-run on the whole history each turn (an
independent implementation that prefills everything again) and stopped where the turn's ids end
with a stop id or sequence, with the same deterministic environment; tokens must be identical
for fewer slots than episodes, random host latencies and a pool small enough to preempt
sequences (running and waiting) after a hand-over.
"""

import collections
import concurrent.futures
import random
import threading
import time

import numpy as np
import pytest
import torch
import transformers

from delta_jax.envs import StepResult
from delta_jax.models import from_pretrained
from delta_jax.sampling import Sampler, Turns
from tests.sampling.test_hf_parity import CONFIGS, PAD

BUDGET = 40
MAX_TURNS = 4
PROMPTS = [[5, 9, 2, 17], [7, 1, 4, 4, 8, 3, 11, 30, 2, 6], [20], [3, 3, 6, 2, 9, 41, 12], [8, 8]]


def observe(turn: list[int], index: int) -> list[int] | None:
    """A deterministic environment: 1-4 ids from the turn, or None (episode over) at the third
    observation of every other episode."""
    if index == 2 and sum(turn) % 2:
        return None
    s = sum(turn)
    return [(s * 31 + 7 * i) % 100 + 10 for i in range(1 + s % 4)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS["qwen3"]())
    hf = hf.to(torch.float32).eval()
    hf.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp("tiny")
    hf.save_pretrained(path)
    return hf, from_pretrained(path)


def _ends_turn(turn: list[int], stops: list[tuple[int, ...]]) -> bool:
    """The turn's ids end with one of ``stops`` (a stop id is a one-id sequence)."""
    return any(tuple(turn[-len(q) :]) == q for q in stops if len(q) <= len(turn))


class _EndsTurn(transformers.StoppingCriteria):
    """Stops ``generate`` where the ids it generated (after ``start``) end with a stop."""

    def __init__(self, start: int, stops: list[tuple[int, ...]]):
        self.start, self.stops = start, stops

    def __call__(self, input_ids, scores, **kwargs):
        return torch.tensor([_ends_turn(input_ids[0, self.start :].tolist(), self.stops)])


def _hf_greedy(hf, context: list[int], max_new: int, stops=()) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor([context]),
            attention_mask=torch.ones(1, len(context), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=None,
            stopping_criteria=transformers.StoppingCriteriaList([_EndsTurn(len(context), stops)]),
        )
    return out[0, len(context) :].tolist()


def _reference(hf, stops: list[tuple[int, ...]]):
    """Episodes by re-prefilling the whole history every turn: tokens, action masks and the
    turns the environment was asked about."""
    tokens, actions, calls = [], [], []
    for prompt in PROMPTS:
        resp, act, asked = [], [], []
        for turn_index in range(MAX_TURNS):
            start = len(resp)
            new = _hf_greedy(hf, prompt + resp, BUDGET - len(resp), stops)
            resp += new
            act += [True] * len(new)
            if not _ends_turn(new, stops) or len(resp) >= BUDGET or turn_index + 1 == MAX_TURNS:
                break
            asked.append(resp[start:])
            obs = observe(resp[start:], turn_index)
            if obs is None or len(obs) >= BUDGET - len(resp):
                break
            resp += obs
            act += [False] * len(obs)
        tokens.append(resp)
        actions.append(act)
        calls.append(asked)
    return tokens, actions, calls


def _turn_stops(hf, case: str) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Stop ids and sequences that greedy decoding reaches (so that turns end), from the first
    ids it writes after each prompt: the id most episodes write, or one episode's first id and
    runs of 2 and 3 ids two others write; plus a sequence that spans one prompt's last id and its
    first generated one, which must never match (prompt ids do not count)."""
    starts = [_hf_greedy(hf, p, 12) for p in PROMPTS]
    if case == "stop_id":
        counts = collections.Counter(t for s in starts for t in set(s))
        return (max(sorted(counts), key=lambda t: counts[t]),), ()
    spanning = (PROMPTS[4][-1], starts[4][0])
    return (starts[0][0],), (tuple(starts[1][4:6]), tuple(starts[2][5:8]), spanning)


class Host:
    """Answers turns in a thread pool after a random delay; records what it was asked."""

    def __init__(self, seed: int):
        self.pool = concurrent.futures.ThreadPoolExecutor(3)
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.calls: dict[int, list[list[int]]] = {}

    def submit(self, row: int, turn: list[int]) -> concurrent.futures.Future:
        with self.lock:
            index = len(self.calls.setdefault(row, []))
            self.calls[row].append(list(turn))
            delay = self.rng.uniform(0.0, 0.05)

        def answer():
            time.sleep(delay)
            return observe(turn, index)

        return self.pool.submit(answer)


@pytest.fixture(scope="module")
def two_slots(models):
    """The engine of the single-turn-reference tests (2 slots, the defaults otherwise): one
    sampler, so that its compiled programs are reused."""
    return Sampler(models[1], engine="continuous", stop_token_ids=(), decode_slots=2)


@pytest.fixture(scope="module")
def plain_samplers():
    """The samplers without drafts of the episodes test by attention path, shared by its two
    kinds of stop (their programs in common compile once). A sampler that speculates is built
    per test: it keeps earlier requests' rollouts as drafts."""
    return {}


@pytest.fixture(scope="module", params=["stop_id", "stop_sequences"])
def reference(models, request):
    hf, _ = models
    stop_ids, sequences = _turn_stops(hf, request.param)
    return stop_ids, sequences, *_reference(hf, [(t,) for t in stop_ids] + list(sequences))


# Every paged attention path that runs on CPU: ``dense`` (what ``attention="auto"`` and so the
# trainer pick on CPU: its decode chunks read per-chunk views, written back to the pages at the
# chunk's end, and its observations are prefilled through page tables) and ``xla`` (GPU, and
# the prefill of every accelerator path: flat page lists); and both with speculative verify
# steps of 3 drafted tokens (turns end inside a step's accepted tokens, drafts continue after
# observations), and with tries of 6 drafted tokens 3 deep.
@pytest.mark.parametrize(
    ("attention", "draft_tokens", "draft_depth"),
    [(a, k, d) for k, d in ((0, 0), (3, 0), (6, 3)) for a in ("dense", "xla")],
    ids=["dense", "xla", "dense-speculative", "xla-speculative", "dense-trie", "xla-trie"],
)
def test_multiturn_episodes_equal_reprefilling_the_history(
    models, reference, plain_samplers, attention, draft_tokens, draft_depth
):
    _, model = models
    stop_ids, sequences, expected, expected_actions, expected_calls = reference
    # 3 slots for 5 episodes; a pool of 23 usable pages of 4 tokens, where one episode needs
    # up to 16: sequences are preempted, running and waiting, before and after hand-overs.
    slots, num_pages, chunk = 3, 24, 3
    # The reference episodes take several turns (observations in most of them).
    assert sum(any(not a for a in acts) for acts in expected_actions) >= 3, expected_calls
    if sequences:  # and turns end at stop sequences of 2 and 3 ids, not only at the stop id
        ends = {len(q) for c in sum(expected_calls, []) for q in sequences if _ends_turn(c, [q])}
        assert {2, 3} <= ends, expected_calls

    host = Host(seed=slots)
    settings = dict(
        engine="continuous",
        stop_token_ids=(),
        decode_slots=slots,
        page_size=4,
        num_pages=num_pages,
        decode_chunk=chunk,
        attention=attention,
        speculate=draft_tokens > 0,
        draft_tokens=draft_tokens,
        draft_depth=draft_depth,
    )
    if draft_tokens:
        sampler = Sampler(model, **settings)
    else:
        if attention not in plain_samplers:
            plain_samplers[attention] = Sampler(model, **settings)
        sampler = plain_samplers[attention]
    out = sampler.generate(
        PROMPTS,
        max_new_tokens=BUDGET,
        temperature=0.0,
        turns=Turns(stop_ids, MAX_TURNS, host.submit, stop_sequences=sequences),
    )
    assert out.tokens == expected
    mask = np.asarray(out.action_mask_array)
    for r, acts in enumerate(expected_actions):
        assert mask[r, : len(acts)].tolist() == acts
        assert not mask[r, len(acts) :].any()
    # Observation positions were written, not sampled: their log-probs are zero.
    logprobs = np.asarray(out.logprob_array)
    for r, acts in enumerate(expected_actions):
        obs = ~np.asarray(acts)
        assert (logprobs[r, : len(acts)][obs] == 0).all()
        assert (logprobs[r, : len(acts)][~obs] < 0).all()
    # Every turn was handed over once, with its own tokens (from the last observation on).
    assert [host.calls.get(r, []) for r in range(len(PROMPTS))] == expected_calls
    stats = out.engine_stats
    assert stats.handovers == sum(map(len, host.calls.values()))
    assert stats.observation_tokens == sum(not a for acts in expected_actions for a in acts)
    assert stats.preemptions > 0
    # Observations continued in place: besides the contexts replayed after a preemption (which
    # depend on the host's random latencies), only observation ids were prefilled, never a
    # history again.
    in_place = stats.resumed_tokens - stats.replayed_tokens
    assert 0 < in_place <= stats.observation_tokens
    assert stats.replayed_tokens == 0 or stats.preemptions > 0
    if draft_tokens:  # drafted tokens were accepted: fewer verify steps than sampled tokens
        assert 0 < stats.verify_steps < stats.useful_steps


@pytest.mark.parametrize("draft_tokens", [0, 3], ids=["plain", "speculative"])
def test_partial_rollouts_continue_episodes_where_they_stopped(
    models, reference, plain_samplers, draft_tokens
):
    """Partial rollouts of multi-turn episodes: calls stopped by a quota (1 episode, then 3)
    leave episodes inside a turn, at a hand-over (waiting on the host: its observation is taken
    in and written first) and after observations; carried into the next calls, they end with
    the tokens, action masks and host turns of the uninterrupted episodes, each turn handed
    over once."""
    _, model = models
    stop_ids, sequences, expected, expected_actions, expected_calls = reference
    settings = dict(
        engine="continuous", stop_token_ids=(), decode_slots=3, page_size=4, num_pages=24,
        decode_chunk=3, attention="dense", speculate=draft_tokens > 0, draft_tokens=draft_tokens,
    )  # fmt: skip
    if draft_tokens:
        sampler = Sampler(model, **settings)
    else:
        sampler = plain_samplers.setdefault("dense", Sampler(model, **settings))
    host = Host(seed=11)
    turns = Turns(stop_ids, MAX_TURNS, host.submit, stop_sequences=sequences)
    request = dict(max_new_tokens=BUDGET, temperature=0.0, turns=turns)
    carried, inside, after, observed_last = None, 0, 0, 0
    for quota in (1, 3, None):
        out = sampler.generate(PROMPTS, carried=carried, quota=quota, **request)
        carried = [out.carry(r) for r in range(len(PROMPTS))]
        for r, c in enumerate(carried):
            if c.finished:
                continue
            want = expected[r][: len(c.tokens)]
            assert list(c.tokens) == want  # a prefix of the uninterrupted episode
            actions = np.asarray(expected_actions[r][: len(c.tokens)], bool)
            assert c.observed == tuple(
                (a, b) for a, b in _runs(~actions)
            )  # its observations, as columns
            after += bool(c.observed)
            inside += bool(c.tokens) and bool(actions[-1])  # stopped inside a model turn
            observed_last += bool(c.tokens) and not actions[-1]  # at an observation's end
    assert all(c.finished for c in carried)
    assert inside >= 1 and after >= 1 and observed_last >= 1, (inside, after, observed_last)
    assert out.tokens == expected
    mask = np.asarray(out.action_mask_array)
    for r, acts in enumerate(expected_actions):
        assert mask[r, : len(acts)].tolist() == acts
    assert [host.calls.get(r, []) for r in range(len(PROMPTS))] == expected_calls
    assert [c.turns for c in carried] == [len(calls) for calls in expected_calls]


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges where ``flags`` is True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], flags.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def test_episodes_that_end_on_the_host_end_the_call(models, two_slots):
    """Every episode ends when the host answers its first turn with None: the call returns
    (once the last answer is in, nothing is left to run) with each episode's first turn."""
    hf, _ = models
    stop_ids, _ = _turn_stops(hf, "stop_id")
    expected = [_hf_greedy(hf, p, BUDGET, [stop_ids]) for p in PROMPTS]
    assert sum(_ends_turn(t, [stop_ids]) for t in expected) >= 3
    done = concurrent.futures.Future()
    done.set_result(None)
    sampler = two_slots
    turns = Turns(stop_ids, MAX_TURNS, lambda row, turn: done)
    out = sampler.generate(PROMPTS, max_new_tokens=BUDGET, temperature=0.0, turns=turns)
    assert out.tokens == expected
    assert out.engine_stats.handovers == sum(_ends_turn(t, [stop_ids]) for t in expected)
    # Every answer was ready at its hand-over: the engine never waited on the host.
    assert out.engine_stats.wait_s == 0.0


def test_the_engine_waits_on_the_host_when_nothing_else_can_run(models, two_slots):
    """``EngineStats.wait_s`` (the trainer's ``time/tool_wait``) is host time blocked on
    observations while no sequence can run: one episode whose first turn ends at the stop id,
    answered (episode over) 0.2 s after its hand-over, leaves the engine nothing else to do."""
    hf, _ = models
    stop_ids, _ = _turn_stops(hf, "stop_id")
    greedy = ((p, _hf_greedy(hf, p, BUDGET, [stop_ids])) for p in PROMPTS)
    prompt, first = next((p, t) for p, t in greedy if _ends_turn(t, [stop_ids]))
    delay = 0.2
    host = concurrent.futures.ThreadPoolExecutor(1)
    sampler = two_slots
    turns = Turns(stop_ids, MAX_TURNS, lambda r, turn: host.submit(time.sleep, delay))
    start = time.perf_counter()
    out = sampler.generate([prompt], max_new_tokens=BUDGET, temperature=0.0, turns=turns)
    elapsed = time.perf_counter() - start
    host.shutdown()
    assert out.tokens == [first] and out.engine_stats.handovers == 1
    # From the hand-over to the wait the engine only does host bookkeeping (well under 0.1 s).
    assert delay / 2 < out.engine_stats.wait_s <= elapsed


@pytest.mark.parametrize(
    "engine, turns, message",
    [
        ("static", Turns((5,), 2, None), "engine='continuous'"),
        ("continuous", Turns((), 2, None), "no token would end a turn"),
        ("continuous", Turns((500,), 2, None), "outside the vocabulary"),
        (
            "continuous",
            Turns((), 2, None, ((3, 4), ())),
            r"stop_sequences\[1\] must be a non-empty",
        ),
        ("continuous", Turns((), 2, None, ((3, 500),)), r"\[500\] outside the vocabulary"),
        ("continuous", Turns((5,), 0, None), "max_turns must be an int >= 1"),
    ],
)
def test_multiturn_requests_the_engine_cannot_run_are_refused(engine, turns, message):
    from flax import nnx

    from delta_jax.models import ModelConfig, Transformer

    model = Transformer(ModelConfig.tiny("qwen3", vocab_size=96), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=message):
        Sampler(model, engine=engine).generate([[1, 2]], max_new_tokens=4, turns=turns)


class _Env:
    """Answers each turn with ``w3 w4``; a row with ``bad`` breaks the protocol at its first
    step (a number for an observation, or an exception)."""

    tools = ()
    stop_strings: tuple[str, ...] = ()

    def reset(self, row):
        self.bad = row.get("bad")
        return "w5"

    def step(self, turn):
        if self.bad == "raise":
            raise RuntimeError("environment bug")
        return StepResult(123 if self.bad else "w3 w4", False)


def test_a_bad_environment_ends_its_episode_and_the_others_finish(models, two_slots):
    """Through the engine: the episodes whose environment breaks the protocol end at their
    first hand-over (counted in episode/env_errors); the others get their observations."""
    from delta_jax.envs.episodes import EpisodeRunner
    from tests.envs.helpers import word_tokenizer

    hf, _ = models
    stop_ids, _ = _turn_stops(hf, "stop_id")
    tok = word_tokenizer(chat_template=None)  # ids 0-207: the model's 128 decode
    first = [_hf_greedy(hf, p, BUDGET, [stop_ids]) for p in PROMPTS]
    ended = [r for r, t in enumerate(first) if _ends_turn(t, [stop_ids])]
    assert len(ended) >= 3
    bad = {ended[0]: "number", ended[1]: "raise"}
    env = type("Env", (_Env,), {"stop_strings": tuple(tok.convert_ids_to_tokens(stop_ids))})
    runner = EpisodeRunner(env, tok, max_turns=MAX_TURNS, max_observation_tokens=8, end_ids=[])
    episodes = runner.start([{"prompt": "w5", "bad": bad.get(r)} for r in range(len(PROMPTS))])
    assert episodes.turns.stop_ids == stop_ids
    sampler = two_slots
    out = sampler.generate(PROMPTS, max_new_tokens=BUDGET, temperature=0.0, turns=episodes.turns)
    for row, tokens in enumerate(out.tokens):
        episodes.finish(row, tokens)
    runner.close()
    observation = tok.encode("w3 w4", add_special_tokens=False)
    for r in range(len(PROMPTS)):
        if r in bad:
            assert out.tokens[r] == first[r]  # ended at its hand-over, no observation
        elif r in ended:
            got = out.tokens[r][len(first[r]) :]
            assert out.tokens[r][: len(first[r])] == first[r] and got[1:3] == observation
    assert episodes.stats()["episode/env_errors"] == len(bad) / len(PROMPTS)
