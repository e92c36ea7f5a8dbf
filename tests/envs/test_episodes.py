"""The host side of multi-turn rollouts (delta_jax.envs.episodes), without an engine: stop
strings as ids, observations as rendered ids, the last turn, failures and the metrics."""

import pytest

from delta_jax.demo import build_char_tokenizer
from delta_jax.envs import (
    PLAIN_OBSERVATION,
    PythonTool,
    StepResult,
    render_observation,
    truncate_middle,
)
from delta_jax.envs.episodes import EpisodeRunner, as_factory, stop_tokens
from tests.envs.helpers import word_tokenizer

EOS = 2  # the char tokenizer's </s>


class Scripted:
    """Answers each turn with a fixed observation; the third turn is refused with a crash
    when ``crash`` is set; a turn saying 'done' ends the episode with a reward."""

    stop_strings = ("w1 w2", "w7")
    tools = ()

    def __init__(self, crash=False):
        self.crash, self.calls = crash, 0

    def reset(self, row):
        return row["prompt"]

    def step(self, turn):
        self.calls += 1
        if self.crash and self.calls == 3:
            raise RuntimeError("environment bug")
        if "w9" in turn:
            return StepResult(None, True, 0.5)
        return StepResult("w3 " * 40, False, None, {"tool_call": True, "error": None})


def _runner(tok, env=Scripted, **kw):
    kw = {"max_turns": 4, "max_observation_tokens": 8, "end_ids": [0], **kw}
    return EpisodeRunner(as_factory(env, tok), tok, **kw)


def test_stop_strings_become_ids_or_sequences():
    tok = word_tokenizer()
    w = lambda s: tok.encode(s, add_special_tokens=False)
    ids, sequences = stop_tokens(("w1 w2", "w7", "w7"), tok)
    assert ids == tuple(w("w7")) and sequences == (tuple(w("w1 w2")),)
    chars = build_char_tokenizer()
    ids, sequences = stop_tokens(("\n```\n",), chars)
    assert ids == () and sequences == (tuple(chars.encode("\n```\n")),)
    with pytest.raises(ValueError, match="encodes to no tokens"):
        stop_tokens(("",), tok)


def test_observations_are_cut_rendered_ids_and_the_episode_counts():
    tok = word_tokenizer()
    w = lambda s: tok.encode(s, add_special_tokens=False)
    runner = _runner(tok)
    episodes = runner.start([{"prompt": "w5 w6"}, {"prompt": "w6"}])
    turns = episodes.turns
    assert turns.stop_ids == tuple(w("w7")) and turns.stop_sequences == (tuple(w("w1 w2")),)
    first = w("w4 w1 w2")
    obs = turns.submit(0, first).result()
    # 40 words cut middle-out to 8 tokens, then rendered as a tool message after the turn.
    text = tok.decode(obs)
    assert text.count("w3") < 8 and "[..." in text and "<|im_start|>" in text
    cut = truncate_middle("w3 " * 40, 8, tok)
    want = render_observation(cut, tok, messages=[{"role": "user", "content": "w5 w6"}])
    assert obs == w(want)
    assert turns.submit(0, w("w9 w7")).result() is None  # done, with the env's reward
    episodes.finish(0, first + obs + w("w9 w7"))  # over at the hand-over: nothing more
    # Episode 1: a final answer at EOS is stepped at the end.
    episodes.finish(1, w("w8") + [0])
    stats = episodes.stats()
    assert stats["episode/turns"] == 1.5 and stats["episode/tool_calls"] == 1.0
    assert list(episodes.rewards()) == [0.5, 0.0]
    runner.close()


def test_a_failing_environment_ends_its_episode_only():
    tok = word_tokenizer()
    runner = _runner(tok, env=lambda: Scripted(crash=True))
    episodes = runner.start([{"prompt": "w5"}, {"prompt": "w5"}])
    w = lambda s: tok.encode(s, add_special_tokens=False)
    assert episodes.submit(0, w("w7")).result() is not None
    assert episodes.submit(0, w("w7")).result() is not None
    assert episodes.submit(0, w("w7")).result() is None  # the crash: episode over
    assert episodes.submit(1, w("w7")).result() is not None  # the other one goes on
    stats = episodes.stats()
    assert stats["episode/env_errors"] == 0.5 and episodes.rewards() is None
    runner.close()


def test_the_turn_limit_is_counted_and_not_stepped():
    tok = build_char_tokenizer()
    # 64: the char tokenizer's cut marker takes 28 tokens (the runner checks the room).
    env = PythonTool(call_format="fenced")
    runner = _runner(tok, env=env, max_turns=1, max_observation_tokens=64, end_ids=[EOS])
    episodes = runner.start([{"prompt": "Q"}])
    call = tok.encode("```py\nprint(6*7)\n```\n")
    episodes.finish(0, call)  # a call in the only turn: no tool runs
    stats = episodes.stats()
    assert stats["episode/turn_limit"] == 1.0 and stats["episode/tool_calls"] == 0.0
    assert stats["episode/turns"] == 1.0
    runner.close()


def test_python_tool_episode_on_the_demo_tokenizer():
    """What the tool demo's model sees after its call is what its warm-up showed it."""
    from delta_jax import demo

    tok = build_char_tokenizer()
    runner = _runner(
        tok,
        env=PythonTool(call_format="fenced", tokenizer=tok),
        max_turns=2,
        max_observation_tokens=64,
        end_ids=[EOS],
    )
    episodes = runner.start([{"prompt": demo.TOOL_PROMPT.format(a=347, b=829)}])
    call = tok.encode(demo.TOOL_CALL.format(a=347, b=829))
    assert tuple(call[-5:]) in episodes.turns.stop_sequences
    obs = episodes.submit(0, call).result()
    assert tok.decode(obs) == PLAIN_OBSERVATION.format(347 * 829)
    _, response, mask = demo._tool_example(tok, 347, 829, 347 * 829, use_tool=True)
    assert response[: len(call) + len(obs)] == call + obs
    assert mask[len(call) : len(call) + len(obs)] == [0] * len(obs)
    episodes.finish(0, response)
    assert episodes.stats()["episode/tool_calls"] == 1.0
    assert episodes.stats()["episode/turns"] == 2.0
    runner.close()
