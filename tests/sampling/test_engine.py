"""Continuous-batching engine: parity with transformers and full forwards, scheduling-independent
determinism, page accounting, limits, sharding and compile-only TPU lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from delta_jax.models import ModelConfig, Transformer, from_pretrained, token_logprobs
from delta_jax.sampling import Buckets, Sampler
from delta_jax.sampling.engine.requests import EngineSpec, assign_groups
from tests.sampling.helpers import (
    chisquare_pvalue,
    peaked_model,
    truncated_distribution,
)
from tests.sampling.test_hf_parity import CONFIGS, PAD
from tests.sampling.test_sampler import (
    CompileCounter,
    _forward,
    _full_forward,
    check_rows_against_full_forward,
)

# Prompt lengths around page boundaries (page_size 4: prefixes of 0, 3, 4, 5 and 12 tokens).
PROMPTS = [[5, 9, 2, 17], [7, 1, 4, 4, 8, 3], [20], [3, 3, 6, 2, 9], list(range(30, 43))]
BUDGETS = [9, 3, 14, 6, 11]
PAGE = 4


def engine(model, **kw) -> Sampler:
    kw = {"decode_slots": 4, "page_size": PAGE, "decode_chunk": 4, **kw}
    return Sampler(model, stop_token_ids=(), engine="continuous", **kw)


@pytest.fixture(scope="module")
def model():
    return peaked_model()


@pytest.fixture(scope="module")
def small(model):
    """One engine shared by tests: 8 slots for 10 sequences, so slots are refilled."""
    return engine(model, decode_slots=8)


def _hf_greedy(hf_model, prompts, new_tokens):
    """Each prompt alone through transformers' generate (no padding involved)."""
    out = []
    for p, budget in zip(prompts, new_tokens, strict=True):
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = hf_model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=budget,
                min_new_tokens=budget,
                do_sample=False,
                pad_token_id=PAD,
                eos_token_id=None,
            )
        out.append(gen[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_greedy_matches_transformers_with_refilled_slots(tmp_path, family):
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
    hf_model.generation_config.eos_token_id = None
    hf_model.save_pretrained(tmp_path)
    expected = _hf_greedy(hf_model, PROMPTS, BUDGETS)
    sampler = engine(from_pretrained(tmp_path), decode_slots=2)
    out = sampler.generate(PROMPTS, max_new_tokens=BUDGETS, temperature=0.0)
    assert out.lengths == BUDGETS
    assert out.tokens == expected
    assert len({t for row in expected for t in row}) > 10
    stats = out.engine_stats
    assert stats.chunks > 1 and stats.useful_steps == sum(BUDGETS)


def test_logprobs_and_hidden_match_full_forward(model, small):
    kw = dict(temperature=0.8, top_k=20, top_p=0.9)
    out = small.generate(PROMPTS, max_new_tokens=BUDGETS, n=2, seed=1, return_hidden=True, **kw)
    assert out.lengths == [b for b in BUDGETS for _ in range(2)]
    rows = _full_forward(model, out)
    ids = np.stack([r[0] for r in rows])
    mask = np.stack([r[1] for r in rows])
    ref = np.asarray(
        token_logprobs(
            model, ids[:, :-1], ids[:, 1:], attention_mask=mask[:, :-1], temperature=0.8
        ).logprobs
    )
    truncated_seen = check_rows_against_full_forward(out, rows, ref, kw)
    assert truncated_seen
    assert out.tokens[0] != out.tokens[1]  # samples of one prompt draw their own tokens


def test_same_tokens_for_any_slot_count_and_tight_pool(model, small):
    """4 slots with a pool too small for them (preemptions) vs 32 slots: same draws."""
    kw = dict(max_new_tokens=BUDGETS, n=3, temperature=1.0, seed=11)
    # 9 usable pages: one sequence (prompt 4, 12-token prefix + 11 new) needs 3 + 6 pages, so
    # the four slots cannot all grow; sequences are preempted and recomputed later.
    few = engine(model, decode_slots=4, num_pages=10).generate(PROMPTS, **kw)
    many = engine(model, decode_slots=32).generate(PROMPTS, **kw)
    assert few.engine_stats.preemptions > 0 and many.engine_stats.preemptions == 0
    assert few.tokens == many.tokens
    np.testing.assert_allclose(
        np.asarray(few.logprob_array), np.asarray(many.logprob_array), atol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(few.untruncated_logprob_array),
        np.asarray(many.untruncated_logprob_array),
        atol=1e-5,
    )
    assert few.engine_stats.free_pages_after == (9,)
    assert few.engine_stats.chunks > many.engine_stats.chunks
    assert small.generate(PROMPTS, **kw).tokens == few.tokens
    assert small.generate(PROMPTS, **dict(kw, seed=12)).tokens != few.tokens


def test_prompt_pages_are_shared_and_all_freed(model, small):
    """n = 8 samples of a 101-token prompt: 100 prefix tokens = 25 pages, stored once."""
    prompt = [int(i) for i in np.random.default_rng(0).integers(1, 96, 101)]
    out = small.generate([prompt], max_new_tokens=3, n=8, temperature=0.0)
    stats = out.engine_stats
    # Prefix positions 0..99 fill 25 shared pages; each sample writes positions 100..101 into
    # one own page. Without sharing the 8 samples would hold 8 x 26 = 208 pages.
    assert stats.high_water_pages == (25 + 8,)
    assert stats.free_pages_after == (stats.group_pages - 1,)
    assert len(set(map(tuple, out.tokens))) == 1  # greedy: every sample the same

    # A partially filled last prompt page is copied per sample, never written in place: the
    # samples of a 7-token prompt (prefix 6 = 1.5 pages) match the static sampler exactly.
    static = Sampler(model, stop_token_ids=())
    prompts = [[4, 8, 15, 16, 23, 42, 7], [9, 9, 1]]
    got = small.generate(prompts, max_new_tokens=9, n=4, temperature=0.0)
    want = static.generate(prompts, max_new_tokens=9, n=4, temperature=0.0)
    assert got.tokens == want.tokens
    assert got.engine_stats.free_pages_after == (got.engine_stats.group_pages - 1,)


def test_stops_and_limits_match_static(model, small):
    static = Sampler(model, stop_token_ids=())
    free = static.generate(PROMPTS, max_new_tokens=12, temperature=0.0)
    stops = [[free.tokens[0][3]], [], [], [free.tokens[3][0]], []]
    kw = dict(max_new_tokens=[12, 6, 12, 12, 2], temperature=0.0, stop_token_ids=stops)
    want = static.generate(PROMPTS, **kw)
    got = small.generate(PROMPTS, **kw)
    assert got.lengths == want.lengths and got.lengths[1:] == [6, 12, 1, 2]
    assert got.tokens == want.tokens
    for row, length in enumerate(got.lengths):
        np.testing.assert_array_equal(np.asarray(got.token_array[row, length:]), 0)
        np.testing.assert_array_equal(np.asarray(got.logprob_array[row, length:]), 0.0)
    assert int(got.num_steps) == 12 and got.token_array.shape == (5, 16)


def test_no_recompilation_within_buckets(small):
    with CompileCounter() as counter:
        small.generate(PROMPTS, max_new_tokens=BUDGETS, temperature=0.7, top_p=0.9, seed=0)
        first, programs = counter.count, small.num_compilations
        # Same buckets and row lengths; other ids, sampling values and seed: nothing compiles.
        other = [[(t * 7 + 3) % 96 for t in p] for p in PROMPTS]
        small.generate(other, max_new_tokens=BUDGETS, temperature=1.3, top_p=0.5, seed=3)
        assert first >= 1 and counter.count == first
        assert small.num_compilations == programs
        small.generate([list(range(1, 40))], max_new_tokens=4, temperature=0.7, top_p=0.9)
        assert small.num_compilations > programs  # a new prompt bucket


def test_first_token_frequencies():
    """Chi-square of 2048 first tokens (256 prompts x 8 samples) against the exact law."""
    cfg = ModelConfig.tiny("llama", vocab_size=16)
    m = Transformer(cfg, rngs=nnx.Rngs(0))
    _, params = nnx.split(m, nnx.Param)
    nnx.update(m, jax.tree.map(lambda x: x * 6.0 if x.ndim == 2 else x, params))
    prompt = [3, 1, 4, 1, 5]
    ids = jnp.asarray([prompt], jnp.int32)
    logits = np.asarray(_forward(m, ids, jnp.ones_like(ids, bool))[0][0, -1], np.float64)
    kw = dict(temperature=1.3, top_k=10, top_p=0.85)
    sampler = Sampler(m, stop_token_ids=(), engine="continuous", decode_slots=256, decode_chunk=1)
    out = sampler.generate([prompt] * 256, max_new_tokens=1, n=8, seed=0, **kw)
    first = np.asarray(out.token_array[:, 0])
    exact = truncated_distribution(logits, **kw)
    assert chisquare_pvalue(first, exact) > 1e-3
    untruncated = truncated_distribution(logits, temperature=kw["temperature"])
    assert chisquare_pvalue(first, untruncated) < 1e-6


def _data_tensor_mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "tensor"))


def test_mesh_data_groups_same_tokens_as_one_device(model, small):
    """4 data groups x 2 KV-head shards: each group runs its own 2 slots over its own share of
    the pool (group-local pages); the tokens are those of one device."""
    kw = dict(max_new_tokens=BUDGETS, n=2, temperature=1.0, seed=2)
    want = small.generate(PROMPTS, **kw)
    got = engine(model, mesh=_data_tensor_mesh(), decode_slots=8).generate(PROMPTS, **kw)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(
        np.asarray(got.logprob_array), np.asarray(want.logprob_array), atol=1e-5
    )
    # Prompts by decreasing work (length + budgets) to the least-loaded group: prompt 4 alone
    # in group 0, 2 in group 1, 0 in group 2, prompts 3 then 1 in group 3.
    owner = assign_groups([np.asarray(p) for p in PROMPTS], 2, np.repeat(BUDGETS, 2), 4)
    assert owner == [2, 3, 1, 3, 0]
    # Each group's high-water mark, its prompt pages stored once for both samples (page 4):
    # g0: prompt 4 (prefix 12: 3 shared pages) + 2 x positions 12..22 (3 pages) = 9;
    # g1: prompt 2 (no prefix) 2 x positions 0..13 (4 pages) = 8; g2: prompt 0 (prefix 3: one
    # shared partial page) + 2 x positions 0..11 (3 pages) = 7; g3: prompt 3 (1 shared page +
    # 2 x 2) = 5, then prompt 1 (2 shared + 2 x 1) = 4.
    stats = got.engine_stats
    assert stats.high_water_pages == (9, 8, 7, 5)
    assert stats.free_pages_after == (stats.group_pages - 1,) * 4


def test_samples_of_a_prompt_must_fit_one_data_group(model):
    sampler = engine(model, mesh=_data_tensor_mesh(), decode_slots=8)
    match = "n=3 samples per prompt exceeds the 2 decode slots of one data group"
    with CompileCounter() as counter, pytest.raises(ValueError, match=match):
        sampler.generate(PROMPTS, max_new_tokens=4, n=3)
    assert counter.count == 0


@pytest.mark.parametrize(
    "kwargs, generate, match",
    [
        (dict(num_pages=4), dict(max_new_tokens=8), "too small for one sequence"),
        (dict(decode_slots=2), dict(max_new_tokens=4, n=3), "exceeds decode_slots"),
        (dict(buckets=Buckets(prompt=(8,))), dict(max_new_tokens=4), "exceeds the largest"),
    ],
)
def test_bad_input_raises_before_compiling(model, kwargs, generate, match):
    sampler = engine(model, **kwargs)
    prompts = [list(range(1, 12)), [5]]
    with CompileCounter() as counter, pytest.raises(ValueError, match=match):
        sampler.generate(prompts, **generate)
    assert counter.count == 0 and sampler.num_compilations == 0


@pytest.mark.parametrize(
    ("draft_tokens", "draft_depth", "attention"),
    [(0, 0, "pallas"), (3, 0, "pallas"), (6, 3, "pallas")],
    ids=["decode", "speculative", "trie"],
)
def test_decode_compiles_for_tpu_with_ragged_paged_attention(draft_tokens, draft_depth, attention):
    """The decode program with JAX's Pallas kernel, compiled for a v5p 2x2x1 slice (no TPU);
    also the speculative chunk (verify steps of 3 drafted tokens: 4 queries per slot), and
    verify steps of tries of 6 drafts 3 deep (this package's trie kernel, beside JAX's for the
    chunk's plain steps)."""
    topologies = pytest.importorskip("jax.experimental.topologies")
    pytest.importorskip("libtpu")
    from delta_jax.plan.lowering import lower_decode
    from delta_jax.sampling import SAMPLING_RULES

    topo = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu")
    mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(2, 2), ("data", "tensor"))
    cfg = ModelConfig.tiny(
        "qwen3", num_heads=8, num_kv_heads=4, head_dim=128, hidden_size=256, intermediate_size=512
    )
    spec = EngineSpec(
        slots=8,
        steps=4,
        page_size=16,
        num_pages=64,
        seq_pages=8,
        max_table=8,
        prefill_len=64,
        min_len=16,
        prefill_rows=8,
        groups=2,
        attention=attention,
        return_hidden=False,
        pad_id=0,
        draft_tokens=draft_tokens,
        draft_depth=draft_depth,
        draft_window=64,
    )
    lowered = lower_decode(cfg, mesh, SAMPLING_RULES, spec)
    # The Mosaic kernels, not an XLA fallback
    text = lowered.as_text()
    assert "tpu_custom_call" in text
    assert ("trie_attention" in text) == (draft_depth > 0)
    compiled = lowered.compile()
    # Each chip holds its data group's half of the pages and its half of the K/V heads.
    pool = compiled.input_shardings[0][1].kv[0]  # (weights, pool, ...)
    assert pool.shard_shape((64, 16, 8, 128)) == (32, 16, 4, 128)
    assert compiled.memory_analysis().temp_size_in_bytes > 0


def _trainer_default_engine(model):
    """The rollout config's defaults and a continuous engine with them (no stop ids)."""
    from delta_jax.config import RolloutConfigSection

    r = RolloutConfigSection()
    sampler = Sampler(
        model,
        stop_token_ids=(),
        engine="continuous",
        decode_slots=r.decode_slots,
        page_size=r.page_size,
        num_pages=r.num_pages or None,
    )
    return r, sampler


@pytest.mark.parametrize("n", [1, 2, 8, 32])
def test_trainer_defaults_run_without_idle_slots_or_preemption(model, n):
    """A 32-row rollout with the trainer's default engine settings (64 decode slots, pages of
    16, the default pool): the slots are capped at the 32 rows and the pool holds every
    sequence, for any n. Equal budgets, prompts ending anywhere in a page."""
    r, sampler = _trainer_default_engine(model)
    rng = np.random.default_rng(n)
    prompts = [rng.integers(1, 96, int(rng.integers(2, 40))).tolist() for _ in range(32 // n)]
    out = sampler.generate(prompts, max_new_tokens=20, n=n, temperature=1.0, seed=n)
    stats = out.engine_stats
    assert out.lengths == [20] * 32
    assert stats.preemptions == 0
    assert stats.occupancy >= 0.95, stats
    assert stats.useful_steps == 32 * 20
    assert stats.free_pages_after == (stats.group_pages - 1,)


@pytest.mark.parametrize("n", [1, 3, 8, 64])
def test_the_default_pool_never_preempts_while_slots_are_refilled(model, n):
    """192 ragged rows on the trainer's 64 decode slots with the default pool (sized for what
    running sequences hold, ``Sampler.num_pages``): prompts of 1-60 tokens (one to four prompt
    pages), budgets of 4-40 tokens per row and no stop ids. Slots are refilled as rows end and
    prompts join next to running ones, and no sequence is ever preempted, for n = 1, 3 (a
    prompt's samples split over a refill: 64 slots are 21 groups and one sample), 8 and the
    whole slot set."""
    r, sampler = _trainer_default_engine(model)
    rows = 3 * r.decode_slots
    rng = np.random.default_rng(n)
    prompts = [rng.integers(1, 96, int(rng.integers(1, 61))).tolist() for _ in range(rows // n)]
    budgets = rng.integers(4, 41, rows).tolist()
    out = sampler.generate(prompts, max_new_tokens=budgets, n=n, temperature=1.0, seed=n)
    stats = out.engine_stats
    assert out.lengths == budgets  # no stop ids: every row wrote its whole budget
    assert stats.preemptions == 0
    # Refills: 64 slots that each ran one sequence would have written at most 64 x 40 tokens.
    assert stats.useful_steps == sum(budgets) > r.decode_slots * max(budgets)
    assert stats.free_pages_after == (stats.group_pages - 1,)


def test_ragged_tail_decodes_on_fewer_rows(model):
    """8 slots, a long sequence and 7 short ones: the first chunk ends where at most half its
    rows are busy (4 steps, the chunk length), then the long one decodes on one row (the
    smallest bucket, an eighth of the slots) instead of 8, and draws the same tokens as one
    slot decoding the sequences one after another."""
    prompts, budgets = [[4, 8, 15], [16, 23], [42, 7, 9, 1], [5]] * 2, [40] + [2] * 7
    kw = dict(max_new_tokens=budgets, temperature=1.0, seed=5)
    got = engine(model, decode_slots=8).generate(prompts, **kw)
    want = engine(model, decode_slots=1).generate(prompts, **kw)
    assert got.tokens == want.tokens and got.lengths == budgets
    stats = got.engine_stats
    assert stats.useful_steps == 40 + 7 * 2
    assert stats.decode_steps == 8 * 4 + 1 * 36  # 8 rows x 40 steps without the buckets


def test_late_sequence_next_to_a_long_context_on_the_dense_path(model):
    """The dense path's right-aligned views put every slot's next token at the column of the
    longest context: a sequence that joins next to one near its end (here next to the 13-token
    prompt's sequence at position 24, in chunks of 12 steps) needs more columns than the
    widest table has, so that chunk runs fewer steps. Same draws as 5 slots at once."""
    prompts = [list(range(30, 43)), [7, 1, 4], [20, 5], [9, 9, 2, 6], [11]]
    kw = dict(max_new_tokens=16, temperature=1.0, seed=12, stop_token_ids=list(range(0, 96, 9)))
    got = engine(model, decode_slots=2, decode_chunk=12).generate(prompts, **kw)
    want = engine(model, decode_slots=5).generate(prompts, **kw)
    assert got.lengths == [16, 2, 11, 16, 16]
    assert got.tokens == want.tokens
    np.testing.assert_allclose(
        np.asarray(got.logprob_array), np.asarray(want.logprob_array), atol=1e-5
    )


def test_one_decode_slot_with_the_default_pool(model):
    """One slot runs the sequences one after another; the default pool holds one sequence."""
    got = engine(model, decode_slots=1).generate(PROMPTS, max_new_tokens=BUDGETS, temperature=0.0)
    want = Sampler(model, stop_token_ids=()).generate(
        PROMPTS, max_new_tokens=BUDGETS, temperature=0.0
    )
    assert got.tokens == want.tokens
    assert got.engine_stats.preemptions == 0


def test_samples_are_handed_over_as_soon_as_they_end(model, small):
    """on_sample_done: the continuous engine reports each row when it ends, while the others
    decode (here all run at once: in budget order); the static sampler after the batch, in row
    order; both with the tokens of the returned output."""
    # One step per chunk, so that the hand-over order is the order in which rows end.
    runs = {
        "continuous": engine(model, decode_slots=10, decode_chunk=1),
        "static": Sampler(model, stop_token_ids=()),
    }
    budgets = np.repeat(BUDGETS, 2)
    for name, sampler in runs.items():
        calls = []
        out = sampler.generate(
            PROMPTS,
            n=2,
            max_new_tokens=BUDGETS,
            temperature=0.0,
            on_sample_done=lambda row, tokens, calls=calls: calls.append((row, tokens)),
        )
        rows = [row for row, _ in calls]
        assert sorted(rows) == list(range(len(budgets))), name
        for row, tokens in calls:
            assert tokens == out.tokens[row]
        if name == "continuous":
            assert (np.diff(budgets[rows]) >= 0).all(), rows
        else:
            assert rows == list(range(len(budgets)))


def test_lora_adapters_are_sampled():
    """A model with LoRA adapters (non-zero B): the engine's paged blocks apply them, as the
    static sampler's blocks do (the trainer samples the adapted policy with the engine)."""
    from delta_jax.models import lora

    model = Transformer(ModelConfig.tiny("qwen3"))
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    kw = dict(max_new_tokens=8, temperature=0.0)
    base = Sampler(model, stop_token_ids=()).generate(prompts, **kw).tokens
    lora.add_adapters(model, rank=4, alpha=8.0)
    for i, name in enumerate(sorted(n for n in vars(model.blocks) if n.endswith("_lora_b"))):
        var = getattr(model.blocks, name)
        var.set_value(0.5 * jax.random.normal(jax.random.key(i), var.get_value().shape))
    want = Sampler(model, stop_token_ids=()).generate(prompts, **kw)
    got = engine(model, decode_slots=2).generate(prompts, **kw)
    assert want.tokens != base  # the adapters change what is sampled
    assert got.tokens == want.tokens
    np.testing.assert_allclose(
        np.asarray(got.logprob_array), np.asarray(want.logprob_array), atol=1e-5
    )


@pytest.mark.parametrize("attention", ["dense", "xla"])
def test_prompts_prefilled_in_several_chunks(model, attention):
    """Prompts longer than ``prefill_chunk`` are prefilled in chunks whose tokens attend to
    the earlier chunks' pages (page tables on the dense CPU path, page lists on the XLA path):
    the same tokens as the static sampler."""
    prompts = [list(range(1, 24)), [5, 9, 2], list(range(40, 59))]
    kw = dict(max_new_tokens=6, temperature=0.0)
    want = Sampler(model, stop_token_ids=()).generate(prompts, **kw)
    sampler = engine(model, prefill_chunk=4, attention=attention, buckets=Buckets(min_length=4))
    got = sampler.generate(prompts, **kw)
    assert got.engine_stats.prefill_calls >= 6  # 22 prefix tokens in chunks of 4
    assert got.tokens == want.tokens
