"""Attention implementations (delta_jax.models.attention) against each other and references.

Tolerances (float32 on CPU): ``dense`` against a NumPy float64 oracle 1e-5; every other
implementation's output and gradients (q, k, v) against ``dense`` 1e-5; whole-model logits with
``attention=chunked`` / ``splash`` against ``transformers`` 1e-4 (as tests/models/test_hf_parity).
``splash`` runs the Pallas TPU kernel in interpret mode here, which is slow: its cases are small.
"""

import contextlib
import functools
import io
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from delta_jax.models import ModelConfig, Transformer, from_pretrained
from delta_jax.models import attention as attn
from tests.models.hf_helpers import build_hf_model, forward, hf_logits, padded_batch, save_hf_model

TOL = 1e-5
WHOLE_MODEL_TOL = 1e-4


def _segments(B, T, rng):
    """Row 0: three packed segments then padding; row 1: left and right padding; others: full."""
    seg = np.ones((B, T), np.int32)
    cuts = sorted(rng.choice(np.arange(5, T - 10), 3, replace=False))
    seg[0, : cuts[0]] = 1
    seg[0, cuts[0] : cuts[1]] = 2
    seg[0, cuts[1] : cuts[2]] = 3
    seg[0, cuts[2] :] = 0
    if B > 1:
        seg[1, : T // 7] = 0
        seg[1, T - T // 5 :] = 0
    return seg


def _inputs(B, T, N, K, D, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (
        jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32) for H in (N, K, K)
    )  # fmt: skip
    cot = jnp.asarray(rng.normal(size=(B, T, N, D)), jnp.float32)
    return q, k, v, jnp.asarray(_segments(B, T, rng)), cot


def _value_and_grads(impl, q, k, v, seg, cot, **kw):
    fn = jax.jit(lambda q, k, v: attn.attention(q, k, v, seg, impl=impl, **kw))
    out = fn(q, k, v)
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * cot), argnums=(0, 1, 2)))
    return out, grads(q, k, v)


def _oracle(q, k, v, seg):
    """NumPy float64 reference of the module's definition."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, N, D = q.shape
    G = N // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    s = np.einsum("btnd,bsnd->bnts", q, k) / np.sqrt(D)
    see = np.tril(np.ones((T, T), bool))[None] & (seg[:, :, None] == seg[:, None, :])
    s = np.where(see[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnd->btnd", p, v)


def test_dense_matches_float64_oracle():
    q, k, v, seg, _ = _inputs(3, 97, 4, 2, 16)
    out = attn.attention(q, k, v, seg, impl="dense")
    np.testing.assert_allclose(out, _oracle(q, k, v, np.asarray(seg)), atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "impl, B, T, block",
    [
        ("chunked", 3, 1000, 128),  # 8 x 8 blocks, the last one partial
        ("chunked", 2, 77, 512),  # one block shorter than the block size
        ("splash", 2, 300, 128),  # padded to 384: 3 x 3 kernel blocks
    ],
)
def test_impl_matches_dense_output_and_gradients(impl, B, T, block):
    q, k, v, seg, cot = _inputs(B, T, 4, 2, 16, seed=T)
    ref_out, ref_grads = _value_and_grads("dense", q, k, v, seg, cot)
    out, grads = _value_and_grads(impl, q, k, v, seg, cot, block=block)
    np.testing.assert_allclose(out, ref_out, atol=TOL, rtol=0)
    for name, got, ref in zip("qkv", grads, ref_grads, strict=True):
        np.testing.assert_allclose(got, ref, atol=TOL, rtol=0, err_msg=f"d{name}")


def _shared_prompts(B, T, rng):
    """Rows of a prompt and three of its responses (parents: the prompt's segment), then a
    sequence of its own, then padding; ``(segment_ids, parent_ids)``."""
    seg, parent = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(3, T - 3), 5, replace=False))
        bounds = [0, *cuts]
        for i, (lo, hi) in enumerate(itertools.pairwise(bounds), start=1):
            seg[b, lo:hi] = i
            parent[b, lo:hi] = 1 if i <= 4 else i  # segments 2-4 continue prompt 1
    return seg, parent


def _shared_oracle(q, k, v, seg, parent):
    """NumPy float64: s <= t, and s in t's segment or t's parent's (the module's definition)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    T, D, G = q.shape[1], q.shape[3], q.shape[2] // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    s = np.einsum("btnd,bsnd->bnts", q, k) / np.sqrt(D)
    mine = (seg[:, :, None] == seg[:, None, :]) | (parent[:, :, None] == seg[:, None, :])
    see = np.tril(np.ones((T, T), bool))[None] & mine
    s = np.where(see[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bnts,bsnd->btnd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize(
    "impl, T, block", [("dense", 61, 512), ("chunked", 300, 64), ("splash", 300, 128)]
)
def test_shared_prompts_match_the_oracle_and_dense_gradients(impl, T, block):
    """A response sees its prompt and its own earlier tokens, not its siblings'."""
    q, k, v, _, cot = _inputs(2, T, 4, 2, 16, seed=T)
    seg, parent = _shared_prompts(2, T, np.random.default_rng(T))
    kw = dict(parent_ids=jnp.asarray(parent), block=block)
    out, grads = _value_and_grads(impl, q, k, v, jnp.asarray(seg), cot, **kw)
    np.testing.assert_allclose(out, _shared_oracle(q, k, v, seg, parent), atol=TOL, rtol=0)
    # Not the plain segment mask: the responses' prompt matters.
    assert np.abs(np.asarray(out) - _oracle(q, k, v, seg)).max() > 0.1
    _, ref = _value_and_grads("dense", q, k, v, jnp.asarray(seg), cot, parent_ids=kw["parent_ids"])
    for name, got, want in zip("qkv", grads, ref, strict=True):
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0, err_msg=f"d{name}")


def test_splash_at_1000_tokens_matches_dense():
    q, k, v, seg, cot = _inputs(1, 1000, 4, 1, 16, seed=1)
    ref_out, ref_grads = _value_and_grads("dense", q, k, v, seg, cot)
    out, grads = _value_and_grads("splash", q, k, v, seg, cot, block=512)
    np.testing.assert_allclose(out, ref_out, atol=TOL, rtol=0)
    for got, ref in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


def test_splash_under_mesh_matches_dense():
    """Sharded over batch (data) and heads (tensor) through shard_map on the 8 fake devices."""
    from delta_jax import sharding as sh

    q, k, v, seg, cot = _inputs(4, 200, 4, 2, 16, seed=3)
    ref_out, ref_grads = _value_and_grads("dense", q, k, v, seg, cot)
    mesh = sh.make_mesh(2, 2, 2)
    with sh.use_mesh(mesh):
        out, grads = _value_and_grads("splash", q, k, v, seg, cot, block=128)
    np.testing.assert_allclose(out, ref_out, atol=TOL, rtol=0)
    for got, ref in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


def test_auto_choice_by_platform_and_length(caplog):
    with caplog.at_level("INFO", logger="delta_jax.models.attention"):
        assert attn.resolve_impl("auto", 8192, "tpu") == "splash"
        assert attn.resolve_impl("auto", 8192, "gpu") == "cudnn"
        assert attn.resolve_impl("auto", attn.DENSE_MAX_LENGTH, "cpu") == "dense"
        assert attn.resolve_impl("auto", attn.DENSE_MAX_LENGTH + 1, "cpu") == "chunked"
    assert "model.attention=auto: chunked on cpu" in caplog.text
    assert attn.resolve_impl("splash", 16, "cpu") == "splash"


def test_bad_input_errors_name_the_key():
    q, k, v, seg, _ = _inputs(1, 32, 4, 2, 16)
    with pytest.raises(ValueError, match=r"model.attention='cudnn' needs a CUDA GPU.*'chunked'"):
        attn.attention(q, k, v, seg, impl="cudnn")
    with pytest.raises(ValueError, match=r"model.attention_block=100: .*multiple of 128"):
        attn.attention(q, k, v, seg, impl="splash", block=100)
    with pytest.raises(ValueError, match=r"model.attention_block=200: .*multiple of 128"):
        ModelConfig.tiny(attention="splash", attention_block=200)
    with pytest.raises(ValueError, match=r"model.attention='flash'; expected one of"):
        ModelConfig.tiny(attention="flash")
    with pytest.raises(ValueError, match=r"model.remat='some'; expected one of"):
        ModelConfig.tiny(remat="some")


@functools.cache
def _model_loss_grads(cfg, T=60):
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, T)))
    seg = jnp.asarray(_segments(2, T, rng))
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    @jax.jit
    def loss(params):
        out = nnx.merge(graphdef, params)(ids, segment_ids=seg)
        return jnp.sum(jnp.where(seg[..., None] > 0, out.logits, 0.0) ** 2) / 1e3

    return jax.value_and_grad(loss)(params)


@pytest.mark.parametrize(
    "changes",
    [
        dict(attention="chunked", attention_block=16),
        dict(attention="chunked", attention_block=16, remat="matmuls", scan_layers=True),
        dict(remat="block"),
        dict(remat="full"),
    ],
)
def test_model_packed_rows_loss_and_grads_match_dense(changes):
    """Whole model on packed rows: implementations and remat policies change no number."""
    cfg = ModelConfig.tiny("qwen3", attention="dense")
    ref_loss, ref_grads = _model_loss_grads(cfg)
    got_loss, got_grads = _model_loss_grads(cfg.replace(**changes))
    np.testing.assert_allclose(got_loss, ref_loss, rtol=TOL)
    for ref, got in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(got_grads), strict=True):
        np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


def test_remat_matmuls_keeps_named_matmuls_only():
    """remat="matmuls" saves the weight matmuls' and attention's outputs, no [T, T] buffer."""
    cfg = ModelConfig.tiny("qwen3", attention="dense", remat="matmuls", num_layers=1)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    T = 24
    ids = jnp.ones((2, T), jnp.int32)

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params)(ids).hidden)

    with contextlib.redirect_stdout(io.StringIO()) as report:
        jax.ad_checkpoint.print_saved_residuals(loss, params)
    lines = [line for line in report.getvalue().splitlines() if "from the argument" not in line]
    # q, k, v, o, gate and up projections (no backward rule needs the down projection's output)
    # and the attention output; nothing [..., T, T].
    assert sum("named 'matmul'" in line for line in lines) == 6, lines
    assert sum("named 'attention'" in line for line in lines) == 1, lines
    assert not any(f"{T},{T}]" in line for line in lines), lines


@pytest.mark.parametrize("kind", ["qwen3_tied", "llama31_untied"])
@pytest.mark.parametrize("impl", ["chunked", "splash"])
def test_whole_model_matches_transformers(kind, impl, tmp_path):
    hf = build_hf_model(kind)
    path = save_hf_model(hf, str(tmp_path / kind))
    ours = from_pretrained(path, attention=impl, attention_block=128 if impl == "splash" else 16)
    assert ours.config.attention == impl
    ids, mask, positions = padded_batch(
        np.random.RandomState(2), hf.config.vocab_size, [40, 33, 9], 40, "left"
    )
    ref_logits, _, _ = hf_logits(hf, ids, mask, positions)
    logits, _ = forward(ours, ids, mask)
    valid = mask.astype(bool)
    np.testing.assert_allclose(logits[valid], ref_logits[valid], atol=WHOLE_MODEL_TOL, rtol=0)
