"""Logical axis names -> mesh mapping, activation constraints, tokenizer helpers."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core import spmd
from jax.sharding import AxisType, PartitionSpec

from delta_jax.models import (
    DEFAULT_RULES,
    ModelConfig,
    Transformer,
    apply_chat_template,
    constrain,
    load_tokenizer,
    logical_to_mesh,
    save_pretrained,
)
from tests.models.hf_helpers import random_model


def test_logical_to_mesh_rules():
    assert logical_to_mesh(("embed", "vocab"), DEFAULT_RULES) == PartitionSpec("fsdp", "tensor")
    assert logical_to_mesh(("batch", "length"), DEFAULT_RULES) == PartitionSpec(
        ("data", "fsdp"), None
    )
    assert logical_to_mesh(("unknown", None), DEFAULT_RULES) == PartitionSpec(None, None)
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    # 'data' is absent from the mesh; 6 heads do not divide over 4 -> replicated.
    assert logical_to_mesh(("batch", "heads"), DEFAULT_RULES, mesh, (8, 6)) == PartitionSpec(
        "fsdp", None
    )
    # A mesh axis is used once: embed takes fsdp, so batch keeps nothing.
    assert logical_to_mesh(("embed", "batch"), DEFAULT_RULES, mesh, (8, 8)) == PartitionSpec(
        "fsdp", None
    )
    with pytest.raises(ValueError, match="differ in length"):
        logical_to_mesh(("embed",), DEFAULT_RULES, mesh, (2, 2))


def test_params_carry_logical_names():
    model = nnx.eval_shape(
        lambda: Transformer(ModelConfig.tiny("qwen2", tie_word_embeddings=False))
    )
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    assert tuple(specs["embed"].get_value()) == ("vocab", "embed")
    assert tuple(specs["lm_head"].get_value()) == ("embed", "vocab")
    assert tuple(specs["blocks"]["wq"].get_value()) == ("layers", "embed", "heads", "head_dim")
    assert tuple(specs["blocks"]["bk"].get_value()) == ("layers", "kv_heads", "head_dim")
    assert tuple(specs["blocks"]["w_down"].get_value()) == ("layers", "mlp", "embed")


def test_constrain_noop_without_context_and_applied_with_mesh_and_rules():
    x = jnp.ones((8, 4, 16))
    assert constrain(x, ("batch", "length", "embed")) is x
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    f = jax.jit(lambda x: constrain(x * 2, ("batch", "length", "mlp")))
    with jax.set_mesh(mesh), spmd.logical_axis_rules(DEFAULT_RULES):
        y = f(x)
    assert y.sharding.spec == PartitionSpec("data", None, "tensor")
    np.testing.assert_array_equal(np.asarray(y), 2 * np.ones((8, 4, 16)))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "[UNK]", "what", "is", "1", "+", "?", "2", "system", "user"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="[UNK]"
    )
    path = str(tmp_path_factory.mktemp("tok"))
    fast.save_pretrained(path)
    return path


def test_load_tokenizer_and_plain_chat_template(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    assert tok("what is 1 + 1 ?")["input_ids"] == [3, 4, 5, 6, 5, 7]
    assert not getattr(tok, "chat_template", None)
    assert apply_chat_template(tok, "what is 1 + 1 ?", system="be brief") == (
        "System: be brief\n\nUser: what is 1 + 1 ?\n\nAssistant:"
    )
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "2"}]
    assert apply_chat_template(tok, msgs, add_generation_prompt=False) == (
        "User: hi\n\nAssistant: 2"
    )
    with pytest.raises(ValueError, match="already contain a system message"):
        apply_chat_template(tok, [{"role": "system", "content": "x"}], system="y")


def test_tokenizer_chat_template_used(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert apply_chat_template(tok, "2 + 2 ?", system="s") == "<system>s<user>2 + 2 ?<assistant>"


def test_save_pretrained_copies_tokenizer(tokenizer_dir, tmp_path):
    model = random_model(ModelConfig.tiny("llama", vocab_size=16))
    save_pretrained(model, str(tmp_path / "a"), tokenizer=tokenizer_dir)
    assert load_tokenizer(str(tmp_path / "a"))("1 + 2")["input_ids"] == [5, 6, 8]
    save_pretrained(model, str(tmp_path / "b"), tokenizer=load_tokenizer(tokenizer_dir))
    assert os.path.isfile(tmp_path / "b" / "tokenizer.json")
    assert load_tokenizer(str(tmp_path / "b"))("2 ?")["input_ids"] == [8, 7]
