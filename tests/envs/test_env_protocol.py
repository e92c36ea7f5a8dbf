"""An environment that breaks the protocol (raises, or returns what it must not, from its
factory, ``reset`` or ``step``) ends its own episode, counted in ``episode/env_errors`` and
logged once; nothing leaves the runner. Driven with generated bad values (hypothesis)."""

import logging
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delta_jax.config import ConfigError
from delta_jax.demo import build_char_tokenizer
from delta_jax.envs import StepResult
from delta_jax.envs.episodes import EpisodeRunner
from tests.envs.helpers import word_tokenizer

TOK = word_tokenizer()
W = lambda s: TOK.encode(s, add_special_tokens=False)
STOP = "w7"
MAX_OBS = 8


class Unprintable:
    """An object whose every text conversion raises (and whose truth and number do too)."""

    def __str__(self):
        raise RuntimeError("no str")

    __repr__ = __format__ = __str__

    def __bool__(self):
        raise RuntimeError("no bool")

    def __float__(self):
        raise RuntimeError("no float")

    def __eq__(self, other):
        raise RuntimeError("no eq")

    __hash__ = None


class BadFloat(float):
    """A float subclass whose conversion raises."""

    def __float__(self):
        raise RuntimeError("no float")


class Boom(Exception):
    def __str__(self):
        raise RuntimeError("an exception that cannot print itself")


surrogates = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3).map(
    lambda s: "w3 " + s
)
scalars = st.one_of(
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.binary(max_size=20),
    st.complex_numbers(),
    st.builds(Unprintable),
    st.builds(BadFloat, st.floats()),
)
nested = st.recursive(scalars | st.none() | st.text(max_size=5), st.lists, max_leaves=8)
tuples = st.lists(nested, max_size=5).map(tuple)
not_text = st.one_of(scalars, st.none(), st.lists(nested, max_size=3), tuples, st.builds(dict))
bad_observation = st.one_of(scalars, st.lists(nested, max_size=3), tuples, surrogates)
bad_done = st.one_of(
    st.integers(), st.none(), st.text(max_size=5), st.floats(), st.builds(Unprintable), tuples
)
bad_reward = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.booleans(),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.complex_numbers(),
    st.lists(st.floats(), max_size=3),
    st.builds(Unprintable),
    st.builds(BadFloat, st.floats(allow_nan=False)),
)
bad_info = st.one_of(
    st.integers(), st.text(min_size=1, max_size=5), st.lists(nested, min_size=1, max_size=3),
    tuples.filter(bool), st.builds(Unprintable),
    # a mapping whose values break the metrics' reads
    st.builds(lambda v: {"tool_call": v, "error": v}, st.builds(Unprintable)),
)  # fmt: skip
exceptions = st.sampled_from(
    [RuntimeError("bug"), KeyError("k"), ValueError("line one\nline two"), Boom(), MemoryError()]
)

# What an environment does wrong, at reset or at its first step.
faults = st.one_of(
    st.tuples(st.just("reset_returns"), not_text),
    st.tuples(st.just("reset_raises"), exceptions),
    st.tuples(st.just("reset_returns"), surrogates),
    st.tuples(st.just("step_returns"), st.one_of(not_text, st.text(max_size=5), tuples)),
    st.tuples(st.just("step_raises"), exceptions),
    st.tuples(st.just("observation"), bad_observation),
    st.tuples(st.just("done"), bad_done),
    st.tuples(st.just("reward"), bad_reward),
    st.tuples(st.just("info"), bad_info),
)


class Env:
    """Answers every turn with an observation; a row with a fault breaks the protocol there."""

    stop_strings = (STOP,)
    tools = ()

    def reset(self, row):
        self.fault = row.get("fault")
        where, value = self.fault or (None, None)
        if where == "reset_raises":
            raise value
        return value if where == "reset_returns" else row["prompt"]

    def step(self, turn):
        where, value = self.fault or (None, None)
        fields = {"observation": "w3 w4", "done": False, "reward": None, "info": {}}
        if where == "step_raises":
            raise value
        if where == "step_returns":
            return value
        if where in fields:
            fields[where] = value
        return StepResult(**fields)


def _runner(tok=TOK, **kw):
    kw = {"max_turns": 4, "max_observation_tokens": MAX_OBS, "end_ids": [0], **kw}
    return EpisodeRunner(Env, tok, **kw)


def _one_bad_episode(fault):
    """Episode 0 breaks the protocol, episode 1 is well-behaved: returns (episode 0's
    observation, episode 1's, stats) after one turn each and the end of both episodes."""
    runner = _runner()
    try:
        episodes = runner.start([{"prompt": "w5", "fault": fault}, {"prompt": "w5"}])
        turn = W("w1 " + STOP)
        bad = episodes.turns.submit(0, turn).result()
        good = episodes.turns.submit(1, turn).result()
        episodes.finish(0, turn)  # over at the hand-over
        episodes.finish(1, turn + good + W("w9") + [0])  # its last turn, at EOS: stepped
        return bad, good, episodes.stats(), episodes.rewards()
    finally:
        runner.close()


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(faults)
def test_a_protocol_breach_ends_only_its_episode(fault):
    bad, good, stats, rewards = _one_bad_episode(fault)
    assert bad is None  # episode 0 ended at its first hand-over
    assert good and TOK.decode(good).count("w3") == 1  # episode 1 got its observation
    assert stats["episode/env_errors"] == 0.5
    assert stats["episode/turns"] == 1.5 and rewards is None


@pytest.mark.parametrize("tok", [TOK, build_char_tokenizer()], ids=["words", "chars"])
@pytest.mark.parametrize("size", [10**3, 10**6])
def test_a_huge_observation_is_cut_not_a_failure(tok, size):
    class Loud(Env):
        def step(self, turn):
            return StepResult("w3 " * size + "w4", False)

    limit = MAX_OBS if tok is TOK else 64  # the char tokenizer's cut marker takes 28
    runner = EpisodeRunner(Loud, tok, max_turns=4, max_observation_tokens=limit, end_ids=[0])
    episodes = runner.start([{"prompt": "w5"}])
    turn = tok.encode(STOP, add_special_tokens=False)
    obs = episodes.turns.submit(0, turn).result()
    runner.close()
    assert obs is not None and episodes.stats()["episode/env_errors"] == 0
    text = tok.decode(obs)
    assert "output truncated" in text and 0 < text.count("w3") < limit
    assert "w4" in text  # both ends kept


def test_each_kind_of_failure_is_logged_once_on_one_line(caplog):
    runner = _runner()
    rows = [{"prompt": "w5", "fault": ("observation", 123)}] * 3 + [
        {"prompt": "w5", "fault": ("step_raises", ValueError("line one\nline two"))},
        {"prompt": "w5", "fault": ("reward", math.nan)},
    ]
    with caplog.at_level(logging.WARNING, "delta_jax.envs.episodes"):
        episodes = runner.start(rows)
        for row in range(len(rows)):
            assert episodes.turns.submit(row, W(STOP)).result() is None
    runner.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all("\n" not in line for line in lines), lines
    assert lines[0].startswith("environment Env: step: StepResult.observation is int 123")
    assert "ValueError: line one line two" in lines[1]
    assert "StepResult.reward is nan, not finite" in lines[2]
    assert episodes.stats()["episode/env_errors"] == 1.0


def test_valid_results_are_kept_as_given():
    """Numbers of any kind are rewards, numpy bools are ``done``; the metrics read ``info``."""
    import numpy as np

    class Scoring(Env):
        def step(self, turn):
            info = {"tool_call": True, "error": "timeout"}
            return StepResult(None, np.bool_(True), np.float32(0.25), info)

    runner = EpisodeRunner(Scoring, TOK, max_turns=4, max_observation_tokens=MAX_OBS, end_ids=[0])
    episodes = runner.start([{"prompt": "w5"}])
    assert episodes.turns.submit(0, W(STOP)).result() is None
    runner.close()
    stats = episodes.stats()
    assert stats["episode/env_errors"] == 0 and stats["episode/tool_timeouts"] == 1
    assert list(episodes.rewards()) == [0.25]


@pytest.mark.parametrize(
    "reset, message",
    [
        (lambda row: 123, r"environment Env: reset's first user turn is int 123, not a str$"),
        (lambda row: b"w5", r"environment Env: reset's first user turn is bytes, not a str$"),
        (lambda row: None, r"environment Env: reset's first user turn is None, not a str$"),
        (lambda row: 1 / 0, r"environment Env: reset failed: ZeroDivisionError: division by"),
    ],
)
def test_a_bad_first_turn_at_start_up_is_a_config_error(monkeypatch, reset, message):
    """The prompts are encoded from each row's ``reset``: a bad one is a one-line error."""
    from delta_jax.config import Config
    from delta_jax.data import PromptRecord
    from delta_jax.data.prompt_sets import make_encoder
    from delta_jax.rl.setup import episode_hooks

    runner = _runner()
    monkeypatch.setattr(Env, "reset", lambda self, row: reset(row))
    encode = make_encoder(Config().data, TOK, **episode_hooks(runner))
    with pytest.raises(ConfigError, match=message) as error:
        encode([PromptRecord(prompt="w5", answer="1")])
    runner.close()
    assert "\n" not in str(error.value)
