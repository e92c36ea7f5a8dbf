"""token_logprobs against a float64 NumPy oracle on full logits, and its gradient against the
full-logits log_softmax + gather path (tolerance 1e-5, float32)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from delta_jax.models import (
    ModelConfig,
    Transformer,
    chunked_logprobs,
    lm_head_weight,
    token_logprobs,
)
from tests.models.hf_helpers import padded_batch, random_model

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig.tiny("qwen2", vocab_size=200, tie_word_embeddings=False)
    model = random_model(cfg, seed=3)
    ids, mask, _ = padded_batch(np.random.RandomState(0), cfg.vocab_size, [9, 6], 9, "right")
    targets = np.roll(ids, -1, axis=1)
    return model, jnp.asarray(ids), jnp.asarray(targets), jnp.asarray(mask).astype(bool)


def _oracle(logits, targets, temperature):
    """float64 log_softmax(logits / t)[targets] and entropy."""
    z = np.asarray(logits, np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    lp = np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]
    ent = -(np.exp(logp) * logp).sum(-1)
    return lp, ent


@functools.partial(jax.jit, static_argnums=(0, 5))
def _ours(graphdef, state, ids, targets, mask, chunk_size):
    model = nnx.merge(graphdef, state)
    out = token_logprobs(
        model,
        ids,
        targets,
        attention_mask=mask,
        temperature=TEMPERATURE,
        return_entropy=True,
        return_hidden=True,
        chunk_size=chunk_size,
    )
    logits = model(ids, attention_mask=mask).logits
    return out, logits


@pytest.mark.parametrize("chunk_size", [None, 4, 18, 5])  # one chunk, exact, whole, padded
def test_matches_full_logits_oracle(setup, chunk_size):
    model, ids, targets, mask = setup
    out, logits = _ours(*nnx.split(model), ids, targets, mask, chunk_size)
    lp, ent = _oracle(logits, targets, TEMPERATURE)
    assert out.logprobs.dtype == jnp.float32 and out.logprobs.shape == ids.shape
    np.testing.assert_allclose(np.asarray(out.logprobs), lp, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(out.entropy), ent, atol=1e-5, rtol=0)
    assert out.hidden.shape == (*ids.shape, model.config.hidden_size)


def _weighted(state, graphdef, ids, targets, mask, chunked):
    model = nnx.merge(graphdef, state)
    weights = jnp.linspace(-1.0, 2.0, ids.size).reshape(ids.shape) * mask
    if chunked:
        lp = token_logprobs(
            model, ids, targets, attention_mask=mask, temperature=TEMPERATURE, chunk_size=5
        ).logprobs
    else:
        logits = model(ids, attention_mask=mask).logits.astype(jnp.float32) / TEMPERATURE
        lp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    return jnp.sum(weights * lp)


def test_gradient_matches_full_logits_path(setup):
    model, ids, targets, mask = setup
    graphdef, state = nnx.split(model, nnx.Param)
    grad = jax.jit(jax.grad(_weighted), static_argnums=(1, 5))
    ours = grad(state, graphdef, ids, targets, mask, True)
    ref = grad(state, graphdef, ids, targets, mask, False)
    leaves = jax.tree.leaves(ref)
    assert any(np.abs(np.asarray(g)).max() > 1e-3 for g in leaves)
    for a, b in zip(jax.tree.leaves(ours), leaves, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_chunked_logprobs_gradient_wrt_hidden_and_head():
    rng = np.random.RandomState(1)
    h = jnp.asarray(rng.randn(13, 8), jnp.float32)
    w = jnp.asarray(rng.randn(8, 50), jnp.float32)
    t = jnp.asarray(rng.randint(0, 50, 13))

    def full(h, w):
        return jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(h @ w / 1.3), t[:, None], -1))

    def chunked(h, w):
        return jnp.sum(chunked_logprobs(h, w, t, temperature=1.3, chunk_size=4)[0])

    for a, b in zip(jax.grad(chunked, (0, 1))(h, w), jax.grad(full, (0, 1))(h, w), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_lm_head_weight_tied_and_untied(setup):
    model = setup[0]
    np.testing.assert_array_equal(np.asarray(lm_head_weight(model)), np.asarray(model.lm_head[...]))
    tied = random_model(ModelConfig.tiny("qwen3", vocab_size=32))
    np.testing.assert_array_equal(np.asarray(lm_head_weight(tied)), np.asarray(tied.embed[...]).T)


def test_bad_arguments(setup):
    model, ids, targets, _ = setup
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs(model, ids, targets[:, :-1])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, ids, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs(jnp.ones((3, 4)), jnp.ones((4, 5)), jnp.zeros(3, jnp.int32), chunk_size=0)


def test_score_from_equals_slicing_the_full_result():
    """``score_from`` skips the LM head on the first positions and changes nothing else."""
    model = Transformer(ModelConfig.tiny("qwen3"), rngs=nnx.Rngs(3))
    ids = jax.random.randint(jax.random.key(1), (2, 12), 1, 256)
    mask = jnp.ones((2, 11), bool).at[0, :3].set(False)
    full = token_logprobs(
        model, ids[:, :-1], ids[:, 1:], attention_mask=mask, return_entropy=True, return_hidden=True
    )
    part = token_logprobs(
        model,
        ids[:, :-1],
        ids[:, 1:],
        attention_mask=mask,
        return_entropy=True,
        return_hidden=True,
        score_from=5,
    )
    assert part.logprobs.shape == (2, 6)
    np.testing.assert_allclose(part.logprobs, full.logprobs[:, 5:], atol=1e-6)
    np.testing.assert_allclose(part.entropy, full.entropy[:, 5:], atol=1e-6)
    np.testing.assert_allclose(part.hidden, full.hidden[:, 5:], atol=1e-6)
    with pytest.raises(ValueError, match="score_from"):
        token_logprobs(model, ids[:, :-1], ids[:, 1:], score_from=11)


def test_score_positions_equal_gathering_the_full_result():
    """``score_positions`` scores the listed positions of each row (a negative one is an empty
    slot) and changes nothing else."""
    model = Transformer(ModelConfig.tiny("qwen3"), rngs=nnx.Rngs(3))
    ids = jax.random.randint(jax.random.key(1), (2, 12), 1, 256)
    full = token_logprobs(model, ids[:, :-1], ids[:, 1:], return_entropy=True, return_hidden=True)
    at = jnp.array([[1, 4, 5, 10], [0, 7, -1, -1]])
    index = jnp.maximum(at, 0)
    targets = jnp.take_along_axis(ids[:, 1:], index, 1)  # each slot's target
    part = token_logprobs(
        model, ids[:, :-1], targets, return_entropy=True, return_hidden=True, score_positions=at
    )
    pick = lambda x: jnp.take_along_axis(x, index.reshape(*at.shape, *[1] * (x.ndim - 2)), 1)
    np.testing.assert_allclose(part.logprobs, pick(full.logprobs), atol=1e-6)
    np.testing.assert_allclose(part.entropy, pick(full.entropy), atol=1e-6)
    np.testing.assert_allclose(part.hidden, pick(full.hidden), atol=1e-6)
    with pytest.raises(ValueError, match="score_positions"):
        token_logprobs(model, ids[:, :-1], targets, score_from=2, score_positions=at)
    with pytest.raises(ValueError, match="one per scored position"):
        token_logprobs(model, ids[:, :-1], ids[:, 1:], score_positions=at)


def test_a_wide_window_skips_its_empty_chunks_and_changes_no_live_slot():
    """Listed positions in a window as wide as the row, empty slots last: the live slots' log-probs,
    entropies and gradients are the full result's; chunks no row uses are skipped (their
    outputs 0, where computing them would give position 0's values)."""
    model = Transformer(ModelConfig.tiny("qwen3"), rngs=nnx.Rngs(4))
    ids = jax.random.randint(jax.random.key(2), (3, 21), 1, 256)
    used = np.array([3, 5, 0])  # live slots per row; 20 slots, chunks of 2: slots 6.. skipped
    at = np.full((3, 20), -1)
    for r, n in enumerate(used):
        at[r, :n] = np.sort(np.random.RandomState(r).choice(20, n, replace=False))
    at, live = jnp.asarray(at), jnp.asarray(at >= 0)
    targets = jnp.take_along_axis(ids[:, 1:], jnp.maximum(at, 0), 1)

    def scored(params, **kwargs):
        m = nnx.merge(nnx.graphdef(model), params)
        out = token_logprobs(m, ids[:, :-1], targets, return_entropy=True, **kwargs)
        return jnp.sum(jnp.where(live, out.logprobs, 0)), out

    params = nnx.state(model)
    skipping = dict(score_positions=at, skip_empty_slots=True)
    (_, part), grads = jax.value_and_grad(scored, has_aux=True)(params, **skipping)
    _, whole = scored(params, score_positions=at)  # no skip (the TPU path): every chunk computed

    def gathered(params):
        m = nnx.merge(nnx.graphdef(model), params)
        full = token_logprobs(m, ids[:, :-1], ids[:, 1:], return_entropy=True)
        pick = lambda x: jnp.take_along_axis(x, jnp.maximum(at, 0), 1)
        return jnp.sum(jnp.where(live, pick(full.logprobs), 0)), (full, pick)

    (_, (full, pick)), ref = jax.value_and_grad(gathered, has_aux=True)(params)
    for ours, theirs in ((part.logprobs, pick(full.logprobs)), (part.entropy, pick(full.entropy))):
        np.testing.assert_allclose(np.where(live, ours, 0), np.where(live, theirs, 0), atol=1e-6)
        assert np.all(np.asarray(ours)[:, 6:] == 0) and np.any(np.asarray(theirs)[:, 6:] != 0)
    np.testing.assert_allclose(np.where(live, whole.logprobs, 0), np.where(live, part.logprobs, 0))
    assert np.any(np.asarray(whole.logprobs)[:, 6:] != 0)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
