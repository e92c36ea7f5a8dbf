"""The public API: ``Trainer`` with Python objects (rewards, data, model, tokenizer)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import pytest

from delta_jax import Trainer
from delta_jax.config import ConfigError, load_config
from delta_jax.diagnostics.metrics_log import read_metrics
from delta_jax.models import from_pretrained, load_tokenizer
from delta_jax.plan.lengths import METRIC_QUANTILES
from tests.rl.conftest import tiny_overrides

ROOT = Path(__file__).parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
SCRIPT = ROOT / "tests" / "rl" / "api_script.py"


def _strip(rows, drop=("compiles", "compiles_loaded")):
    return [
        {k: v for k, v in r.items() if not k.startswith("time/") and k not in drop} for r in rows
    ]


def _script(model_dir, run_dir, mode, steps, **kwargs):
    cmd = [sys.executable, str(SCRIPT), str(model_dir), str(run_dir), mode, str(steps)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return cmd, dict(env=env, cwd=ROOT, **kwargs)


@pytest.mark.slow  # a CLI run and the same steps in this process
def test_step_n_times_equals_the_cli(tmp_path, demo_model_dir):
    extra = ("run.steps=2", "run.eval_every=2", "run.eval_prompts=8")
    cli = [sys.executable, "-m", "delta_jax.cli", "train", "--config", str(DEMO)]
    cli += tiny_overrides(tmp_path / "cli", demo_model_dir, *extra)
    proc = subprocess.Popen(cli, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    config = load_config(DEMO, tiny_overrides(tmp_path / "api", demo_model_dir, *extra))
    with Trainer(config) as trainer:
        rows = [trainer.step(), trainer.step()]
        with pytest.raises(ConfigError, match="run.steps=2 reached"):
            trainer.step()
    assert proc.wait(timeout=600) == 0, proc.stderr.read().decode()[-3000:]
    want = read_metrics(tmp_path / "cli" / "metrics.jsonl")
    got = read_metrics(tmp_path / "api" / "metrics.jsonl")
    assert [r["step"] for r in got] == [0, 1, 2] and _strip(got[1:]) == _strip(rows)
    assert _strip(got) == _strip(want)


@pytest.mark.slow  # three runs of a user's script, two at a time
def test_lambda_reward_and_list_data_from_main_step_train_and_resume(tmp_path, demo_model_dir):
    # step() six times, and train() to 6 steps killed after a save then resumed: the same run.
    cmd, kw = _script(demo_model_dir, tmp_path / "steps", "step", 6)
    stepping = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
    killed = tmp_path / "killed"
    cmd_k, kw_k = _script(demo_model_dir, killed, "train", 6)
    proc = subprocess.Popen(cmd_k, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw_k)
    deadline = time.time() + 600
    while not (killed / "checkpoints" / "2").exists():
        assert proc.poll() is None, "the run to be killed ended early"
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert read_metrics(killed / "metrics.jsonl")[-1]["step"] < 6
    assert subprocess.run(cmd_k, timeout=600, **kw_k).returncode == 0

    stdout, stderr = stepping.communicate(timeout=600)
    assert stepping.returncode == 0, stderr.decode()[-3000:]
    stepped = [json.loads(line) for line in stdout.decode().splitlines() if line.startswith("{")]
    assert [r["step"] for r in stepped] == list(range(1, 7))
    for row in stepped:  # the lambda's own mean, under its name
        assert 0.0 <= row["reward/lambda"] <= 1.0 and row["reward/lambda"] == row["reward_mean"]
        assert row["reward_reason/ok"] == 16 * row["dynamic/rounds"]  # every round scored
    assert any(r["reward/lambda"] > 0 for r in stepped)
    assert stderr.decode().count("runs in the trainer's process") == 1
    got = read_metrics(killed / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, 7))
    assert _strip(got) == _strip(stepped)  # step() and a killed, resumed train() agree


def brevity(prompts, completions, **columns):
    """A batched reward importable by workers: shorter completions score higher."""
    return [1.0 / (1 + len(c)) for c in completions]


def test_objects_replace_what_the_config_builds(tmp_path, demo_model_dir):
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a), "tag": a} for a in range(10, 30)]
    model, tokenizer = from_pretrained(str(demo_model_dir)), load_tokenizer(str(demo_model_dir))
    config = {
        # model.path stays the demo's: the objects replace it, nothing is warmed up or loaded.
        "run.dir": str(tmp_path / "run"),
        "run.steps": 2,
        "run.eval_every": 0,
        "run.progress": False,
        "run.tensorboard": False,
        "rollout.prompts_per_step": 2,
        "rollout.samples_per_prompt": 4,
        "rollout.max_new_tokens": 6,
        "rollout.dynamic_sampling_rounds": 0,  # one engine call: its figures are checked below
        "reward.num_workers": 1,
    }
    with Trainer(
        config,
        model=model,
        tokenizer=tokenizer,
        train_dataset=datasets.Dataset.from_list(rows),
        eval_dataset=rows[:4],
        reward_fns=["math", brevity],
        reward_weights=[1.0, 0.5],
    ) as trainer:
        assert not (tmp_path / "run" / "demo_model").exists()
        before = np.asarray(trainer.params["embed"][...]).copy()
        row = trainer.step()
        total = row["reward/math"] + 0.5 * row["reward/brevity"]
        assert row["reward_mean"] == pytest.approx(total, abs=1e-6)
        assert 0 < row["reward/brevity"] < 1
        # One engine call: 2 prompts x 4 samples of 6 tokens, prompts of 6 characters. Each
        # data group of the sampling mesh runs its own slots (4 groups on the 8 test devices:
        # the demo model's 2 KV heads make tensor groups of 2), a prompt's samples in one
        # group, a group's slots capped at its prompts' rows: 2 groups run 4 slots each, the
        # others idle (measured: occupancy 0.5, 5 pages).
        sampler = trainer.sampler
        groups = 1 if sampler.mesh is None else sampler.mesh.shape["data"]
        per_group = -(-2 // groups)
        slots = groups * min(-(-sampler.decode_slots // groups), per_group * 4)
        # Every row joins at once (the default pool holds them) and the groups decode in step,
        # so the chunks run as many steps as the longest row: at most slots x longest
        # slot-steps, of which the rows use 8 x mean.
        busy = 8 / slots
        lengths = row["response_length_mean"] / row["response_length_max"]
        assert busy * lengths <= row["rollout/occupancy"] <= busy
        # The step's length distribution in a few numbers, min to max (the planner reads them).
        quantiles = [row[k] for k in METRIC_QUANTILES]
        assert quantiles[0] >= 1 and quantiles[-1] == row["response_length_max"]
        assert all(a <= b for a, b in zip(quantiles, quantiles[1:], strict=False))
        assert row["rollout/preemptions"] == 0
        # A prompt keeps its prefix (all but its last token; at most 15 tokens, under
        # data.max_prompt_length) in one shared page; each sample owns the page the prefix ends
        # in (copied) and, when its 6 tokens cross a page's end, the next one. The prompts have
        # one length, so all 4 samples own as many pages.
        assert sampler.page_size == 16
        assert row["rollout/pages_peak"] in [per_group * (1 + 4 * own) for own in (1, 2)]
        assert not np.array_equal(before, np.asarray(trainer.params["embed"][...]))
        assert "eval/avg@1" in trainer.evaluate()
        assert trainer.save() == tmp_path / "run" / "checkpoints" / "1"
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1]


def test_bad_objects_are_one_line_errors(tmp_path, demo_model_dir):
    base = {"model.path": str(demo_model_dir), "run.dir": str(tmp_path), "run.eval_every": 0}
    with pytest.raises(TypeError, match="train_dataset must be a datasets.Dataset"):
        Trainer(base, train_dataset="prompts.jsonl")
    with pytest.raises(ConfigError, match="3 usable prompts < rollout.prompts_per_step=32"):
        Trainer(base, train_dataset=[{"prompt": "1+1=", "answer": "2"}] * 3)
    with pytest.raises(ConfigError, match="needs held-out prompts"):
        Trainer({**base, "run.eval_every": 5}, train_dataset=[{"prompt": "p", "answer": "1"}] * 40)
    with pytest.raises(ConfigError, match="reward: 2 reward_weights for 1"):
        Trainer(base, reward_fns=[brevity], reward_weights=[1, 2])
    with pytest.raises(ConfigError, match="model= was given without tokenizer="):
        Trainer({"run.dir": str(tmp_path)}, model=from_pretrained(str(demo_model_dir)))
    tokenizer = load_tokenizer(str(demo_model_dir))
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(200)])
    with pytest.raises(ConfigError, match="the tokenizer has .* tokens but the model's vocabulary"):
        Trainer(base, tokenizer=tokenizer)
    with pytest.raises(ConfigError, match="section.key"):
        Trainer({"steps": 3})
