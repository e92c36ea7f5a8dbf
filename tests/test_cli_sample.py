"""``delta-jax sample`` on a model whose context is shorter than the default 256 new tokens plus
the prompt (the demo model's 256 positions): the default fills what the context leaves."""

from flax import nnx

from delta_jax import cli
from delta_jax.demo import build_char_tokenizer
from delta_jax.models import ModelConfig, Transformer, save_pretrained


def test_sample_defaults_to_what_the_context_leaves(tmp_path, capsys):
    tokenizer = build_char_tokenizer()
    config = ModelConfig.tiny(
        "qwen3", vocab_size=len(tokenizer), max_position_embeddings=64,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    save_pretrained(Transformer(config, rngs=nnx.Rngs(0)), tmp_path, tokenizer=tokenizer)
    prompt = "12+34="
    assert cli.main(["sample", "--model", str(tmp_path), "--prompt", prompt, "--raw"]) == 0
    out = capsys.readouterr().out
    tokens = int(out.split("(")[1].split(" tokens")[0])
    assert 0 < tokens <= 64 - len(tokenizer.encode(prompt, add_special_tokens=False))
    # A length that does not fit is still the caller's mistake, in one line.
    argv = ["sample", "--model", str(tmp_path), "--prompt", prompt, "--raw"]
    assert cli.main([*argv, "--max-new-tokens", "64"]) == 2
    assert capsys.readouterr().err.startswith("error: prompt of length")
