"""Greedy parity with ``transformers`` ``generate`` on tiny random Qwen3 / Llama checkpoints."""

import numpy as np
import pytest
import torch
import transformers

from delta_jax.models import from_pretrained
from delta_jax.sampling import Sampler

PAD = 0
NEW_TOKENS = 32
PROMPTS = [[5, 9, 2, 17], [7, 1, 4, 4, 8, 3, 11, 30, 2, 6], [20], [3, 3, 6, 2, 9, 41, 12]]

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    # A wide init so the arg-max is never a near tie between float32 implementations.
    initializer_range=0.2,
    pad_token_id=PAD,
    bos_token_id=None,
    eos_token_id=None,
)
CONFIGS = {
    "qwen3": lambda: transformers.Qwen3Config(
        **COMMON, rope_theta=1e6, tie_word_embeddings=True, attention_bias=False
    ),
    "llama": lambda: transformers.LlamaConfig(
        **COMMON,
        tie_word_embeddings=False,
        rope_theta=5e5,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
}


def _hf_generate(hf_model):
    width = max(map(len, PROMPTS))
    ids = torch.full((len(PROMPTS), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=None,
        )
    return out[:, width:].numpy()


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_greedy_tokens_match_transformers(tmp_path, family):
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]())
    hf_model = hf_model.to(torch.float32).eval()
    hf_model.generation_config.eos_token_id = None
    hf_model.save_pretrained(tmp_path)
    expected = _hf_generate(hf_model)
    assert expected.shape == (len(PROMPTS), NEW_TOKENS)

    model = from_pretrained(tmp_path)
    out = Sampler(model, stop_token_ids=()).generate(
        PROMPTS, max_new_tokens=NEW_TOKENS, temperature=0.0
    )
    assert out.lengths == [NEW_TOKENS] * len(PROMPTS)
    np.testing.assert_array_equal(np.array(out.tokens), expected)
    # Not a degenerate model that repeats one token.
    assert len(set(expected.ravel().tolist())) > 10
