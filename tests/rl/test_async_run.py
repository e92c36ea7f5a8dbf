"""Asynchronous rollouts (``rollout.async_devices``) on the suite's 8 fake devices, 4 sampling
and 4 training: the overlapped run equals its synchronous reference (the same schedule, each
step's rollout drawn one update behind, run inline), metrics and parameters bitwise; a run
stopped with a rollout in flight resumes exactly; the same with partial rollouts
(``rollout.over_provision``), whose staleness counts the update ahead; what the mode cannot do
is refused."""

import jax
import numpy as np
import pytest

from delta_jax.config import ConfigError, load_config
from delta_jax.rl import pipeline
from delta_jax.rl.trainer import Trainer
from tests.rl.conftest import tiny_overrides
from tests.rl.test_loop import DEMO, _params
from tests.rl.test_partial_run import _comparable

ASYNC = (
    "rollout.async_devices=4",
    "rollout.decode_slots=16",
    "algo.tis_cap=2.0",
    "run.save_every=2",
    "reward.num_workers=0",
)


def _config(run_dir, model_dir, *extra):
    return load_config(DEMO, tiny_overrides(run_dir, model_dir, *ASYNC, *extra))


def _run(config, steps: int) -> list[dict]:
    with Trainer(config) as trainer:
        sampler_devices = set(trainer.sampler.mesh.devices.flat)
        assert sampler_devices.isdisjoint(trainer.mesh.devices.flat)
        assert sampler_devices == set(jax.devices()[:4])
        rows = [trainer.step() for _ in range(steps)]
        trainer.checkpointer.wait()
    return rows


# Asynchronous rollouts, and asynchronous partial rollouts (their staleness counts the update
# ahead: a group sampled beside an update is 1 version old when trained, one carried over a
# call 2).
MODES = {"whole": (), "partial": ("rollout.over_provision=1", "rollout.max_staleness=2")}


def _ages(row: dict) -> dict[int, float]:
    """A step's returned groups by staleness."""
    key = "partial/staleness_"
    return {int(k.removeprefix(key)): v for k, v in row.items() if k.startswith(key)}


@pytest.fixture(scope="module", params=list(MODES))
def overlapped(request, tmp_path_factory, demo_model_dir):
    """Four steps, each rollout on its own thread beside the update: (run folder, the mode's
    overrides, rows)."""
    extra = MODES[request.param]
    run = tmp_path_factory.mktemp(f"overlapped_{request.param}") / "run"
    return run, extra, _run(_config(run, demo_model_dir, "run.steps=4", *extra), 4)


def test_overlapped_run_equals_its_synchronous_reference(
    tmp_path, demo_model_dir, overlapped, monkeypatch
):
    run, extra, rows = overlapped
    assert [r["rollout/policy_lag"] for r in rows] == [0, 1, 1, 1]
    assert all("time/rollout_wait" in r for r in rows[1:])
    assert max(r["tis_weight_max"] for r in rows[1:]) > 1.0  # one update behind: weights move
    if extra:  # the first step samples on-policy; then 1 or 2 behind (both seen), within bound
        assert list(_ages(rows[0])) == [0]
        ages = [_ages(r) for r in rows[1:]]
        assert all(min(a) >= 1 and max(a) <= 2 and sum(a.values()) % 4 == 0 for a in ages)
        assert any(2 in a for a in ages) and all(r["partial/tokens_carried"] > 0 for r in rows)
    monkeypatch.setattr(pipeline, "ROLLOUT_EXECUTOR", pipeline.InlineRollouts)
    reference = tmp_path / "reference"
    config = _config(reference, demo_model_dir, "run.steps=4", *extra)
    assert _comparable(_run(config, 4)) == _comparable(rows)
    for x, y in zip(_params(run, 4), _params(reference, 4), strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_run_stopped_with_a_rollout_in_flight_resumes_exactly(
    tmp_path, demo_model_dir, overlapped
):
    """Saved at step 2 with step 3's rollout in flight (and, partial, groups held)."""
    reference, extra, rows = overlapped
    run = tmp_path / "run"
    _run(_config(run, demo_model_dir, "run.steps=4", *extra), 2)
    with Trainer(_config(run, demo_model_dir, "run.steps=4", *extra)) as trainer:
        assert trainer.step_count == 2 and (not extra or trainer.partial.held)
        resumed = [trainer.step() for _ in range(2)]
        trainer.checkpointer.wait()
    assert [r["rollout/policy_lag"] for r in resumed] == [1, 1]
    assert _comparable(resumed) == _comparable(rows[2:])
    for x, y in zip(_params(reference, 4), _params(run, 4), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    "extra, message",
    [
        (("rollout.over_provision=1", "rollout.max_staleness=0"), "one update old"),
        (("algo.tis_cap=null",), "needs algo.tis_cap"),
    ],
)
def test_asynchronous_rollouts_refuse_what_they_cannot_do(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO, ["rollout.async_devices=2", "algo.tis_cap=2.0", *extra])


def test_asynchronous_rollouts_need_devices_left_to_train(tmp_path):
    config = load_config(DEMO, [f"run.dir={tmp_path}", "rollout.async_devices=8", "algo.tis_cap=2"])
    with pytest.raises(ConfigError, match="leaves no device to train on"):
        Trainer(config)
