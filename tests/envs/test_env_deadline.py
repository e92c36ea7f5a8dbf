"""With a deadline (``rollout.tool_timeout_s`` in the trainer), an environment whose factory,
``reset`` or ``step`` hangs ends only its own episode, counted in ``episode/env_errors`` and
logged once; the hung call is abandoned to its thread. The protocol checks are the same through
the deadline's threads (hypothesis, the faults of test_env_protocol)."""

import logging
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings

from delta_jax.config import Config, ConfigError
from delta_jax.data import PromptRecord
from delta_jax.envs import StepResult
from delta_jax.envs.episodes import EpisodeRunner
from tests.envs.test_env_protocol import MAX_OBS, STOP, TOK, Env, W, faults

DEADLINE = 0.3


@pytest.fixture
def release():
    """Set at the end of a test: the abandoned calls return then."""
    event = threading.Event()
    yield event
    event.set()


def _runner(env=Env, **kw):
    kw = {"max_turns": 4, "max_observation_tokens": MAX_OBS, "end_ids": [0], **kw}
    return EpisodeRunner(env, TOK, timeout_s=DEADLINE, **kw)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(faults)
def test_a_protocol_breach_ends_only_its_episode_within_the_deadline_too(fault):
    runner = _runner()
    try:
        episodes = runner.start([{"prompt": "w5", "fault": fault}, {"prompt": "w5"}])
        turn = W("w1 " + STOP)
        assert episodes.turns.submit(0, turn).result() is None
        good = episodes.turns.submit(1, turn).result()
    finally:
        runner.close()
    assert good and TOK.decode(good).count("w3") == 1
    assert episodes.stats()["episode/env_errors"] == 0.5


def _hanging(release, where, calls=None):
    class Hangs(Env):
        """Hangs in ``where`` for rows that say so; ``calls`` counts the steps answered."""

        def __init__(self):
            if where == "factory" and release.hang_factory:
                release.wait(60)

        def reset(self, row):
            self.hang = row.get("hang", False)
            if where == "reset" and self.hang:
                release.wait(60)
            return row["prompt"]

        def step(self, turn):
            if where == "step" and self.hang:
                release.wait(60)
            if calls is not None:
                calls.append(turn)
            return StepResult("w3 w4", "w9" in turn)

    release.hang_factory = False
    return Hangs


@pytest.mark.parametrize("where", ["reset", "step", "last step"])
def test_a_hang_ends_its_episode_and_is_logged_once(release, caplog, where):
    env = _hanging(release, "reset" if where == "reset" else "step")
    rows = [{"prompt": "w5", "hang": True}] * 3 + [{"prompt": "w5"}]
    runner = _runner(env, workers=4)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, "delta_jax.envs.episodes"):
        episodes = runner.start(rows)
        turn = W("w1 " + STOP)
        if where == "last step":  # stepped at the end of the episode (EOS), by the engine
            for row in range(4):
                episodes.finish(row, W("w1 w9") + [0])
        else:
            answers = [episodes.turns.submit(row, turn) for row in range(4)]
            assert [a.result() is None for a in answers] == [True, True, True, False]
    runner.close()
    assert time.monotonic() - t0 < 20 * DEADLINE  # the hangs waited out together
    assert episodes.stats()["episode/env_errors"] == 0.75
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    call = "reset" if where == "reset" else "step"
    assert lines[0].startswith(f"environment Hangs: {call}: {call} did not return within 0.3 s")


def test_a_factory_that_hangs_ends_the_episode_or_is_a_start_up_error(release):
    env = _hanging(release, "factory")
    runner = _runner(env)
    release.hang_factory = True
    episodes = runner.start([{"prompt": "w5"}])
    assert episodes.turns.submit(0, W(STOP)).result() is None
    assert episodes.stats()["episode/env_errors"] == 1.0
    runner.close()
    with pytest.raises(ValueError, match=r"^environment Hangs: the factory failed: the fac"):
        _runner(env)


def test_a_thread_exit_in_a_step_is_a_failure_not_an_exit():
    class Exits(Env):
        def step(self, turn):
            raise SystemExit(3)

    runner = _runner(Exits)
    episodes = runner.start([{"prompt": "w5"}])
    assert episodes.turns.submit(0, W(STOP)).result() is None
    runner.close()
    assert episodes.stats()["episode/env_errors"] == 1.0


def test_a_first_turn_that_hangs_at_start_up_is_a_config_error(release):
    from delta_jax.data.prompt_sets import make_encoder
    from delta_jax.rl.setup import episode_hooks

    runner = _runner(_hanging(release, "reset"))
    encode = make_encoder(Config().data, TOK, **episode_hooks(runner))
    with pytest.raises(ConfigError, match=r"^environment Hangs: reset did not return within 0.3 s"):
        encode([PromptRecord(prompt="w5", answer="1", extra={"hang": True})])
    runner.close()
