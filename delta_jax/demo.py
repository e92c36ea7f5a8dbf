"""The built-in CPU demo: a synthetic verifiable task and a tiny policy warmed up on it.

Task: two-number addition with a fixed answer format, e.g. prompt ``"Q: 47+38=?\\nA: "`` and a
correct response ``"Answer: \\boxed{85}"``. Every response shares the boilerplate
``Answer: \\boxed{...}`` whether its digits are right or wrong — exactly the situation DelTA is
about — and the reward is the project's real math verifier on the boxed answer.

The policy is a tiny Qwen3-style decoder over a character-level tokenizer, both built locally
(nothing downloaded), given a short supervised warm-up so that it answers in format and is right
part of the time; RL then has something to improve. The warmed-up model is written as a normal
Hugging Face directory (config.json, model.safetensors, tokenizer files) and loaded back through
:func:`delta_jax.models.from_pretrained` like any real checkpoint.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from delta_jax.data import PromptRecord

log = logging.getLogger(__name__)

PROMPT_TEMPLATE = "Q: {a}+{b}=?\nA: "
RESPONSE_TEMPLATE = "Answer: \\boxed{{{c}}}"
_CHARS = (
    list("0123456789+-*=?:.,() \n\\{}")
    + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
)
_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
DEMO_VOCAB = 128  # model vocabulary (>= tokenizer size; the spare rows are never sampled well)


def arithmetic_records(n: int, *, seed: int, low: int = 10, high: int = 99) -> list[PromptRecord]:
    """``n`` addition problems ``a + b`` with ``low <= a, b <= high``."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        records.append(
            PromptRecord(
                prompt=PROMPT_TEMPLATE.format(a=a, b=b),
                answer=str(a + b),
                source=f"demo:arithmetic(seed={seed})",
                row=i,
            )
        )
    return records


def build_char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` (pad 0, bos 1, eos 2), built locally."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_SPECIALS + _CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def _sft_batches(tokenizer, *, batch: int, seed: int, length: int, noise: float):
    """Endless batches of (ids, loss mask) for prompt + response + eos.

    A fraction ``noise`` of the demonstrations carry a wrong sum (off by 1 to 10), so the
    warmed-up policy puts real mass on wrong answers next to the right one: RL then has a
    clear, verifiable signal to act on, while the response format stays shared.
    """
    rng = np.random.default_rng(seed)
    while True:
        ids = np.full((batch, length), tokenizer.pad_token_id, np.int32)
        loss_mask = np.zeros((batch, length), np.float32)
        for i in range(batch):
            a, b = rng.integers(10, 100, size=2)
            prompt = tokenizer.encode(PROMPT_TEMPLATE.format(a=a, b=b))
            c = a + b
            if rng.random() < noise:
                c = max(0, c + int(rng.choice([-1, 1])) * int(rng.integers(1, 11)))
            response = tokenizer.encode(RESPONSE_TEMPLATE.format(c=c)) + [tokenizer.eos_token_id]
            seq = prompt + response
            assert len(seq) <= length, (len(seq), length)
            ids[i, : len(seq)] = seq
            # Loss on predicting each response token (targets are ids shifted by one).
            loss_mask[i, len(prompt) - 1 : len(seq) - 1] = 1.0
        yield ids, loss_mask


def warm_up_demo_model(
    out_dir: str | Path,
    *,
    steps: int,
    lr: float,
    noise: float = 0.5,
    seed: int = 0,
    batch: int = 64,
) -> Path:
    """Train the tiny demo policy for ``steps`` supervised steps and save it as an HF directory.

    ``noise`` is the fraction of demonstrations with a corrupted answer (see ``_sft_batches``).

    Returns ``out_dir``. Reuses an existing complete directory (resume after a crash).
    """
    from delta_jax.models import ModelConfig, Transformer, save_pretrained

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() and any(out_dir.glob("*.safetensors")):
        return out_dir
    tokenizer = build_char_tokenizer()
    config = ModelConfig.tiny(
        family="qwen3",
        vocab_size=DEMO_VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Transformer(config, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    warmup = min(20, steps // 5)  # short runs (tests) still get a decaying schedule
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1))
    tx = optax.adamw(schedule, weight_decay=0.0)
    opt_state = tx.init(params)

    @jax.jit
    def sft_step(params, opt_state, ids, loss_mask):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(ids[:, :-1], attention_mask=ids[:, :-1] != 0).logits
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
            nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
            return (nll * loss_mask[:, :-1]).sum() / loss_mask.sum()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # Longest example: 14 prompt + 19 response characters + eos; never truncated.
    batches = _sft_batches(tokenizer, batch=batch, seed=seed, length=40, noise=noise)
    loss = float("nan")
    for i in range(steps):
        ids, mask = next(batches)
        params, opt_state, loss = sft_step(params, opt_state, ids, mask)
        if (i + 1) % 100 == 0:
            log.info("demo warm-up step %d/%d: loss %.4f", i + 1, steps, float(loss))
    nnx.update(model, params)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    save_pretrained(model, tmp, tokenizer=tokenizer)
    tmp.rename(out_dir)  # complete or absent: a crash mid-save leaves no half directory
    log.info("demo warm-up done (final loss %.4f); model saved to %s", float(loss), out_dir)
    return out_dir
