"""The user's code never ends a step in a traceback: through ``Trainer.step()``, a reward
function that raises, returns NaN or the wrong length, or hangs; data rows that are empty, of
the wrong type, not valid Unicode, without the prompt column, not dicts or too long; an
environment whose ``step`` hangs. The step finishes; each failure is counted in its metric and
its first cause logged once, on one line. What can be known before the first step is a
one-line error then."""

import logging
import threading

import numpy as np
import pytest

from delta_jax import Trainer
from delta_jax.config import ConfigError
from delta_jax.envs import StepResult
from delta_jax.models import from_pretrained, load_tokenizer

RELEASE = threading.Event()  # set at the end: the abandoned calls return then


class Stall:
    """Ends a turn at "er" (the demo's "Answer"); a row with an even answer never answers."""

    stop_strings, tools = ("er",), ()

    def reset(self, row):
        self.hang = int(row["answer"]) % 2 == 0
        return row["prompt"]

    def step(self, turn):
        if self.hang:
            RELEASE.wait(120)
        return StepResult("OBS", False)


def hostile(prompts, completions, answer, **columns):
    """Misbehaves by the group's answer: raises, NaN, the wrong length, a hang."""
    mode = int(answer[0]) % 4
    if mode == 0:
        raise RuntimeError("reward bug")
    if mode == 1:
        return [float("nan")] * len(completions)
    if mode == 2:
        return [1.0]
    RELEASE.wait(120)
    return [1.0] * len(completions)


def good(prompts, completions, **columns):
    return [min(len(c), 20) / 20 for c in completions]


def _config(tmp_path, **extra):
    return {
        "run.dir": str(tmp_path / "run"),
        "run.steps": 1,
        "run.eval_every": 0,
        "run.progress": False,
        "run.tensorboard": False,
        "rollout.prompts_per_step": 4,
        "rollout.samples_per_prompt": 4,
        "rollout.max_new_tokens": 32,
        "rollout.dynamic_sampling_rounds": 0,
        "data.max_prompt_length": 16,
        **extra,
    }


@pytest.fixture(scope="module")
def model_and_tokenizer(demo_model_dir):
    return from_pretrained(str(demo_model_dir)), load_tokenizer(str(demo_model_dir))


@pytest.mark.slow  # one trainer step, with deadlines waited out
def test_a_step_with_faulty_rewards_rows_and_environment_finishes(
    tmp_path, model_and_tokenizer, caplog
):
    model, tokenizer = model_and_tokenizer
    good_rows = [{"prompt": f"Q: 10+{b}=?\nA: ", "answer": str(10 + b)} for b in range(10, 14)]
    bad_rows = [
        {"prompt": "", "answer": "1"},
        {"prompt": None, "answer": "1"},
        {"prompt": 12, "answer": "1"},
        {"prompt": "Q: \ud800", "answer": "1"},
        {"answer": "1"},
        "not a row",
        {"prompt": "Q: " + "9+" * 20 + "=?", "answer": "1"},  # longer than 16 tokens
    ]
    config = _config(
        tmp_path,
        **{
            "data.on_bad_row": "skip",
            "reward.timeout_s": 1.0,
            "reward.num_workers": 1,
            "rollout.max_turns": 2,
            "rollout.tool_timeout_s": 1.0,
        },
    )
    try:
        with caplog.at_level(logging.WARNING):
            with Trainer(
                config, model=model, tokenizer=tokenizer, train_dataset=good_rows + bad_rows,
                reward_fns=[hostile, good], environment=Stall(),
            ) as trainer:  # fmt: skip
                row = trainer.step()
    finally:
        RELEASE.set()
    assert row["data/skipped"] == len(bad_rows)
    reasons = {k[len("reward_reason/") :]: v for k, v in row.items() if "reward_reason/" in k}
    assert reasons == {
        "hostile:error:RuntimeError": 4, "hostile:error:ValueError": 4,
        "hostile:error:wrong_length": 4, "hostile:timeout": 4, "good:ok": 16,
    }  # fmt: skip
    assert row["reward/hostile"] == 0 and 0 < row["reward/good"] <= 1
    assert row["episode/env_errors"] > 0 and np.isfinite(row["loss"])
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert all("\n" not in line for line in lines), lines
    failures = [line for line in lines if line.startswith("reward function hostile: ")]
    assert len(failures) == 4, failures  # one per reason
    assert any("RuntimeError: reward bug" in line for line in failures)
    assert any("returned 1 values for 4 completions" in line for line in failures)
    assert any("train_dataset: skipped 6 bad rows" in line for line in lines)
    assert any("dropped 1 prompts longer than 16 tokens" in line for line in lines)
    stalls = [line for line in lines if line.startswith("environment Stall: step:")]
    assert len(stalls) == 1 and "did not return within 1 s" in stalls[0], stalls


def no_columns(prompts, completions):
    return [0.0] * len(completions)


def test_what_is_known_at_start_up_is_a_one_line_error(tmp_path, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    rows = [{"prompt": f"Q: 10+{b}=?\nA: ", "answer": str(10 + b)} for b in range(4)]
    objects = dict(model=model, tokenizer=tokenizer)
    with pytest.raises(ConfigError, match=r"^reward: reward function no_columns\(prompts, comp"):
        Trainer(_config(tmp_path), train_dataset=rows, reward_fns=[no_columns], **objects)
    renamed = [{"question": r["prompt"], "answer": r["answer"]} for r in rows]
    with pytest.raises(ValueError, match="^train_dataset: adapter 'generic' needs column 'prompt'"):
        Trainer(_config(tmp_path), train_dataset=renamed, reward_fns=[good], **objects)
    with pytest.raises(ValueError, match=r"^train_dataset: row 2: field 'prompt' empty"):
        Trainer(_config(tmp_path), train_dataset=rows[:2] + [{"prompt": " ", "answer": "1"}],
                reward_fns=[good], **objects)  # fmt: skip
