"""A LoRA run end to end: only adapters train, checkpoints hold them, both exports work."""

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors import safe_open

from delta_jax import cli
from delta_jax.config import load_config
from delta_jax.models import from_pretrained
from delta_jax.rl import train
from delta_jax.rl.setup import restore_policy
from tests.models.hf_helpers import forward
from tests.rl.conftest import tiny_overrides
from tests.rl.test_loop import DEMO


@pytest.mark.slow
def test_lora_run_trains_adapters_only_and_exports(tmp_path, demo_model_dir):
    run = tmp_path / "run"
    overrides = ["run.steps=2", "model.lora_rank=4", "model.lora_targets=[q_proj,o_proj,up_proj]"]
    train(load_config(DEMO, tiny_overrides(run, demo_model_dir, *overrides)))

    with ocp.StandardCheckpointer() as reader:
        saved = reader.restore(run / "checkpoints" / "2" / "state")
    base = from_pretrained(demo_model_dir)
    blocks = {k: np.asarray(v["value"]) for k, v in saved["params"]["blocks"].items()}
    for name, value in base.blocks.arrays().items():
        np.testing.assert_array_equal(blocks[name], np.asarray(value))  # frozen
    assert np.abs(blocks["wq_lora_b"]).max() > 0  # B left its zero init: it trained
    assert "wk_lora_a" not in blocks  # only the configured targets
    moments = jax.tree.leaves(saved["opt_state"])
    adapters = sum(np.size(v) for k, v in blocks.items() if "_lora_" in k)
    assert sum(np.size(m) for m in moments if np.ndim(m) > 0) == 2 * adapters

    assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / "merged")]) == 0
    assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / "a"), "--adapters"]) == 0
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["target_modules"] == ["q_proj", "o_proj", "up_proj"]
    with safe_open(str(tmp_path / "a" / "adapter_model.safetensors"), "numpy") as f:
        keys = sorted(f.keys())
    assert len(keys) == 2 * 3 * base.config.num_layers
    assert "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight" in keys

    # The merged export is the trained policy: same logits as base + trained adapters.
    policy, _, _ = restore_policy(run, None)
    ids = np.random.default_rng(0).integers(3, 40, (2, 9)).astype(np.int32)
    merged = from_pretrained(tmp_path / "merged")
    np.testing.assert_allclose(forward(merged, ids)[0], forward(policy, ids)[0], atol=1e-4)
    assert np.abs(forward(merged, ids)[0] - forward(base, ids)[0]).max() > 1e-6
