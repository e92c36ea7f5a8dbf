"""The built-in CPU demo: a synthetic verifiable task and a tiny policy warmed up on it.

Task: two-number addition with a fixed answer format, e.g. prompt ``"Q: 47+38=?\\nA: "`` and a
correct response ``"Answer: \\boxed{85}"``. Every response shares the boilerplate
``Answer: \\boxed{...}`` whether its digits are right or wrong — exactly the situation DelTA is
about — and the reward is the project's real math verifier on the boxed answer. The ``long``
template wraps the same answer in a longer shared chain-of-thought text (:data:`TEMPLATES`), so
the share of formatting tokens in a response — the formatting density — is a knob.

The tool-use demo (template ``tool``, data ``demo:products``, configs/demo_tool.yaml): products of
two 3-digit numbers, which the model cannot compute; a quarter of its warm-up demonstrations call
the Python tool in a fenced block, see its output (rendered exactly as
:class:`~delta_jax.envs.PythonTool` answers, as context without loss) and copy it into
``\\boxed{}``; the rest answer at once. RL then learns to call the tool.

The policy is a tiny Qwen3-style decoder over a character-level tokenizer, both built locally
(nothing downloaded), given a supervised warm-up so that it answers in format and is right part
of the time; RL then has something to improve. How fast the warm-up learns arithmetic depends on
the seed, so instead of a fixed number of steps it runs until a held-out probe says the policy
is right about ``target_accuracy`` of the time (:func:`answer_probability`): every seed starts
RL from the same useful band. The warmed-up model is written as a normal Hugging Face directory
(config.json, model.safetensors, tokenizer files) and loaded back through
:func:`delta_jax.models.from_pretrained` like any real checkpoint.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from delta_jax.data import PromptRecord
from delta_jax.envs.base import PLAIN_OBSERVATION
from delta_jax.models import ModelConfig, Transformer, save_pretrained

log = logging.getLogger(__name__)

PROMPT_TEMPLATE = "Q: {a}+{b}=?\nA: "
# Response templates by formatting density: the answer's 2-3 digits inside 16 (short) or 54
# (long) characters of text shared by every response, right or wrong.
TEMPLATES = {
    "short": "Answer: \\boxed{{{c}}}",
    "long": "Add the ones, then the tens.\nAnswer: \\boxed{{{c}}}. Done.",
}
RESPONSE_TEMPLATE = TEMPLATES["short"]
# The tool-use demo (template "tool", data demo:products): products of two 3-digit numbers, which
# the tiny model cannot compute, but can have computed: it writes a fenced call (ending at
# PythonTool's stop string), the tool's output comes back as context, the model copies it.
TOOL_PROMPT = "Q: {a}*{b}=?\nA: "
TOOL_CALL = "```py\nprint({a}*{b})\n```\n"
TOOL_ANSWER = "\\boxed{{{c}}}"
# Warm-up demonstrations that call the tool; the others answer at once (a guess, to the model).
TOOL_SHARE = 0.25
_PROBE_EVERY = 10  # warm-up steps between two probes of the held-out answer probability
_PROBE_PROMPTS = 256
_CHARS = (
    list("0123456789+-*=?:.,() \n\\{}")
    + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    + ["`"]  # fenced code blocks (the tool demo)
)
_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
DEMO_VOCAB = 128  # model vocabulary (>= tokenizer size; the spare rows are never sampled well)


def arithmetic_records(n: int, *, seed: int, low: int = 10, high: int = 99) -> list[PromptRecord]:
    """``n`` addition problems ``a + b`` with ``low <= a, b <= high``."""
    return _problems(n, seed, low, high, PROMPT_TEMPLATE, lambda a, b: a + b, "arithmetic")


def product_records(n: int, *, seed: int, low: int = 100, high: int = 999) -> list[PromptRecord]:
    """``n`` multiplication problems ``a * b`` with ``low <= a, b <= high`` (the tool demo)."""
    return _problems(n, seed, low, high, TOOL_PROMPT, lambda a, b: a * b, "products")


def _problems(n, seed, low, high, template, answer, name) -> list[PromptRecord]:
    rng = random.Random(seed)
    records = []
    for i in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        records.append(
            PromptRecord(
                prompt=template.format(a=a, b=b),
                answer=str(answer(a, b)),
                source=f"demo:{name}(seed={seed})",
                row=i,
            )
        )
    return records


def build_char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` (pad 0, bos 1, eos 2), built locally."""
    # Lazy: transformers takes seconds to import; only the demo's tokenizer needs it.
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


def _encode_example(tokenizer, a: int, b: int, c: int, template: str):
    """(prompt ids, response ids + eos) of one demonstration ``a + b = c``."""
    prompt = tokenizer.encode(PROMPT_TEMPLATE.format(a=a, b=b))
    response = tokenizer.encode(TEMPLATES[template].format(c=c)) + [tokenizer.eos_token_id]
    return prompt, response


def _tool_example(tokenizer, a: int, b: int, c: int, use_tool: bool):
    """(prompt ids, response ids + eos, response mask) of one tool-demo demonstration: a call
    whose output (as PythonTool renders it, context: mask 0) is followed by the answer ``c``, or
    the answer alone."""
    encode = tokenizer.encode
    prompt = encode(TOOL_PROMPT.format(a=a, b=b))
    answer = encode(TOOL_ANSWER.format(c=c)) + [tokenizer.eos_token_id]
    if not use_tool:
        return prompt, answer, [1] * len(answer)
    call = encode(TOOL_CALL.format(a=a, b=b))
    observation = encode(PLAIN_OBSERVATION.format(a * b))
    mask = [1] * len(call) + [0] * len(observation) + [1] * len(answer)
    return prompt, call + observation + answer, mask


def _pack(examples, pad_id: int, length: int):
    """(ids, loss mask) arrays; the mask marks the positions that predict a response token (of
    the response tokens its example's optional third entry marks)."""
    ids = np.full((len(examples), length), pad_id, np.int32)
    loss_mask = np.zeros((len(examples), length), np.float32)
    for i, (prompt, response, *marks) in enumerate(examples):
        seq = prompt + response
        assert len(seq) <= length, (len(seq), length)
        ids[i, : len(seq)] = seq
        # Targets are ids shifted by one: position t predicts token t + 1.
        loss_mask[i, len(prompt) - 1 : len(seq) - 1] = marks[0] if marks else 1.0
    return ids, loss_mask


def _sft_batches(tokenizer, *, batch: int, seed: int, length: int, noise: float, template: str):
    """Endless batches of (ids, loss mask) for prompt + response + eos.

    A fraction ``noise`` of the demonstrations carry a wrong sum (off by 1 to 10), so the
    warmed-up policy puts real mass on wrong answers next to the right one: RL then has a
    clear, verifiable signal to act on, while the response format stays shared.
    """
    rng = np.random.default_rng(seed)
    tool = template == "tool"
    while True:
        examples = []
        for _ in range(batch):
            operands = rng.integers(100, 1000, 2) if tool else rng.integers(10, 100, 2)
            a, b = (int(x) for x in operands)
            c = a * b if tool else a + b
            if rng.random() < noise:
                c = max(0, c + int(rng.choice([-1, 1])) * int(rng.integers(1, 11)))
            if tool:
                examples.append(_tool_example(tokenizer, a, b, c, rng.random() < TOOL_SHARE))
            else:
                examples.append(_encode_example(tokenizer, a, b, c, template))
        yield _pack(examples, tokenizer.pad_token_id, length)


def _sequence_length(template: str) -> int:
    """Longest prompt + response + eos of ``template``, rounded up to a multiple of 8."""
    if template == "tool":
        tool = TOOL_CALL.format(a=999, b=999) + PLAIN_OBSERVATION.format(999 * 999)
        longest = len(TOOL_PROMPT.format(a=999, b=999)) + len(tool)
        return -(-(longest + len(TOOL_ANSWER.format(c=999 * 999)) + 1) // 8) * 8
    longest = len(PROMPT_TEMPLATE.format(a=99, b=99)) + len(TEMPLATES[template].format(c=198)) + 1
    return -(-longest // 8) * 8


def answer_logprob(graphdef, params, ids, loss_mask) -> jax.Array:
    """Per row, ``log p(response + eos | prompt)`` under the policy at temperature 1: ``[B]``."""
    logits = nnx.merge(graphdef, params)(ids[:, :-1], attention_mask=ids[:, :-1] != 0).logits
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    tok = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return (tok * loss_mask[:, :-1]).sum(axis=1)


def answer_probability(graphdef, params, ids, loss_mask) -> jax.Array:
    """Mean over rows of ``p(correct response + eos | prompt)`` (see :func:`answer_logprob`).

    This is exactly the chance that one temperature-1 sample is the reference response
    character for character, so it tracks — and slightly under-states — the sampled accuracy
    the RL evaluation measures, at the cost of one forward pass instead of a decode.
    """
    return jnp.exp(answer_logprob(graphdef, params, ids, loss_mask)).mean()


def reference_batch(tokenizer, records, *, template: str):
    """(ids, loss mask) of ``records`` (addition problems) with their correct responses.

    The input of :func:`answer_probability`: the warm-up probes its own held-out problems with
    it, and tests measure what RL did to the probability of the right answer on the run's
    held-out problems (a paired, sampling-free view of the held-out accuracy).
    """
    examples = []
    for r in records:
        if template == "tool":  # the right answer through the tool
            a, b = (int(x) for x in r.prompt[3:].split("=")[0].split("*"))
            examples.append(_tool_example(tokenizer, a, b, a * b, use_tool=True))
            continue
        a, b = (int(x) for x in r.prompt[3:].split("=")[0].split("+"))
        examples.append(_encode_example(tokenizer, a, b, a + b, template))
    return _pack(examples, tokenizer.pad_token_id, _sequence_length(template))


def _probe_set(tokenizer, *, seed: int, template: str):
    """Held-out problems with their correct responses (independent of training and RL data)."""
    make = product_records if template == "tool" else arithmetic_records
    records = make(_PROBE_PROMPTS, seed=seed + 2)
    return reference_batch(tokenizer, records, template=template)


def _tiny_config(tokenizer):
    return ModelConfig.tiny(
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


def warm_up_demo_model(
    out_dir: str | Path,
    *,
    steps: int,
    lr: float,
    noise: float = 0.5,
    seed: int = 0,
    batch: int = 64,
    target_accuracy: float | None = None,
    template: str = "short",
) -> Path:
    """Train the tiny demo policy with supervised steps and save it as an HF directory.

    Args:
      out_dir: where the Hugging Face directory goes.
      steps: the most supervised steps (all of them when ``target_accuracy`` is None).
      lr: peak learning rate (linear warm-up, then cosine decay over ``steps``).
      noise: the fraction of demonstrations with a corrupted answer (see ``_sft_batches``).
      seed: initialisation and data seed (the run's ``run.seed``).
      batch: demonstrations per step.
      target_accuracy: stop at the first probe (every 10 steps) whose held-out
        :func:`answer_probability` reaches this value; None runs all ``steps``. Learning
        addition has a sharp transition (the probe can go 0.09 -> 0.26 in 40 steps), hence
        frequent probes.
      template: the response template, a key of :data:`TEMPLATES`.

    Returns ``out_dir``, with ``demo_warmup.json`` (steps taken, last probe). Reuses an
    existing complete directory (resume after a crash); the warm-up is a pure function of its
    arguments, so a rebuilt one is the same model.
    """
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() and any(out_dir.glob("*.safetensors")):
        return out_dir
    if template not in (*TEMPLATES, "tool"):
        raise ValueError(f"template={template!r} is not one of {', '.join(TEMPLATES)}, tool")
    tokenizer = build_char_tokenizer()
    model = Transformer(_tiny_config(tokenizer), rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    warmup = min(20, max(steps // 5, 1))  # short runs (tests) still ramp up
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

    length = _sequence_length(template)
    batches = _sft_batches(
        tokenizer, batch=batch, seed=seed, length=length, noise=noise, template=template
    )
    probe = jax.jit(lambda p, i, m: answer_probability(graphdef, p, i, m))
    probe_ids, probe_mask = _probe_set(tokenizer, seed=seed, template=template)
    loss, acc, done = float("nan"), float("nan"), 0
    while done < steps:
        ids, mask = next(batches)
        params, opt_state, loss = sft_step(params, opt_state, ids, mask)
        done += 1
        if target_accuracy is not None and done % _PROBE_EVERY == 0:
            acc = float(probe(params, probe_ids, probe_mask))
            log.info("demo warm-up step %d: loss %.4f, probe %.3f", done, float(loss), acc)
            if acc >= target_accuracy:
                break
    if target_accuracy is not None and not acc >= target_accuracy:
        log.warning(
            "demo warm-up: probe %.3f < target %.3f after %d steps", acc, target_accuracy, done
        )
    nnx.update(model, params)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    save_pretrained(model, tmp, tokenizer=tokenizer)
    (tmp / "demo_warmup.json").write_text(json.dumps({"steps": done, "probe": acc, "seed": seed}))
    tmp.rename(out_dir)  # complete or absent: a crash mid-save leaves no half directory
    log.info("demo warm-up: %d steps (loss %.4f), saved to %s", done, float(loss), out_dir)
    return out_dir
