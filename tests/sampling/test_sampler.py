"""Sampler against full no-cache forwards, float64 NumPy oracles and compile counters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.dispatch import BACKEND_COMPILE_EVENT

from delta_jax.models import ModelConfig, Transformer, token_logprobs
from delta_jax.sampling import Buckets, Sampler
from delta_jax.sampling.buckets import bucket_size
from tests.sampling.helpers import (
    chisquare_pvalue,
    log_softmax,
    peaked_model,
    truncated_distribution,
    truncated_logprobs,
)

PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 11], [20], [3, 3, 6, 2, 9]]
ATOL = 1e-4  # whole-model tolerance


@pytest.fixture(scope="module")
def model():
    return peaked_model()


@pytest.fixture(scope="module")
def sampler(model):
    return Sampler(model, stop_token_ids=())


class CompileCounter:
    """Counts XLA backend compilations (independent of the sampler's own counter)."""

    def __init__(self):
        self.count = 0

    def __call__(self, event, duration, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


@nnx.jit
def _forward(model, ids, mask):
    out = model(ids, attention_mask=mask)
    return out.logits, out.hidden


def _full_forward(model, out):
    """Every real row's prompt + generated tokens through the model without a cache.

    Returns per-row ``(ids, logits, hidden, generated)`` with ``logits`` / ``hidden`` at the
    positions that produce the generated tokens; rows are right-padded into one batch.
    """
    rows = []
    for row in range(out.num_rows):
        prompt = np.asarray(out.prompt_array[row])[np.asarray(out.prompt_mask_array[row])]
        rows.append((prompt, np.asarray(out.token_array[row, : out.lengths[row]])))
    width = max(p.size + g.size for p, g in rows)
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), bool)
    for i, (p, g) in enumerate(rows):
        ids[i, : p.size + g.size] = np.concatenate([p, g])
        mask[i, : p.size + g.size] = True
    logits, hidden = _forward(model, jnp.asarray(ids), jnp.asarray(mask))
    logits, hidden = np.asarray(logits, np.float64), np.asarray(hidden)
    result = []
    for i, (p, g) in enumerate(rows):
        sl = slice(p.size - 1, p.size - 1 + g.size)  # positions that produce the generated tokens
        result.append((ids[i], mask[i], logits[i, sl], hidden[i, sl], g, p.size))
    return result


def check_rows_against_full_forward(out, rows, ref, kw) -> bool:
    """Each sampled row's behaviour / untruncated log-probs and hidden states against the full
    forward (``rows`` from :func:`_full_forward`, ``ref`` its untruncated log-probs); returns
    whether the truncation removed mass somewhere (so the test had power)."""
    truncated_seen = False
    for row, (_, _, logits, hidden, gen, plen) in enumerate(rows):
        t = np.arange(gen.size)
        behaviour = truncated_logprobs(logits, **kw)[t, gen]
        untruncated = log_softmax(logits / kw["temperature"])[t, gen]
        np.testing.assert_allclose(out.logprobs[row], behaviour, atol=ATOL)
        np.testing.assert_allclose(out.untruncated_logprobs[row], untruncated, atol=ATOL)
        np.testing.assert_allclose(np.asarray(out.hidden_array[row, : gen.size]), hidden, atol=ATOL)
        np.testing.assert_allclose(
            out.untruncated_logprobs[row], ref[row, plen - 1 : plen - 1 + gen.size], atol=ATOL
        )
        truncated_seen |= bool(np.any(behaviour - untruncated > 1e-3))
    return truncated_seen


def test_logprobs_and_hidden_match_full_forward(model, sampler):
    kw = dict(temperature=0.8, top_k=20, top_p=0.9)
    out = sampler.generate(PROMPTS, max_new_tokens=12, n=2, seed=1, return_hidden=True, **kw)
    assert out.num_rows == 8 and len(out.tokens) == 8 and out.lengths == [12] * 8
    rows = _full_forward(model, out)
    # The trainer recomputes with token_logprobs at the same temperature (right-padded batch).
    ids = np.stack([r[0] for r in rows])
    mask = np.stack([r[1] for r in rows])
    ref = token_logprobs(
        model, ids[:, :-1], ids[:, 1:], attention_mask=mask[:, :-1], temperature=kw["temperature"]
    )
    ref = np.asarray(ref.logprobs)
    truncated_seen = check_rows_against_full_forward(out, rows, ref, kw)
    assert truncated_seen  # the truncation really removed mass in this setting
    # Prompt-major rows: both samples of a prompt carry that prompt.
    np.testing.assert_array_equal(out.prompt_array[0], out.prompt_array[1])


def test_greedy_is_argmax_of_full_forward(model, sampler):
    out = sampler.generate(PROMPTS, max_new_tokens=10, temperature=0.0)
    for row, (_, _, logits, _, gen, _) in enumerate(_full_forward(model, out)):
        np.testing.assert_array_equal(gen, logits.argmax(-1))
        ref = log_softmax(logits)[np.arange(gen.size), gen]
        np.testing.assert_allclose(out.logprobs[row], ref, atol=ATOL)
        np.testing.assert_allclose(out.untruncated_logprobs[row], ref, atol=ATOL)


def test_early_stopping_padding_and_loop_exit(sampler):
    free = sampler.generate(PROMPTS, max_new_tokens=12, temperature=0.0)
    # Row 0 stops at the first occurrence of its 4th token; row 1 at its own budget of 6; row 2
    # has no stop ids; row 3 stops on its first token.
    stop0 = free.tokens[0][3]
    len0 = free.tokens[0].index(stop0) + 1
    stops = [[stop0], [], [], [free.tokens[3][0]]]
    out = sampler.generate(
        PROMPTS, max_new_tokens=[12, 6, 12, 12], temperature=0.0, stop_token_ids=stops
    )
    assert out.lengths == [len0, 6, 12, 1]
    for row, length in enumerate(out.lengths):
        assert out.tokens[row] == free.tokens[row][:length]
        np.testing.assert_array_equal(np.asarray(out.token_array[row, length:]), 0)
        np.testing.assert_array_equal(np.asarray(out.logprob_array[row, length:]), 0.0)
        np.testing.assert_array_equal(np.asarray(out.untruncated_logprob_array[row, length:]), 0.0)
    assert int(out.num_steps) == 12

    # When every row stops early the loop exits after the longest row, not at the bucket (16).
    short = sampler.generate(PROMPTS, max_new_tokens=[3, 5, 2, 4], temperature=0.0)
    assert short.lengths == [3, 5, 2, 4]
    assert short.token_array.shape[1] == 16 and int(short.num_steps) == 5
    # Padding rows of the batch bucket are empty.
    out3 = sampler.generate(PROMPTS[:3], max_new_tokens=4, temperature=0.0)
    assert out3.token_array.shape[0] == 4 and int(out3.length_array[3]) == 0


def test_per_prompt_stops_apply_to_all_samples(sampler):
    free = sampler.generate(PROMPTS[:2], max_new_tokens=8, n=3, temperature=1.0, seed=5)
    stop = free.tokens[0][1]
    out = sampler.generate(
        PROMPTS[:2], max_new_tokens=8, n=3, temperature=1.0, seed=5, stop_token_ids=[[stop], []]
    )
    for row in range(6):
        ref = free.tokens[row]
        expected = ref[: ref.index(stop) + 1] if row < 3 and stop in ref else ref
        assert out.tokens[row] == expected


def test_seed_determinism(sampler):
    a = sampler.generate(PROMPTS, max_new_tokens=8, n=2, seed=7)
    b = sampler.generate(PROMPTS, max_new_tokens=8, n=2, seed=7)
    c = sampler.generate(PROMPTS, max_new_tokens=8, n=2, seed=8)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    assert a.tokens[0] != a.tokens[1]  # the n samples of a prompt differ


def test_one_compilation_per_bucket(model):
    sampler = Sampler(model, stop_token_ids=())
    with CompileCounter() as counter:
        sampler.generate(PROMPTS, max_new_tokens=20, temperature=0.7, top_p=0.9, seed=0)
        first = counter.count
        # Same buckets (4 prompts, prompt <= 16, generation <= 32, 1 stop id, nucleus on):
        # different prompts, lengths, values, seeds and stop ids must not compile anything.
        sampler.generate(
            [[1, 2], [3], [4, 5, 6], [7]],
            max_new_tokens=[30, 17, 25, 32],
            temperature=1.3,
            top_p=0.5,
            seed=3,
            stop_token_ids=[9],
        )
        sampler.generate(PROMPTS[:3], max_new_tokens=24, temperature=0.2, top_p=0.99, seed=4)
        assert sampler.num_compilations == 1 and first >= 1 and counter.count == first
        sampler.generate(PROMPTS, max_new_tokens=40, temperature=0.7, top_p=0.9)  # new bucket
        assert sampler.num_compilations == 2 and counter.count > first


def test_params_argument_and_live_model_updates(model):
    graphdef, params = nnx.split(model, nnx.Param)
    other = jax.tree.map(lambda x: x * -1.0 if x.ndim == 2 else x, params)
    ref_model = nnx.merge(graphdef, other)
    expected = Sampler(ref_model, stop_token_ids=()).generate(
        PROMPTS, max_new_tokens=8, temperature=0.0
    )
    live = nnx.merge(graphdef, params)
    sampler = Sampler(live, stop_token_ids=())
    base = sampler.generate(PROMPTS, max_new_tokens=8, temperature=0.0)
    passed = sampler.generate(PROMPTS, max_new_tokens=8, temperature=0.0, params=other)
    assert passed.tokens == expected.tokens != base.tokens
    nnx.update(live, other)  # e.g. an optimiser step on the model itself
    assert sampler.generate(PROMPTS, max_new_tokens=8, temperature=0.0).tokens == expected.tokens
    assert sampler.num_compilations == 1


def test_mesh_rows_sharded_same_tokens(model, sampler):
    """Rows over a 4 x 2 (data, tensor) mesh of the fake CPU devices: same greedy tokens."""
    devices = np.array(jax.devices()[:8]).reshape(4, 2)
    mesh = jax.sharding.Mesh(devices, ("data", "tensor"))
    expected = sampler.generate(PROMPTS[:3], max_new_tokens=8, n=2, temperature=0.0)
    out = Sampler(model, stop_token_ids=(), mesh=mesh).generate(
        PROMPTS[:3], max_new_tokens=8, n=2, temperature=0.0
    )
    assert out.tokens == expected.tokens
    assert out.token_array.shape[0] % 4 == 0
    assert out.token_array.sharding.spec[0] == "data"


def test_bfloat16_cache_runs(model):
    out = Sampler(model, cache_dtype=jnp.bfloat16, stop_token_ids=()).generate(
        PROMPTS, max_new_tokens=6, temperature=0.0
    )
    assert out.lengths == [6] * 4 and np.all(np.isfinite(np.asarray(out.logprob_array)))


def test_first_token_frequencies_end_to_end():
    """Chi-square of 4096 first tokens against the exact truncated distribution of the model."""
    cfg = ModelConfig.tiny("llama", vocab_size=16)
    m = Transformer(cfg, rngs=nnx.Rngs(0))
    _, params = nnx.split(m, nnx.Param)
    nnx.update(m, jax.tree.map(lambda x: x * 6.0 if x.ndim == 2 else x, params))
    prompt = [3, 1, 4, 1, 5]
    ids = jnp.asarray([prompt], jnp.int32)
    logits = np.asarray(_forward(m, ids, jnp.ones_like(ids, bool))[0][0, -1], np.float64)
    kw = dict(temperature=1.3, top_k=10, top_p=0.85)
    out = Sampler(m, stop_token_ids=()).generate([prompt], max_new_tokens=1, n=4096, seed=0, **kw)
    first = np.asarray(out.token_array[:, 0])
    exact = truncated_distribution(logits, **kw)
    assert 3 <= (exact > 0).sum() < 10
    assert chisquare_pvalue(first, exact) > 1e-3
    # Power: the untruncated distribution and the same truncation at a 15% different temperature
    # are both rejected by these draws.
    untruncated = truncated_distribution(logits, temperature=kw["temperature"])
    assert chisquare_pvalue(first, untruncated) < 1e-6
    wrong = truncated_distribution(logits, **dict(kw, temperature=kw["temperature"] * 1.15))
    assert chisquare_pvalue(first, wrong) < 1e-6


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([], {}, "prompts"),
        ([[1, 2], []], {}, r"prompts\[1\]"),
        ([[1, 2], [1.5]], {}, r"prompts\[1\]"),
        ([[1, 96]], {}, r"prompts\[0\].*outside"),
        ([list(range(1, 90)) * 6], {}, "max_cache_length"),
        ([[1]], dict(max_new_tokens=600), "max_cache_length"),
        ([[1]], dict(max_new_tokens=0), "max_new_tokens"),
        ([[1], [2]], dict(max_new_tokens=[4, 4, 4]), "max_new_tokens"),
        ([[1]], dict(temperature=-1.0), "temperature"),
        ([[1]], dict(top_p=0.0), "top_p"),
        ([[1]], dict(top_p=1.2), "top_p"),
        ([[1]], dict(top_k=-3), "top_k"),
        ([[1]], dict(min_p=1.0), "min_p"),
        ([[1]], dict(n=0), "n must be"),
        ([[1]], dict(stop_token_ids=[200]), "stop_token_ids"),
    ],
)
def test_bad_input_raises_before_compiling(model, prompts, kwargs, match):
    sampler = Sampler(model)
    kwargs = {"max_new_tokens": 4, **kwargs}
    with CompileCounter() as counter, pytest.raises(ValueError, match=match):
        sampler.generate(prompts, **kwargs)
    assert counter.count == 0 and sampler.num_compilations == 0


def test_buckets():
    assert [bucket_size(s, None, 16) for s in (1, 16, 17, 100)] == [16, 16, 32, 128]
    assert bucket_size(5, (8, 4, 32)) == 8
    with pytest.raises(ValueError, match="prompt length 40"):
        bucket_size(40, (8, 32), name="prompt length")


def test_explicit_buckets_and_cache_clipping(model):
    # 100-token prompt (bucket 128) + 300 new tokens (bucket 512) > 512 slots: the generation
    # bucket is clipped to the 384 slots left - one shape per prompt bucket - instead of failing.
    sampler = Sampler(model, stop_token_ids=(), buckets=Buckets(max_cache_length=512))
    out = sampler.generate([list(range(1, 90)), [5]], max_new_tokens=[300, 2], temperature=0.0)
    assert out.prompt_array.shape == (2, 128) and out.token_array.shape == (2, 384)
    assert out.lengths == [300, 2]
    explicit = Sampler(model, stop_token_ids=(), buckets=Buckets(prompt=(8, 24), generation=(5,)))
    out = explicit.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9]], max_new_tokens=5, temperature=0.0)
    assert out.prompt_array.shape == (1, 24) and out.token_array.shape == (1, 5)
    with pytest.raises(ValueError, match="max_new_tokens 6 exceeds the largest bucket 5"):
        explicit.generate([[1]], max_new_tokens=6)
