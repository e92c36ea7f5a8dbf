"""Transformer behaviour: KV-cache decoding, scan / remat variants, bf16, parameter counts.

Tolerances: cache vs no-cache 1e-5 and scan / remat vs plain 1e-6 (same float32 maths, only
the order of a few reductions may differ); bf16 bound justified in ``test_bf16_forward_bound``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from delta_jax.models import ModelConfig, Transformer, token_logprobs
from tests.models.hf_helpers import padded_batch, random_model

FAMILIES = ["qwen3", "qwen2", "llama"]


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, state, ids, mask, positions, cache):
    out = nnx.merge(graphdef, state)(ids, attention_mask=mask, positions=positions, cache=cache)
    return out.logits, out.cache


@functools.partial(jax.jit, static_argnums=0)
def _full(graphdef, state, ids, mask):
    out = nnx.merge(graphdef, state)(ids, attention_mask=mask)
    return out.logits, out.hidden


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_decode_equals_full_forward(family):
    cfg = ModelConfig.tiny(family, vocab_size=128, scan_layers=family == "qwen2")
    model = random_model(cfg)
    graphdef, state = nnx.split(model)
    rng = np.random.RandomState(0)
    P, G = 10, 5  # prompt slots (left padded), decoded tokens
    prompt, pmask, _ = padded_batch(rng, cfg.vocab_size, [P, 6, 1], P, "left")
    new = rng.randint(1, cfg.vocab_size, (3, G)).astype(np.int32)
    cache = model.init_cache(3, P + G + 3)
    logits_pre, cache = _step(graphdef, state, jnp.asarray(prompt), jnp.asarray(pmask), None, cache)
    decoded = []
    n_real = pmask.sum(-1)
    for g in range(G):
        pos = jnp.asarray((n_real + g)[:, None], jnp.int32)
        lg, cache = _step(
            graphdef, state, jnp.asarray(new[:, g : g + 1]), jnp.ones((3, 1), bool), pos, cache
        )
        decoded.append(np.asarray(lg[:, 0]))
    assert int(cache.index) == P + G
    ids = np.concatenate([prompt, new], 1)
    mask = np.concatenate([pmask, np.ones_like(new)], 1).astype(bool)
    full, _ = _full(graphdef, state, jnp.asarray(ids), jnp.asarray(mask))
    full = np.asarray(full)
    valid = pmask.astype(bool)
    np.testing.assert_allclose(np.asarray(logits_pre)[valid], full[:, :P][valid], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.stack(decoded, 1), full[:, P:], atol=1e-5, rtol=0)
    if family != "qwen3":
        return
    # Default positions with a cache count the real cached tokens: same as explicit ones.
    cache2 = model.init_cache(3, P + G + 3)
    _, cache2 = _step(graphdef, state, jnp.asarray(prompt), jnp.asarray(pmask), None, cache2)
    lg, _ = _step(graphdef, state, jnp.asarray(new[:, :1]), jnp.ones((3, 1), bool), None, cache2)
    np.testing.assert_allclose(np.asarray(lg[:, 0]), decoded[0], atol=1e-6, rtol=0)


@functools.partial(jax.jit, static_argnums=0)
def _value_grad_logits(graphdef, state, ids, mask):
    """Forward logits and the gradient of sum(token log-probs) w.r.t. the parameters."""

    def loss(state):
        model = nnx.merge(graphdef, state)
        lp = token_logprobs(model, ids[:, :-1], ids[:, 1:], attention_mask=mask[:, :-1])
        return jnp.sum(lp.logprobs * mask[:, 1:])

    value, grad = jax.value_and_grad(loss)(state)
    logits = nnx.merge(graphdef, state)(ids, attention_mask=mask).logits
    return logits, value, grad


@pytest.fixture(scope="module")
def plain_run():
    cfg = ModelConfig.tiny("qwen3", vocab_size=128, num_layers=3)
    plain = random_model(cfg)
    ids, mask, _ = padded_batch(np.random.RandomState(1), cfg.vocab_size, [12, 7], 12, "left")
    ids, mask = jnp.asarray(ids), jnp.asarray(mask).astype(bool)
    graphdef, state = nnx.split(plain, nnx.Param)
    return cfg, state, ids, mask, _value_grad_logits(graphdef, state, ids, mask)


@pytest.mark.parametrize(
    "variant",
    [
        dict(scan_layers=True),
        dict(remat="block"),
        dict(remat="full"),
        dict(scan_layers=True, remat="full"),
    ],
)
def test_scan_and_remat_match_plain(plain_run, variant):
    """Logits within 1e-6 (the model contract). Gradients: within 1e-5 of each tensor's largest
    entry, since rematerialisation lets XLA fuse the recomputed forward differently and the
    backward sums over B*T tokens and 3 layers re-associate: a few float32 ulps (1.2e-7 each)
    per accumulation step."""
    cfg, state, ids, mask, (l0, v0, g0) = plain_run
    other = nnx.eval_shape(lambda: Transformer(cfg.replace(**variant)))
    nnx.update(other, state)
    graphdef, state1 = nnx.split(other, nnx.Param)
    l1, v1, g1 = _value_grad_logits(graphdef, state1, ids, mask)
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), atol=1e-6, rtol=0)
    np.testing.assert_allclose(float(v1), float(v0), atol=1e-6 * abs(float(v0)), rtol=0)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, atol=1e-5 * np.abs(b).max(), rtol=0)


def test_bf16_forward_bound():
    """bf16 params and activations vs float32, same weights.

    Bound: bf16 keeps 8 significant bits, unit roundoff u = 2^-9. Along the residual path a
    logit sees about k = 4 L + 3 roundings that compound (per block: the attention and MLP
    inputs after RMSNorm, their outputs, the residual adds; then final norm, head input and the
    logit itself), so its relative error is at most about k u. We allow twice that,
    |logits_bf16 - logits_f32| <= 2 k u * max|logits_f32|, i.e. 11 * 2^-8 * max = 4.3% of
    the logit range for L = 2.
    """
    cfg = ModelConfig.tiny("llama", vocab_size=128)
    f32 = random_model(cfg)
    bf16 = nnx.eval_shape(lambda: Transformer(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16))
    nnx.update(bf16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(f32, nnx.Param)))
    ids = jnp.asarray(np.random.RandomState(2).randint(0, 128, (2, 24)))
    ref = _full(*nnx.split(f32), ids, jnp.ones(ids.shape, bool))[0]
    got = _full(*nnx.split(bf16), ids, jnp.ones(ids.shape, bool))[0]
    ref = np.asarray(ref)
    assert got.dtype == jnp.bfloat16
    k = 4 * cfg.num_layers + 3
    bound = 2 * k * 2.0**-9 * np.abs(ref).max()
    err = np.abs(np.asarray(got, np.float32) - ref).max()
    assert err <= bound, (err, bound)
    assert err > 0  # really computed in bf16


@pytest.mark.parametrize("attention", ["dense", "chunked"])
def test_float64_model_computes_in_float64(attention):
    """Under x64 a float64 model keeps float64 everywhere (RMSNorm, RoPE, softmax, log-softmax;
    forward and gradient): numerics checks rely on it (the packed vs padded update test).
    Traced only, nothing compiles."""
    cfg = ModelConfig.tiny("qwen3", vocab_size=64, attention=attention, attention_block=4)
    with jax.enable_x64(True):
        model = nnx.eval_shape(lambda: Transformer(cfg, dtype=jnp.float64, param_dtype=jnp.float64))
        graphdef, params = nnx.split(model, nnx.Param)
        ids = jnp.ones((2, 9), jnp.int32)
        logprobs = lambda p: token_logprobs(
            nnx.merge(graphdef, p), ids[:, :-1], ids[:, 1:], return_entropy=True
        )
        for fn in (logprobs, jax.grad(lambda p: logprobs(p).logprobs.sum())):
            jaxpr = str(jax.make_jaxpr(fn)(params))
            assert "f64" in jaxpr and "f32" not in jaxpr


def test_padded_query_rows_are_finite():
    model = random_model(ModelConfig.tiny("qwen3", vocab_size=64))
    mask = jnp.asarray([[0, 0, 1, 1], [1, 1, 0, 0]])
    logits, hidden = _full(*nnx.split(model), jnp.ones((2, 4), jnp.int32), mask.astype(bool))
    assert np.isfinite(np.asarray(logits)).all() and np.isfinite(np.asarray(hidden)).all()


def test_input_validation():
    model = nnx.eval_shape(lambda: Transformer(ModelConfig.tiny("qwen3", vocab_size=64)))
    with pytest.raises(ValueError, match="input_ids must be"):
        model(jnp.ones((4,), jnp.int32))
    with pytest.raises(ValueError, match=r"attention_mask shape \(2, 3\)"):
        model(jnp.ones((2, 4), jnp.int32), attention_mask=jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="positions shape"):
        model(jnp.ones((2, 4), jnp.int32), positions=jnp.ones((2, 5), jnp.int32))


# Public hyper-parameters (the models' config.json files on the Hugging Face hub).
_QWEN3 = dict(family="qwen3", vocab_size=151936, head_dim=128, qk_norm=True, rope_theta=1_000_000.0)
REAL_CONFIGS = {
    "Qwen3-0.6B": dict(
        _QWEN3,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        tie_word_embeddings=True,
    ),
    "Qwen3-1.7B": dict(
        _QWEN3,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        tie_word_embeddings=True,
    ),
    "Qwen3-4B": dict(
        _QWEN3,
        hidden_size=2560,
        intermediate_size=9728,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        tie_word_embeddings=True,
    ),
    "Qwen3-8B": dict(
        _QWEN3,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        tie_word_embeddings=False,
    ),
    "Qwen3-14B": dict(
        _QWEN3,
        hidden_size=5120,
        intermediate_size=17408,
        num_layers=40,
        num_heads=40,
        num_kv_heads=8,
        tie_word_embeddings=False,
    ),
    "Llama-3.1-8B": dict(
        family="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}
# Published counts, in billions: (total, non-embedding) from the Qwen3 model cards
# ("Number of Parameters" / "Number of Paramaters (Non-Embedding)"); Llama-3.1-8B: 8.03B, the
# count shown for meta-llama/Llama-3.1-8B on the hub (Meta's card only says "8B"), no
# non-embedding figure. The Qwen cards' "non-embedding" excludes the input embedding and, when
# untied, the LM head.
PUBLISHED = {
    "Qwen3-0.6B": ("0.6", "0.44"),
    "Qwen3-1.7B": ("1.7", "1.4"),
    "Qwen3-4B": ("4.0", "3.6"),
    "Qwen3-8B": ("8.2", "6.95"),
    "Qwen3-14B": ("14.8", "13.2"),
    "Llama-3.1-8B": ("8.03", None),
}


def _tolerance(published: str) -> float:
    """0.5% of the figure, widened to half a unit of its last digit when it is printed with
    fewer digits than that (e.g. "1.7" can only be trusted to +-0.05 = 2.9%)."""
    decimals = len(published.split(".")[1]) if "." in published else 0
    return max(0.005 * float(published), 0.5 * 10.0**-decimals)


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_real_config_parameter_counts(name):
    cfg = ModelConfig(**REAL_CONFIGS[name])
    abstract = nnx.eval_shape(lambda: Transformer(cfg, param_dtype=jnp.bfloat16))
    total = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    # Independent closed form from the hyper-parameters.
    H, F, L, N, K, D, V = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.vocab_size,
    )
    per_layer = H * N * D + 2 * H * K * D + N * D * H + 3 * H * F + 2 * H
    per_layer += 2 * D if cfg.qk_norm else 0
    embeddings = V * H * (1 if cfg.tie_word_embeddings else 2)
    assert total == L * per_layer + embeddings + H
    pub_total, pub_non_emb = PUBLISHED[name]
    assert abs(total / 1e9 - float(pub_total)) <= _tolerance(pub_total), total
    if pub_non_emb is not None:
        non_emb = (total - embeddings) / 1e9
        assert abs(non_emb - float(pub_non_emb)) <= _tolerance(pub_non_emb), non_emb


def test_packed_rows_equal_separate_sequences():
    """Segments packed into one row give each sequence's own logits (tolerance 1e-5, f32)."""
    from delta_jax.models.transformer import segment_positions

    cfg = ModelConfig.tiny("qwen3", vocab_size=128)
    model = random_model(cfg)
    graphdef, state = nnx.split(model)
    rng = np.random.RandomState(1)
    lengths = [5, 3, 7]
    seqs = [rng.randint(1, cfg.vocab_size, n).astype(np.int32) for n in lengths]
    T = sum(lengths) + 2  # two padding slots at the end
    ids = np.zeros((1, T), np.int32)
    seg = np.zeros((1, T), np.int32)
    start = 0
    for i, s in enumerate(seqs):
        ids[0, start : start + len(s)] = s
        seg[0, start : start + len(s)] = i + 1
        start += len(s)
    pos = np.asarray(segment_positions(jnp.asarray(seg)))
    np.testing.assert_array_equal(pos[0], [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 0, 0])

    @jax.jit
    def packed(state, ids, seg):
        return nnx.merge(graphdef, state)(ids, segment_ids=seg).logits

    got = np.asarray(packed(state, jnp.asarray(ids), jnp.asarray(seg)))
    start = 0
    for s in seqs:
        want, _ = _full(graphdef, state, jnp.asarray(s[None]), jnp.ones((1, len(s)), bool))
        np.testing.assert_allclose(got[0, start : start + len(s)], np.asarray(want)[0], atol=1e-5)
        start += len(s)
    assert np.isfinite(got).all()
    with pytest.raises(ValueError, match="segment_ids shape"):
        model(jnp.asarray(ids), segment_ids=jnp.asarray(seg[:, :-1]))
