"""Cached decoding under x64: a float64 model's greedy decode, static and continuous engines,
against the full (no-cache) float64 forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from delta_jax.models import ModelConfig, Transformer
from delta_jax.sampling import Sampler
from tests.sampling.helpers import log_softmax
from tests.sampling.test_sampler import _full_forward

PROMPTS = [[5, 9, 2, 17], [7, 1, 4, 4, 8, 3], [20], list(range(30, 43))]
# float64 end to end: the cached and the full forward differ only by summation order.
ATOL = 1e-9


def _peaked_float64_model():
    """The sampling tests' peaked tiny Qwen3 (matrices x4), in float64 parameters and compute."""
    m = Transformer(
        ModelConfig.tiny("qwen3", vocab_size=96),
        dtype=jnp.float64,
        param_dtype=jnp.float64,
        rngs=nnx.Rngs(3),
    )
    _, params = nnx.split(m, nnx.Param)
    nnx.update(m, jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, params))
    return m


@pytest.mark.parametrize(
    "engine",
    [
        dict(engine="static"),
        dict(engine="continuous", decode_slots=2, page_size=4, decode_chunk=4),
        # verify steps of 3 drafted tokens (speculative decoding) on the XLA and the dense
        # path, and of tries of 6 nodes 3 deep on both (each position attends to its
        # ancestors, at the rotary position of its depth)
        *(
            dict(
                engine="continuous",
                decode_slots=2,
                page_size=4,
                decode_chunk=4,
                speculate=k > 0,
                draft_tokens=k,
                draft_depth=depth,
                attention=attention,
            )
            for attention, k, depth in (
                ("xla", 3, 0),
                ("dense", 3, 0),
                ("xla", 6, 3),
                ("dense", 6, 3),
            )
        ),
    ],
    ids=[
        "static",
        "continuous",
        "speculative-xla",
        "speculative-dense",
        "trie-xla",
        "trie-dense",
    ],
)
def test_float64_greedy_cached_decode_equals_full_forward(engine):
    with jax.enable_x64(True):  # this test only: the model, the programs and their inputs
        model = _peaked_float64_model()
        sampler = Sampler(model, stop_token_ids=(), **engine)
        out = sampler.generate(PROMPTS, max_new_tokens=10, temperature=0.0)
        assert np.asarray(out.logprobs).dtype == np.float64
        if engine.get("draft_tokens"):  # drafts were accepted: fewer verify steps than tokens
            assert 0 < out.engine_stats.verify_steps < out.engine_stats.useful_steps
        rows = _full_forward(model, out)
    distinct = set()
    for row, (_, _, logits, _, gen, _) in enumerate(rows):
        assert gen.size == 10
        np.testing.assert_array_equal(gen, logits.argmax(-1))
        ref = log_softmax(logits)[np.arange(gen.size), gen]
        np.testing.assert_allclose(out.logprobs[row], ref, rtol=0, atol=ATOL)
        np.testing.assert_allclose(out.untruncated_logprobs[row], ref, rtol=0, atol=ATOL)
        distinct |= set(gen.tolist())
    assert len(distinct) > 4  # the decode really moved through different tokens
