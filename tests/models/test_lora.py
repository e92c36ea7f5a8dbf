"""LoRA adapters: gradients, optimiser state, sampler, merged and PEFT export.

References: the adapted model's gradient w.r.t. ``A`` / ``B`` must equal the merged model's
gradient w.r.t. ``W`` projected by the chain rule (``dA = s·G Bᵀ``, ``dB = s·Aᵀ G`` with
``W' = W + s·A B``); exports are loaded by ``transformers`` and ``peft`` (PyTorch) and compared
on logits. Tolerance 1e-4 (float32, whole model), as everywhere in tests/models.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from delta_jax.config import load_config
from delta_jax.models import from_pretrained, lora, save_pretrained
from delta_jax.rl.state import init_train_state, make_optimizer
from delta_jax.rl.train_step import make_train_step
from delta_jax.sampling import Sampler
from tests.batches import padded_batch, padded_plan
from tests.models.hf_helpers import build_hf_model, forward, hf_logits, save_hf_model

RANK, ALPHA = 4, 8.0
TOL = 1e-4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random Qwen3 (transformers) saved locally, and its directory."""
    hf = build_hf_model("qwen3_tied")
    return hf, save_hf_model(hf, str(tmp_path_factory.mktemp("base") / "qwen3"))


def _adapted(base_dir, targets=lora.ALL_TARGETS):
    """Our model of ``base_dir`` with adapters whose A and B are both random (so both matter)."""
    model = from_pretrained(base_dir)
    lora.add_adapters(model, rank=RANK, alpha=ALPHA, targets=targets, seed=1)
    rng = np.random.default_rng(2)
    for var in vars(model.blocks).values():
        if isinstance(var, nnx.LoRAParam):
            var.set_value(jnp.asarray(0.1 * rng.standard_normal(var.shape), jnp.float32))
    return model


def _merged(model):
    return lora.merge_adapters(nnx.clone(model))


def _ids(seed=0, shape=(2, 7), vocab=160):
    return np.random.default_rng(seed).integers(1, vocab, shape).astype(np.int32)


def test_adapter_gradient_is_the_full_gradient_projected(base):
    model = _adapted(base[1])
    ids = jnp.asarray(_ids())
    weights = jnp.asarray(np.random.default_rng(3).standard_normal((2, 7, 160)), jnp.float32)

    def loss(graphdef, *states):
        return jnp.mean(nnx.merge(graphdef, *states)(ids).logits * weights)

    graphdef, params = nnx.split(model, nnx.Param)
    adapters, frozen = lora.split_trainable(params)
    grad = jax.jit(jax.grad(loss, argnums=1), static_argnums=0)  # one program, not op by op
    g_adapters = grad(graphdef, adapters, frozen)

    merged_def, merged_params = nnx.split(_merged(model), nnx.Param)
    g_full = grad(merged_def, merged_params)

    s = ALPHA / RANK
    arrays = model.blocks.arrays()
    checked = 0
    for weight, _, _ in lora.TARGETS.values():
        a, b = arrays[f"{weight}_lora_a"], arrays[f"{weight}_lora_b"]
        L, r = a.shape[0], a.shape[-1]
        G = g_full["blocks"][weight][...].reshape(L, a.size // (L * r), -1)  # [L, in, out]
        want_a = s * jnp.einsum("LIO,LrO->LIr", G, b.reshape(L, r, -1))
        want_b = s * jnp.einsum("LIr,LIO->LrO", a.reshape(L, -1, r), G)
        got_a = g_adapters["blocks"][f"{weight}_lora_a"][...].reshape(want_a.shape)
        got_b = g_adapters["blocks"][f"{weight}_lora_b"][...].reshape(want_b.shape)
        assert float(jnp.abs(want_a).max()) > 1e-3  # the check is not vacuous
        np.testing.assert_allclose(got_a, want_a, atol=TOL, rtol=TOL)
        np.testing.assert_allclose(got_b, want_b, atol=TOL, rtol=TOL)
        checked += 1
    assert checked == len(lora.TARGETS)
    # The gradient tree holds adapters only: nothing is computed for the frozen base.
    leaves = jax.tree.leaves(g_adapters, is_leaf=lambda v: isinstance(v, nnx.Variable))
    assert leaves and all(isinstance(v, nnx.LoRAParam) for v in leaves)


def test_only_adapters_get_optimizer_state_and_updates(base):
    model = _adapted(base[1], targets=("q_proj", "v_proj", "down_proj"))
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = make_optimizer(load_config(None, ["optim.lr=0.01"]).optim, 10)
    state = init_train_state(jax.tree.map(jnp.copy, params), optimizer)

    def n_params(tree):
        return sum(x.size for x in jax.tree.leaves(tree) if x.ndim > 0)

    adapters = n_params(lora.split_trainable(params)[0])
    assert adapters == sum(
        v.size for v in vars(model.blocks).values() if isinstance(v, nnx.LoRAParam)
    )
    assert adapters < n_params(params) // 4
    # AdamW keeps two moments per trainable parameter, and nothing else of array size.
    assert n_params(state.opt_state) == 2 * adapters

    G, P = 6, 5
    ids = _ids(4, (4, P + G))
    response = np.arange(G)[None] < np.array([6, 4, 5, 2])[:, None]
    attention = np.concatenate([np.ones((4, P), bool), response], 1)
    batch = padded_batch(ids[None], attention[None], response[None], np.array([[1, -1, 0.5, -0.5]]))
    step = make_train_step(graphdef, optimizer, padded_plan("dapo", P, G, 4))
    new_state, metrics = step(state, jax.tree.map(jnp.asarray, batch))
    assert np.isfinite(float(metrics["grad_norm"])) and float(metrics["grad_norm"]) > 0
    before = nnx.to_flat_state(params)
    after = dict(nnx.to_flat_state(new_state.params))
    changed = {k for k, v in before if not np.array_equal(v[...], after[k][...])}
    lora_keys = {k for k, v in before if isinstance(v, nnx.LoRAParam)}
    assert changed and changed <= lora_keys  # base weights bit-identical


def test_sampler_with_adapters_equals_the_merged_model(base):
    model = _adapted(base[1])
    merged = _merged(model)
    prompts = [list(_ids(5, (9,))), list(_ids(6, (4,)))]
    kwargs = dict(max_new_tokens=8, temperature=0.0, seed=0)
    ours = Sampler(model, stop_token_ids=()).generate(prompts, **kwargs)
    ref = Sampler(merged, stop_token_ids=()).generate(prompts, **kwargs)
    assert ours.tokens == ref.tokens
    for a, b in zip(ours.logprobs, ref.logprobs, strict=True):
        np.testing.assert_allclose(a, b, atol=TOL)


def test_merged_export_loads_in_transformers(base, tmp_path):
    import transformers

    model = _adapted(base[1])
    ids = _ids(7)
    want, _ = forward(model, ids)
    save_pretrained(_merged(model), tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    got = hf_logits(hf, ids)[0]
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)
    with pytest.raises(ValueError, match="has LoRA adapters"):
        save_pretrained(model, tmp_path / "unmerged")


def test_peft_export_loads_with_peft(base, tmp_path):
    import peft

    hf, base_dir = base
    model = _adapted(base_dir, targets=("q_proj", "k_proj", "o_proj", "up_proj", "down_proj"))
    ids = _ids(8)
    want, _ = forward(model, ids)
    lora.save_peft_adapters(model, tmp_path / "adapters", base_model=base_dir)
    torch.manual_seed(0)
    fresh = build_hf_model("qwen3_tied")  # the same random base, untouched by peft
    adapted = peft.PeftModel.from_pretrained(fresh, str(tmp_path / "adapters")).eval()
    with torch.no_grad():
        got = adapted(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    base_logits = hf_logits(hf, ids)[0]
    assert np.abs(base_logits - want).max() > 1e-2  # the adapters change the output
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)


def test_fresh_adapters_are_float32_and_leave_a_bfloat16_base_unchanged():
    from delta_jax.models import ModelConfig, Transformer

    model = Transformer(ModelConfig.tiny("qwen3"), param_dtype=jnp.bfloat16)
    ids = _ids(9, (2, 5), vocab=256)
    before, _ = forward(model, ids)
    lora.add_adapters(model, rank=2, alpha=4.0, targets=("q_proj", "down_proj"))
    assert model.blocks.wq_lora_a.dtype == model.blocks.w_down_lora_b.dtype == jnp.float32
    assert model.blocks.wq.dtype == jnp.bfloat16
    after, _ = forward(model, ids)
    # B = 0: the adapted model is the base model. Not bitwise: the adapted program is another
    # XLA program (the adapter term fuses with the base matmul), so f32 rounding may differ by
    # an ulp or so; 1e-6 is the single-op bound of tests/models, far below a real adapter effect.
    np.testing.assert_allclose(after, before, atol=1e-6, rtol=0)
