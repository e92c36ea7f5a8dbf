"""metrics.jsonl: one line per step, flushed; resume drops lines after the restored step."""

import json

from delta_jax.diagnostics.metrics_log import MetricsLog, read_metrics


def test_write_read_and_resume_truncation(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=True)
    for step in range(1, 6):
        log.log(step, {"reward_mean": step / 10, "loss": float("nan")})
    # No close(): lines must already be on disk (crash safety).
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["loss"] is None  # non-finite values become JSON null
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')  # a torn line, as after kill -9
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 5
    resumed = MetricsLog(tmp_path, tensorboard=False, resume_step=3)
    resumed.log(4, {"reward_mean": 0.4})
    resumed.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_disabled_writer_writes_nothing(tmp_path):
    log = MetricsLog(tmp_path / "run", enabled=False)
    assert log.log(1, {"x": 1})["x"] == 1
    log.close()
    assert not (tmp_path / "run").exists()
