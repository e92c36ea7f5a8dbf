"""GGUF loading: the real SmolLM2 file and tiny files of each family and quantisation type,
against ``transformers``' own GGUF loading (its own dequantisation and Q/K un-permutation, in
PyTorch) and against the float models they were written from.

Tolerances: float32 logits within 5e-4 (absolute; logits of the real model are O(10), and the
two loaders' dequantised weights agree to float32 rounding; measured 1.4e-4); a tiny model
written from float32 weights without quantisation, 1e-4 against the model it came from.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from delta_jax.models import ModelConfig, from_pretrained, load_tokenizer, save_pretrained
from delta_jax.models.gguf import GGUFError
from tests.models.gguf_helpers import random_k_blocks, smollm2_file, write_gguf
from tests.models.hf_helpers import build_hf_model, forward, hf_logits

PROMPTS = [
    "Calculate 15 + 27. Answer with only the final number.",
    "Explain in a few sentences how plants make their food.",
    "Write a short story about a lighthouse keeper.",
]


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_file()
    return path, from_pretrained(path), load_tokenizer(path)


@pytest.fixture(scope="module")
def smollm2_torch(smollm2):
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2[0]
    folder, name = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_real_model_config(smollm2):
    cfg = smollm2[1].config
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        "llama", 30, 576, 9, 3,
    )  # fmt: skip
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings


def test_real_model_chat_template_and_tokens_match_transformers(smollm2, smollm2_torch):
    tok, ref = smollm2[2], smollm2_torch[1]
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ours = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        theirs = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours == theirs and ours.startswith("<|im_start|>system\n")
        assert tok(ours).input_ids == ref(theirs).input_ids
    assert (
        tok.eos_token == "<|im_end|>" and tok.decode(tok("12 + 7 = 19").input_ids) == "12 + 7 = 19"
    )


def _chat_ids(tok, prompt):
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return tok(text).input_ids


def test_real_model_logits_and_greedy_tokens_match_transformers(smollm2, smollm2_torch):
    from delta_jax.sampling import Sampler

    _, model, tok = smollm2
    ref = smollm2_torch[0]
    prompts = [_chat_ids(tok, p) for p in PROMPTS]
    for ids in prompts:
        ours, _ = forward(model, np.asarray([ids]))
        with torch.no_grad():
            theirs = ref(torch.tensor([ids])).logits.numpy()
        np.testing.assert_allclose(ours, theirs, atol=5e-4, rtol=0)
        assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    # Greedy continuations up to the end-of-turn token (past it the text is off-distribution and
    # near-ties decide); the two long prompts run the whole 32 tokens.
    sampler = Sampler(model, pad_token_id=tok.pad_token_id, engine="static")
    eos = tok.eos_token_id
    out = sampler.generate(prompts, max_new_tokens=32, temperature=0.0, stop_token_ids=(eos,))
    full = 0
    for ids, tokens, n in zip(prompts, out.tokens, out.lengths, strict=True):
        with torch.no_grad():
            g = ref.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=eos,
                pad_token_id=tok.pad_token_id,
            )  # fmt: skip
        assert list(np.asarray(tokens)[: int(n)]) == g[0, len(ids) :].tolist()
        full += int(n) == 32
    assert full >= 2


def _transformers_from_gguf(path):
    import os

    from transformers import AutoModelForCausalLM

    folder, name = os.path.dirname(path), os.path.basename(path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def _ids(vocab, seed=0, shape=(2, 12)):
    return np.random.RandomState(seed).randint(0, vocab, shape)


# (HF family of hf_helpers, GGUF architecture, quantisation of 2-D weights by GGUF name)
QUANTISED = [
    ("llama32_tied", "llama", lambda g, w: Q.Q8_0 if "embd" in g else Q.Q4_1),
    ("qwen2_untied", "qwen2", lambda g, w: Q.Q4_0 if "ffn" in g else Q.Q5_1),
    ("qwen3_tied", "qwen3", lambda g, w: Q.F16 if "attn" in g else Q.BF16),
    ("qwen3_tied", "qwen3", lambda g, w: Q.Q5_0 if "ffn" in g else Q.Q8_0),
]


@pytest.mark.parametrize("family,arch,qtype_of", QUANTISED, ids=["q4_1", "q4_0", "f16", "q5_0"])
def test_quantised_families_match_transformers_gguf(family, arch, qtype_of, tmp_path):
    # transformers' GGUF loader takes Qwen3's head_dim from its config default (128), not from
    # the file: the tiny Qwen3 uses that head_dim here (test_float_gguf_... checks another).
    hf = build_hf_model(family, **({"head_dim": 128} if arch == "qwen3" else {}))
    config = hf.config.to_dict()
    config.setdefault("rope_theta", hf.config.rope_parameters["rope_theta"])
    if family.startswith("llama"):  # transformers' GGUF loader ignores llama3 frequency factors
        config["rope_theta"] = 10000.0
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    if config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    path = write_gguf(tmp_path / "m.gguf", arch, config, state, qtype_of)
    ours, _ = forward(from_pretrained(path), _ids(config["vocab_size"]))
    with torch.no_grad():
        theirs = _transformers_from_gguf(path)(torch.tensor(_ids(config["vocab_size"]))).logits
    np.testing.assert_allclose(ours, theirs.numpy(), atol=5e-4, rtol=0)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=["q4_k", "q6_k"])
def test_k_quants_match_transformers_gguf(qtype, tmp_path):
    # K-quant rows are whole 256-weight super-blocks; the gguf package writes no K-quants, so
    # the weights are random blocks.
    H, F, V, L = 256, 512, 96, 2
    config = dict(
        vocab_size=V, hidden_size=H, intermediate_size=F, num_hidden_layers=L,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
    )  # fmt: skip
    rng = np.random.RandomState(0)
    state = {
        "model.embed_tokens.weight": 0.1 * rng.randn(V, H),
        "model.norm.weight": 1 + rng.rand(H),
    }
    shapes = {"q_proj": (H, H), "k_proj": (H // 2, H), "v_proj": (H // 2, H), "o_proj": (H, H)}
    shapes |= {"gate_proj": (F, H), "up_proj": (F, H), "down_proj": (H, F)}
    for i in range(L):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = 1 + 0.2 * rng.randn(H)
        state[p + "post_attention_layernorm.weight"] = 1 + 0.2 * rng.randn(H)
        for name, rows in (("q_proj", H), ("k_proj", H // 2), ("v_proj", H // 2)):  # Qwen2's
            state[f"{p}self_attn.{name}.bias"] = 0.2 * rng.randn(rows)
        for name, (rows, cols) in shapes.items():
            where = (
                "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            )
            state[f"{p}{where}.{name}.weight"] = (random_k_blocks(rows, cols, qtype, rng), qtype)
    path = write_gguf(tmp_path / "k.gguf", "qwen2", config, state)
    ours, _ = forward(from_pretrained(path), _ids(V))
    with torch.no_grad():
        theirs = _transformers_from_gguf(path)(torch.tensor(_ids(V))).logits.numpy()
    assert np.isfinite(ours).all() and np.abs(theirs).max() > 1e-2
    np.testing.assert_allclose(ours, theirs, atol=5e-4 * np.abs(theirs).max(), rtol=0)


@pytest.mark.parametrize("family", ["llama31_untied", "qwen3_tied"])
def test_float_gguf_equals_the_model_it_came_from(family, tmp_path):
    """Unquantised: the logits of the original model, Llama 3.1's frequency factors included
    (written as llama.cpp does, as ``rope_freqs`` beside the original context length)."""
    from delta_jax.models.transformer import rope_inv_freq

    hf = build_hf_model(family)
    config = hf.config.to_dict()
    arch, extra = {"llama31_untied": "llama", "qwen3_tied": "qwen3"}[family], {}
    config["rope_theta"] = hf.config.rope_parameters["rope_theta"]
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    if config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    if arch == "llama":
        cfg = ModelConfig.from_hf(config)
        factors = rope_inv_freq(cfg.replace(rope_scaling=None)) / rope_inv_freq(cfg)
        extra["llama.rope.scaling.original_context_length"] = 32  # hf_helpers.LLAMA3_ROPE
    raw = {"rope_freqs.weight": np.asarray(factors, np.float32)} if arch == "llama" else {}
    path = write_gguf(tmp_path / "f.gguf", arch, config, state, extra=extra, raw=raw)
    model = from_pretrained(path)
    if arch == "llama":
        got = dict(model.config.rope_scaling)
        assert got.pop("factor") == pytest.approx(8.0, rel=1e-6)
        assert got == {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 32}  # fmt: skip
    ids = _ids(config["vocab_size"], shape=(2, 40))
    ours, _ = forward(model, ids)
    np.testing.assert_allclose(ours, hf_logits(hf, ids)[0], atol=1e-4, rtol=0)


def test_export_of_a_gguf_model_loads_in_transformers(smollm2, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, model, tok = smollm2
    save_pretrained(model, tmp_path / "out", tokenizer=tok)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    again = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = _chat_ids(again, PROMPTS[0])
    assert ids == _chat_ids(tok, PROMPTS[0])
    ours, _ = forward(model, np.asarray([ids]))
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=5e-4, rtol=0)


# --- bad input: one line naming the file and the problem ---------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    hf = build_hf_model("qwen3_tied")
    state = {k: v.numpy() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    config = hf.config.to_dict()
    config["rope_theta"] = hf.config.rope_parameters["rope_theta"]
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_gguf(path, "qwen3", config, state), config, state


def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text, text
    return text


def test_truncated_and_corrupt_files_are_one_line(tiny_gguf, tmp_path):
    data = open(tiny_gguf[0], "rb").read()
    for name, blob in (("cut.gguf", data[: len(data) // 2]), ("head.gguf", data[:40]),
                       ("junk.gguf", b"not a gguf file at all" * 10)):  # fmt: skip
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(GGUFError) as e:
            from_pretrained(tmp_path / name)
        assert name in _one_line(e) and "truncated or corrupt" in str(e.value)
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        from_pretrained(tmp_path / "missing.gguf")


def test_unknown_architecture_and_quantisation_are_one_line(tiny_gguf, tmp_path):
    _, config, state = tiny_gguf
    path = write_gguf(tmp_path / "g.gguf", "gemma2", config, state)
    with pytest.raises(GGUFError) as e:
        from_pretrained(path)
    assert "unsupported GGUF architecture 'gemma2'" in _one_line(e)
    rows = state["model.layers.0.mlp.up_proj.weight"].shape[0]
    state = dict(state)
    state["model.layers.0.mlp.up_proj.weight"] = (np.zeros((rows, 18 * 2), np.uint8), Q.IQ4_NL)
    path = write_gguf(tmp_path / "q.gguf", "qwen3", config, state)
    with pytest.raises(GGUFError) as e:
        from_pretrained(path)
    assert "blk.0.ffn_up.weight" in _one_line(e) and "IQ4_NL" in str(e.value)


def test_unsupported_tokenizer_kind_is_one_line(tiny_gguf, tmp_path):
    with pytest.raises(GGUFError) as e:
        load_tokenizer(tiny_gguf[0])
    assert "tokenizer kind None" in _one_line(e)


def test_cli_reports_a_bad_gguf_in_one_error_line(tmp_path, capsys):
    from delta_jax.cli import main

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    code = main(["train", f"model.path={bad}", f"run.dir={tmp_path / 'run'}", "run.steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and "bad.gguf" in err[0]


def test_the_planner_reads_a_gguf_models_shapes(tiny_gguf):
    from delta_jax.config import load_config
    from delta_jax.plan.models import resolve_model_config

    config = load_config(None, [f"model.path={tiny_gguf[0]}"])
    mc = resolve_model_config(config)
    assert (mc.family, mc.head_dim, mc.num_layers) == ("qwen3", 32, 2)
