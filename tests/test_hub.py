"""Hub ids resolve like every Hugging Face tool, against a local stand-in for the hub.

``delta-jax train`` with a model id and a data set id (subset + split) downloads both on first
use and trains; a second run reads the cache with the server stopped; offline mode with an
empty cache, a missing repository and a gated one give one-line errors naming the id and the
cause. The CLI runs in subprocesses whose ``HF_ENDPOINT`` points at the server (the libraries
read it at import).
"""

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from delta_jax.demo import warm_up_demo_model
from tests.hub_server import FakeHub, read_tree
from tests.rl.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
README = b"""---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
A tiny GSM8K-shaped data set.
"""


def _parquet(rows) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    rows = [{"question": f"{i}+{i}=", "answer": f"add #### {2 * i}"} for i in range(1, 17)]
    data = {
        "README.md": README,
        "main/train-00000-of-00001.parquet": _parquet(rows),
        "main/test-00000-of-00001.parquet": _parquet(rows[:4]),
    }
    model = read_tree(warm_up_demo_model(tmp_path_factory.mktemp("m") / "m", steps=1, lr=1e-3))
    model["pytorch_model.bin"] = b"pickled weights: must never be downloaded"
    return {"models": {"someone/tiny-policy": model}, "datasets": {"someone/tiny-gsm8k": data}}


def _env(hf_home: Path, endpoint: str, offline: bool = False) -> dict:
    return dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        HF_HOME=str(hf_home),
        HF_ENDPOINT=endpoint,
        HF_HUB_OFFLINE="1" if offline else "0",
        HF_DATASETS_OFFLINE="1" if offline else "0",
        TRANSFORMERS_OFFLINE="1" if offline else "0",
        HF_HUB_DISABLE_TELEMETRY="1",
    )


def _train(run_dir, env, model="someone/tiny-policy", data="someone/tiny-gsm8k"):
    cmd = [sys.executable, "-m", "delta_jax.cli", "train", "--config", "configs/demo.yaml"]
    cmd += tiny_overrides(run_dir, model, "run.steps=2", "run.save_every=2")
    cmd += [f"data.source={data}", "data.subset=main", "data.adapter=gsm8k", "data.split=train"]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_train_downloads_hub_ids_then_runs_from_the_cache(tmp_path, repos):
    hf_home = tmp_path / "hf"
    with FakeHub(**repos) as hub:
        first = _train(tmp_path / "run1", _env(hf_home, hub.url))
        requests = list(hub.requests)
    assert first.returncode == 0, first.stderr[-3000:]
    got = [r.split(" ", 1)[1] for r in requests if "/resolve/" in r and r.startswith("GET")]
    assert any(r.endswith("/model.safetensors") for r in got), requests
    assert any("main/train-00000-of-00001.parquet" in r for r in got), requests
    assert not any(r.endswith("pytorch_model.bin") for r in got)  # safetensors only
    lines = (tmp_path / "run1" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]

    # The server is gone: the second run reads the model and the data set from the cache.
    second = _train(tmp_path / "run2", _env(hf_home, hub.url))
    assert second.returncode == 0, second.stderr[-3000:]
    assert len((tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()) == 2


def test_offline_with_empty_cache_names_the_id_and_the_cause(tmp_path):
    run = _train(tmp_path / "run", _env(tmp_path / "hf", "http://127.0.0.1:9", offline=True))
    assert run.returncode == 2
    assert (
        run.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "error: model 'someone/tiny-policy' is not in the local cache and HF_HUB_OFFLINE=1"
        )
    ), run.stderr[-2000:]


def test_missing_and_gated_repositories_and_no_network(tmp_path, repos):
    env = _env(tmp_path / "hf", "")
    with FakeHub(**repos, gated=("someone/tiny-gsm8k",)) as hub:
        env["HF_ENDPOINT"] = hub.url
        missing = _train(tmp_path / "a", env, model="someone/absent")
        gated = _train(tmp_path / "b", env)
    down = _train(tmp_path / "c", env, model="someone/other")  # nothing listens there any more
    last = lambda run: run.stderr.strip().splitlines()[-1]  # noqa: E731
    assert last(missing).startswith("error: model 'someone/absent' was not found on the hub"), (
        missing.stderr[-2000:]
    )
    assert last(gated).startswith(
        "error: data set 'someone/tiny-gsm8k' is a gated repository: accept its terms"
    ), gated.stderr[-2000:]
    assert last(down).startswith(
        "error: model 'someone/other' is not in the local cache and the hub"
    ) and "could not be reached" in last(down), down.stderr[-2000:]


def test_one_download_per_host_the_others_wait_on_the_lock(tmp_path, repos, monkeypatch):
    """While one process holds the download lock of an id, another resolving it asks the hub
    nothing; once released, it proceeds (and finds what the first one downloaded)."""
    import huggingface_hub.constants

    from delta_jax import hub as hub_lib

    hf_home = tmp_path / "hf"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    code = (
        "import sys\nfrom delta_jax.models import resolve_model_dir\nprint('ready', flush=True)\n"
        "print(resolve_model_dir('someone/tiny-policy'), flush=True)\n"
    )
    with FakeHub(**repos) as hub:
        with hub_lib.download_lock("model", "someone/tiny-policy"):
            proc = subprocess.Popen(
                [sys.executable, "-c", code],
                env=_env(hf_home, hub.url),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(2.0)
            assert not [r for r in hub.requests if "tiny-policy" in r]  # waiting, not fetching
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        assert (Path(out.strip()) / "model.safetensors").is_file()
        assert any(r.endswith("/model.safetensors") for r in hub.requests)


def test_model_revision_is_asked_for_and_a_missing_one_is_named(tmp_path, repos):
    code = (
        "from delta_jax.models import resolve_model_dir\n"
        "print(resolve_model_dir('someone/tiny-policy', revision='v1.0'))\n"
        "resolve_model_dir('someone/tiny-policy', revision='v9')\n"
    )
    with FakeHub(**repos) as hub:
        env = _env(tmp_path / "hf", hub.url)
        run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True)
    assert "GET /api/models/someone/tiny-policy/revision/v1.0" in hub.requests
    assert run.returncode == 1
    assert b"HubError: model 'someone/tiny-policy' (revision 'v9') exists, but that revision" in (
        run.stderr
    ), run.stderr[-2000:]
