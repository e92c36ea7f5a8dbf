"""The built-in demo: the warm-up's probe, its stopping rule and the templates.

That the demo learns at two seeds is checked on the reduced sweep of tests/rl/test_compare.py.
"""

import json

import numpy as np
import pytest
from flax import nnx

from delta_jax import demo


@pytest.fixture(scope="module")
def tok():
    return demo.build_char_tokenizer()


def test_answer_logprob_matches_a_float64_oracle_without_padding(tok):
    import jax

    from delta_jax.models import Transformer

    model = Transformer(demo._tiny_config(tok), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    examples = [demo._encode_example(tok, 47, 38, 85, "short")]
    examples.append(demo._encode_example(tok, 12, 30, 42, "long"))
    ids, mask = demo._pack(examples, tok.pad_token_id, 72)
    got = np.asarray(demo.answer_logprob(graphdef, params, ids, mask))
    # Oracle: each sequence alone (no padding, no mask), float64 log-softmax of the logits at
    # the positions before each response token, summed.
    want = []
    for prompt, response in examples:
        seq = np.asarray([prompt + response], np.int32)
        logits = np.asarray(jax.jit(model)(seq).logits[0], np.float64)
        logits -= logits.max(axis=-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        pos = np.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
        want.append(logp[pos, np.asarray(response)].sum())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)
    prob = float(demo.answer_probability(graphdef, params, ids, mask))
    np.testing.assert_allclose(prob, np.mean(np.exp(want)), rtol=1e-4, atol=1e-30)


def test_templates_share_everything_but_the_answer(tok):
    for name, template in demo.TEMPLATES.items():
        assert template.format(c=85).replace("85", "119") == template.format(c=119), name
        length = demo._sequence_length(name)
        batches = demo._sft_batches(tok, batch=8, seed=0, length=length, noise=0.0, template=name)
        ids, mask = next(batches)
        for row, m in zip(ids, mask, strict=True):
            # Positions with loss predict the response: the targets are the next tokens.
            target = row[1:][m[:-1] > 0].tolist()
            assert target[-1] == tok.eos_token_id
            prompt = tok.decode(row[: np.argmax(m) + 1].tolist())
            a, b = (int(x) for x in prompt[3:].split("=")[0].split("+"))
            assert tok.decode(target[:-1]) == template.format(c=a + b), name
    short, long = (len(demo.TEMPLATES[k].format(c=85)) - 2 for k in ("short", "long"))
    assert long >= 3 * short  # the long template has over 3x the formatting characters


def test_warm_up_stops_at_the_target_and_is_a_function_of_the_seed(tmp_path):
    # Target 0: met at the first probe (step 10). None: every step runs.
    warm = lambda name, seed, target: demo.warm_up_demo_model(
        tmp_path / name, steps=20, lr=3e-3, seed=seed, target_accuracy=target
    )
    steps = lambda d: json.loads((d / "demo_warmup.json").read_text())["steps"]
    a, a2, b, c = warm("a", 3, 0.0), warm("a2", 3, 0.0), warm("b", 3, None), warm("c", 4, 0.0)
    assert steps(a) == demo._PROBE_EVERY and steps(b) == 20
    read = lambda d: (d / "model.safetensors").read_bytes()
    assert read(a) == read(a2)  # the warm-up is a function of its arguments, bit for bit
    assert read(a) != read(b) and read(a) != read(c)


def test_the_held_out_set_has_run_eval_prompts_problems(tok):
    from delta_jax.config import load_config
    from delta_jax.rl.setup import prompt_sets

    config = load_config("configs/demo.yaml", ["run.eval_prompts=300", "run.seed=2"])
    train, evals = prompt_sets(config, tok)
    assert len(train.ids) == 4096
    assert [r.prompt for r in evals.records] == [
        r.prompt for r in demo.arithmetic_records(300, seed=3)
    ]
