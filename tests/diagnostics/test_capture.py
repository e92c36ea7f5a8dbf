"""CoefficientBatch storage, token pieces, capture_batch against an independent recomputation."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax.data import PromptRecord
from delta_jax.diagnostics import CaptureSampling, CoefficientBatch, capture_batch, token_pieces
from delta_jax.losses import grpo_advantages
from tests.diagnostics.helpers import RESPONSES, odd_length_reward, synthetic_batch
from tests.losses.delta_oracle import delta_oracle, lm_head_row_vectors


def test_save_load_roundtrip(tmp_path):
    batch = synthetic_batch()
    loaded = CoefficientBatch.load(batch.save(tmp_path / "d" / "batch_000003.npz"))
    for name in ("token_ids", "coefficients", "mask", "advantages", "rewards"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(batch, name))
    assert loaded.prompts == batch.prompts and loaded.pieces == batch.pieces
    assert (loaded.group_size, loaded.step) == (4, 3)
    assert ["".join(p) for p in loaded.pieces][0] == RESPONSES[0]


def test_batch_validates_shapes():
    b = synthetic_batch()
    with pytest.raises(ValueError, match="coefficients has shape"):
        CoefficientBatch(
            b.token_ids,
            b.coefficients[:, :-1],
            b.mask,
            b.advantages,
            b.rewards,
            b.prompts,
            b.pieces,
        )
    with pytest.raises(ValueError, match="prompts has 7 rows"):
        CoefficientBatch(
            b.token_ids, b.coefficients, b.mask, b.advantages, b.rewards, b.prompts[:-1], b.pieces
        )
    with pytest.raises(ValueError, match="pieces of rows"):
        CoefficientBatch(
            b.token_ids,
            b.coefficients,
            b.mask,
            b.advantages,
            b.rewards,
            b.prompts,
            [p[:-1] for p in b.pieces],
        )


def test_token_pieces_multibyte_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(["the cat sat on the mat"] * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw)
    text = "the café ☕ sat\non 𝔸"
    ids = tok.encode(text)
    pieces = token_pieces(tok, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == text
    # Multi-byte characters are split over several byte tokens: some pieces are empty, none
    # is the replacement character a one-token decode would give.
    assert "\ufffd" not in "".join(pieces)
    assert any(tok.decode([i]) == "\ufffd" for i in ids)


@pytest.fixture(scope="module")
def tiny_model():
    from flax import nnx

    from delta_jax.demo import build_char_tokenizer
    from delta_jax.models import ModelConfig, Transformer

    tok = build_char_tokenizer()
    cfg = ModelConfig.tiny(
        "qwen3", vocab_size=128, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    return Transformer(cfg, rngs=nnx.Rngs(1)), tok


def test_capture_batch_matches_forward_pass_oracle(tiny_model):
    from delta_jax.models import token_logprobs

    model, tok = tiny_model
    prompts = ["Q: 12+30=?\nA: ", "Q: 5+77=?\nA: "]
    records = [PromptRecord(prompt=p, answer="0") for p in prompts]
    ids = [tok.encode(p) for p in prompts]
    sampling = CaptureSampling(n=4, max_new_tokens=10, temperature=1.0, seed=3)
    batch = capture_batch(
        model, tok, ids, records, sampling=sampling, reward=odd_length_reward, step=7
    )
    assert batch.token_ids.shape[0] == 8 and batch.step == 7 and batch.group_size == 4
    # The reward sees the text without special tokens (as in training); the pieces keep them.
    rows = [batch.token_ids[i][batch.mask[i]].tolist() for i in range(8)]
    assert ["".join(p) for p in batch.pieces] == [tok.decode(r) for r in rows]
    texts = tok.batch_decode(rows, skip_special_tokens=True)
    rewards = np.array([odd_length_reward("", t, {}) for t in texts], np.float32)
    np.testing.assert_array_equal(batch.rewards, rewards)
    assert 0 < rewards.sum() < 8, "the toy reward should give both sides"
    np.testing.assert_allclose(
        batch.advantages, np.asarray(grpo_advantages(jnp.asarray(rewards), 4)), atol=1e-6
    )
    # Independent path: a full forward pass over prompt + response gives the hidden states and
    # log-probs; the float64 oracle of DELTA_SPEC §3 gives λ̄ from them.
    b, t = batch.token_ids.shape
    p_len = max(map(len, ids))
    seq = np.zeros((b, p_len + t), np.int32)
    att = np.zeros((b, p_len + t), bool)
    for i in range(b):
        prompt = ids[i // 4]
        seq[i, p_len - len(prompt) : p_len] = prompt
        att[i, p_len - len(prompt) : p_len] = True
        seq[i, p_len:] = np.where(batch.mask[i], batch.token_ids[i], 0)
        att[i, p_len:] = batch.mask[i]
    out = token_logprobs(
        model,
        jnp.asarray(seq[:, :-1]),
        jnp.asarray(seq[:, 1:]),
        attention_mask=jnp.asarray(att[:, :-1]),
        return_hidden=True,
    )
    hidden = np.asarray(out.hidden)[:, p_len - 1 :]
    logp = np.asarray(out.logprobs)[:, p_len - 1 :]
    want, _ = delta_oracle(lm_head_row_vectors(hidden, logp), batch.advantages, batch.mask)
    np.testing.assert_allclose(batch.coefficients, want, atol=2e-4)
    assert np.all(batch.coefficients[~batch.mask] == 0)
    assert batch.coefficients[batch.mask].mean() == pytest.approx(1.0, abs=1e-5)


def test_capture_batch_old_keywords_warn_and_give_the_same_batch(tiny_model):
    model, tok = tiny_model
    ids = [tok.encode("Q: 1+2=?\nA: ")]
    records = [PromptRecord(prompt="Q: 1+2=?\nA: ", answer="3")]
    sampling = CaptureSampling(n=2, max_new_tokens=6)
    new = capture_batch(model, tok, ids, records, sampling=sampling, reward=odd_length_reward)
    with pytest.warns(DeprecationWarning, match="sampling=CaptureSampling"):
        old = capture_batch(
            model, tok, ids, records, n=2, max_new_tokens=6, reward=odd_length_reward
        )
    np.testing.assert_array_equal(old.token_ids, new.token_ids)
    np.testing.assert_array_equal(old.coefficients, new.coefficients)
    with pytest.raises(TypeError, match="unexpected keyword argument .samples."):
        capture_batch(model, tok, ids, records, samples=2)
