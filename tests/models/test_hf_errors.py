"""Bad checkpoints and configs give clear errors naming the file and tensor."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from delta_jax.models import ModelConfig, from_pretrained, save_pretrained
from tests.models.hf_helpers import random_model


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("good"))
    save_pretrained(random_model(ModelConfig.tiny("qwen3", vocab_size=64)), path)
    return path


def _copy(good_dir, tmp_path):
    dst = str(tmp_path / "ckpt")
    shutil.copytree(good_dir, dst)
    return dst


def test_good_dir_loads(good_dir):
    assert from_pretrained(good_dir).config.vocab_size == 64


def test_missing_config_json(good_dir, tmp_path):
    path = _copy(good_dir, tmp_path)
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(FileNotFoundError, match=f"no config.json in {path}"):
        from_pretrained(path)


def test_no_safetensors(good_dir, tmp_path):
    path = _copy(good_dir, tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        from_pretrained(path)


def test_truncated_safetensors(good_dir, tmp_path):
    path = _copy(good_dir, tmp_path)
    file = os.path.join(path, "model.safetensors")
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated or corrupt .*not fully"):
        from_pretrained(path)
    with open(file, "wb") as f:
        f.write(data[:5])
    with pytest.raises(ValueError, match="model.safetensors: truncated or corrupt .*too small"):
        from_pretrained(path)


def test_shape_mismatch_names_file_and_tensor(good_dir, tmp_path):
    path = _copy(good_dir, tmp_path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["intermediate_size"] = 100
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: tensor "
        r"'model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight' has shape",
    ):
        from_pretrained(path)


def test_missing_and_unexpected_tensors(good_dir, tmp_path):
    path = _copy(good_dir, tmp_path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    tensors["model.layers.1.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"missing tensors \['model\.layers\.1\.self_attn\.k_norm"
        r"\.weight'\]; unexpected tensors \['model\.layers\.1\.extra\.weight'\]",
    ):
        from_pretrained(path)


def test_unsupported_architecture_lists_supported(good_dir, tmp_path):
    path = _copy(good_dir, tmp_path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["GPT2LMHeadModel"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(
        ValueError,
        match=r"unsupported architecture \['GPT2LMHeadModel'\]; "
        r"supported: \['LlamaForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM'\]",
    ):
        from_pretrained(path)


def test_unsupported_rope_type():
    config = ModelConfig.tiny("llama").to_hf()
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'; supported"):
        ModelConfig.from_hf(config)


def test_hub_id_not_in_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)  # the test session's setting, made explicit
    with pytest.raises(
        FileNotFoundError,
        match="model 'nobody/not-a-cached-model' is not in the local cache and HF_HUB_OFFLINE=1",
    ):
        from_pretrained("nobody/not-a-cached-model")


def test_hub_id_from_local_cache(good_dir, tmp_path, monkeypatch):
    """A hub id resolves offline from a cache laid out as huggingface_hub writes it."""
    cache = tmp_path / "hub"
    repo = cache / "models--someone--tiny-qwen3"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(good_dir, repo / "snapshots" / commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    assert from_pretrained("someone/tiny-qwen3").config.vocab_size == 64


def test_config_roundtrip_and_validation():
    for family in ("qwen3", "qwen2", "llama"):
        cfg = ModelConfig.tiny(family)
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg
        assert ModelConfig.from_hf(cfg.to_hf(), scan_layers=True).scan_layers
    with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        ModelConfig.tiny(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="remat='some'"):
        ModelConfig.tiny(remat="some")
