"""Evaluation harness: pass@k against enumeration, scripted fake policies, the paper's averages,
benchmark schemas (math and code through the sandbox) and ``delta-jax eval`` on a tiny model."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from delta_jax.data import EncodedPrompts, PromptRecord, load_records
from delta_jax.eval import (
    EvalSampling,
    add_eval_arguments,
    default_pass_ks,
    evaluate_benchmarks,
    evaluate_prompts,
    format_table,
    majority_correct,
    normalize_answer,
    pass_at_k,
    run_eval_cli,
    suite_averages,
    weighted_average,
)
from delta_jax.eval_sets import (
    BENCHMARKS,
    HUMANEVAL_ADAPTER,
    MBPP_ADAPTER,
    PAPER_SUITE,
    parse_benchmark_args,
    score_code_with_prefix,
)
from delta_jax.rewards import RewardScorer

# ---------------------------------------------------------------------------------------------
# pass@k


def brute_force_pass_at_k(outcomes: list[bool], k: int) -> float:
    """Share of the k-subsets of the samples that hold at least one correct sample."""
    subsets = list(itertools.combinations(range(len(outcomes)), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_pass_at_k_equals_enumeration_over_subsets(n):
    rng = np.random.default_rng(n)
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        rng.shuffle(outcomes)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(
                brute_force_pass_at_k(outcomes, k), abs=1e-12
            ), (n, c, k)


def test_pass_at_k_rejects_bad_counts():
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match="need 0 <= c <= n"):
            pass_at_k(n, c, k)


def test_default_pass_ks():
    assert default_pass_ks(1) == (1,)
    assert default_pass_ks(16) == (1, 2, 4, 8, 16)
    assert default_pass_ks(12) == (1, 2, 4, 8, 12)


# ---------------------------------------------------------------------------------------------
# The paper's question-count-weighted averages (DELTA_SPEC §7), typed in from the paper.

PAPER_ROWS = {
    "8B DAPO": ([34.79, 23.33, 24.17, 13.54, 12.08, 16.86, 36.46], 22.95),
    "8B DelTA": ([43.13, 26.46, 28.12, 18.33, 18.54, 20.27, 44.79], 28.40),
    "14B DAPO": ([51.25, 32.29, 39.79, 19.79, 30.00, 25.38, 48.13], 35.09),
    "14B DelTA": ([56.87, 37.92, 45.21, 26.04, 32.92, 26.89, 54.79], 39.91),
}
PAPER_COUNTS = dict(zip(PAPER_SUITE, [30, 30, 30, 30, 30, 33, 30], strict=True))


@pytest.mark.parametrize("row", sorted(PAPER_ROWS))
def test_weighted_average_reproduces_paper_averages(row):
    scores, paper_avg = PAPER_ROWS[row]
    by_name = dict(zip(PAPER_SUITE, scores, strict=True))
    got = weighted_average(by_name, PAPER_COUNTS)
    assert round(got, 2) == paper_avg
    # The plain mean does not give the paper's number: the weighting is what reproduces it.
    assert round(float(np.mean(scores)), 2) != paper_avg


def test_registry_question_counts_match_the_paper():
    assert {b: BENCHMARKS[b].problems for b in PAPER_SUITE} == PAPER_COUNTS


def test_suite_averages_groups():
    rows = {
        "aime24": {"problems": 30, "avg@4": 0.5, "maj@4": 0.6},
        "hmmt26_feb": {"problems": 33, "avg@4": 0.2, "maj@4": 0.3},
        "gsm8k": {"problems": 100, "avg@4": 0.9},
    }
    avg = suite_averages(rows)
    assert avg["paper_suite"]["avg@4"] == pytest.approx((30 * 0.5 + 33 * 0.2) / 63, abs=1e-12)
    assert avg["paper_suite"]["maj@4"] == pytest.approx((30 * 0.6 + 33 * 0.3) / 63, abs=1e-12)
    assert avg["all"]["avg@4"] == pytest.approx((15 + 6.6 + 90) / 163, abs=1e-12)
    assert "maj@4" not in avg["all"]  # gsm8k lacks it: no average over a partial group


def test_weighted_average_needs_counts():
    with pytest.raises(ValueError, match="need a count"):
        weighted_average({"a": 1.0}, {"b": 3})


# ---------------------------------------------------------------------------------------------
# maj@k


def test_majority_vote_cases():
    assert majority_correct(["5", "5", "7"], [True, True, False])
    assert not majority_correct(["7", "7", "5"], [False, False, True])
    # Correct answers in different spellings all vote for the gold answer.
    assert majority_correct(["0.5", "\\frac{1}{2}", "3", "3"], [True, True, False, False]) is True
    assert not majority_correct(["0.5", "3", "3", "3"], [True, False, False, False])
    # Spacing and \dfrac variants of one wrong answer pool their votes.
    assert not majority_correct(["\\dfrac{1}{3}", "\\frac {1}{3}", "2"], [False, False, True])
    # No answer -> no vote; nothing at all -> not correct.
    assert majority_correct([None, None, "2"], [False, False, True])
    assert not majority_correct([None, None], [False, False])
    # A tie goes to the answer seen first.
    assert majority_correct(["2", "9"], [True, False])
    assert not majority_correct(["9", "2"], [False, True])


def test_normalize_answer():
    assert normalize_answer("\\left( 1, \\dfrac{1}{2} \\right).") == "(1,\\frac{1}{2})"
    assert normalize_answer("$x^2$") == "x^2"


# ---------------------------------------------------------------------------------------------
# Scripted fake policy through the real evaluate_prompts and the real math scorer.


class FakeOutput:
    def __init__(self, tokens):
        self.tokens = tokens
        self.lengths = [len(t) for t in tokens]


class ScriptedPolicy:
    """Prompt ``[i]`` gets the responses ``script[i]`` (cycled), one token id per response."""

    def __init__(self, script: list[list[str]]):
        self.texts: list[str] = []
        self.script = script
        self.calls: list[dict] = []

    def generate(self, prompts, *, n, seed, **kwargs):
        self.calls.append(dict(n=n, seed=seed, rows=len(prompts), **kwargs))
        tokens = []
        for p in prompts:
            options = self.script[p[0]]
            for j in range(n):
                self.texts.append(options[j % len(options)])
                tokens.append([len(self.texts) - 1] * (1 + j % 3))
        return FakeOutput(tokens)

    # The tokenizer side: every token of a row is the index of its text.
    def batch_decode(self, rows, skip_special_tokens=True):
        return [self.texts[r[0]] for r in rows]


class RandomPolicy(ScriptedPolicy):
    """Each response is correct with probability ``p`` (else a wrong boxed answer or none)."""

    def __init__(self, answers: list[str], p: float, seed: int):
        super().__init__([])
        self.answers, self.p, self.rng = answers, p, np.random.default_rng(seed)

    def generate(self, prompts, *, n, seed, **kwargs):
        tokens = []
        for prompt in prompts:
            gold = self.answers[prompt[0]]
            for _ in range(n):
                u = self.rng.random()
                if u < self.p:
                    text = f"so \\boxed{{{gold}}}"
                else:
                    text = f"\\boxed{{{int(gold) + 1 + int(self.rng.integers(0, 5))}}}"
                self.texts.append(text)
                tokens.append([len(self.texts) - 1])
        return FakeOutput(tokens)


def _records(answers):
    return [PromptRecord(prompt=f"problem {i}", answer=a) for i, a in enumerate(answers)]


@pytest.fixture(scope="module")
def math_scorer():
    with RewardScorer("math", num_workers=0) as scorer:
        yield scorer


def _run(policy, records, k, scorer, batch_prompts=None, **kw):
    sampling = EvalSampling(
        k=k,
        max_new_tokens=8,
        temperature=1.0,
        top_p=0.7,
        seed=5,
        stop_token_ids=(2,),
        batch_prompts=batch_prompts,
    )
    return evaluate_prompts(
        sampler=policy,
        params=None,
        scorer=scorer,
        tokenizer=policy,
        prompts=EncodedPrompts([[i] for i in range(len(records))], records, dropped=0),
        sampling=sampling,
        **kw,
    )


def test_scripted_policy_avg_pass_maj(math_scorer):
    k = 4
    records = _records(["12", "7", "\\frac{1}{2}", "30"])
    script = [
        ["\\boxed{12}", "\\boxed{12}", "\\boxed{13}", "no idea"],  # 2/4, majority right
        ["\\boxed{8}", "\\boxed{8}", "\\boxed{7}", "\\boxed{9}"],  # 1/4, majority wrong (8)
        ["\\boxed{0.5}", "\\boxed{\\dfrac12}", "\\boxed{1}", "\\boxed{1}"],  # 2/4, tie, gold first
        ["\\boxed{31}", "\\boxed{32}", "\\boxed{33}", "\\boxed{34}"],  # 0/4
    ]
    policy = ScriptedPolicy(script)
    out = _run(policy, records, k, math_scorer, pass_ks=(1, 2, 4), batch_prompts=3)
    correct = [2, 1, 2, 0]
    assert out["avg@4"] == pytest.approx(sum(correct) / 16, abs=1e-12)
    for kk in (1, 2, 4):
        want = np.mean([brute_force_pass_at_k([True] * c + [False] * (k - c), kk) for c in correct])
        assert out[f"pass@{kk}"] == pytest.approx(want, abs=1e-12)
    assert out["maj@4"] == pytest.approx(2 / 4, abs=1e-12)
    assert out["response_length_mean"] == pytest.approx(np.mean([1, 2, 3, 1] * 4), abs=1e-12)
    # The paper's sampling settings and the chunking reach the sampler.
    assert [c["rows"] for c in policy.calls] == [3, 1]
    assert [c["seed"] for c in policy.calls] == [5, 6]
    assert all(c["top_p"] == 0.7 and c["temperature"] == 1.0 and c["n"] == 4 for c in policy.calls)


def test_trainer_keys_unchanged_for_k1(math_scorer):
    policy = ScriptedPolicy([["\\boxed{1}"], ["\\boxed{3}"]])
    out = _run(policy, _records(["1", "2"]), 1, math_scorer, prefix="eval/")
    assert out == {"eval/avg@1": 0.5, "eval/pass@1": 0.5, "eval/response_length_mean": 1.0}


def test_random_policy_with_known_accuracy(math_scorer):
    p, k, problems = 0.3, 8, 150
    answers = [str(10 + i) for i in range(problems)]
    out = _run(
        RandomPolicy(answers, p, seed=0), _records(answers), k, math_scorer, pass_ks=(1, 4, 8)
    )
    n = problems * k
    # avg@k and pass@1 estimate p: 4 binomial standard errors.
    tol = 4 * math.sqrt(p * (1 - p) / n)
    assert out["avg@8"] == pytest.approx(p, abs=tol)
    assert out["pass@1"] == pytest.approx(out["avg@8"], abs=1e-12)
    # E[pass@k estimator] = 1 − (1 − p)^k for iid samples; problems are independent.
    for kk in (4, 8):
        q = 1 - (1 - p) ** kk
        assert out[f"pass@{kk}"] == pytest.approx(q, abs=4 * math.sqrt(q * (1 - q) / problems))
    # maj@8: wrong answers spread over 5 values, so gold wins when it has the most votes; the
    # exact probability by enumerating the multinomial over (gold, 5 wrong values).
    assert out["maj@8"] == pytest.approx(
        _maj_probability(p, k, 5), abs=4 * math.sqrt(0.25 / problems)
    )


def _maj_probability(p: float, k: int, wrong_values: int) -> float:
    """P(gold wins the vote) over the multinomial counts of (gold, wrong_1..wrong_m).

    Given the counts, the order of the samples is exchangeable, so when ``t`` answers tie for
    the most votes each is the first seen (and wins) with probability ``1 / t``.
    """
    q = (1 - p) / wrong_values
    total = 0.0
    for counts in itertools.product(range(k + 1), repeat=wrong_values + 1):
        if sum(counts) != k:
            continue
        best = max(counts)
        if counts[0] != best:
            continue
        ties = sum(c == best for c in counts)
        ways = math.factorial(k) / math.prod(math.factorial(c) for c in counts)
        total += ways * p ** counts[0] * q ** (k - counts[0]) / ties
    return total


# ---------------------------------------------------------------------------------------------
# Code benchmarks: EvalPlus schemas, scored in the real sandbox.

_ASSERTION = """
import math

def assertion(out, exp, atol):
    if isinstance(exp, float) or atol:
        assert math.isclose(out, exp, rel_tol=1e-6, abs_tol=atol), (out, exp)
    else:
        assert out == exp, (out, exp)
"""
HUMANEVAL_ROWS = [
    {
        "task_id": "HumanEval/0",
        "prompt": "from typing import List\n\n\ndef count_big(xs: List[int], t: int) -> int:\n"
        '    """How many items of xs exceed t."""\n',
        "canonical_solution": "    return sum(x > t for x in xs)\n",
        "entry_point": "count_big",
        "test": _ASSERTION + "\n\ndef check(candidate):\n"
        "    inputs = [[[1, 5, 9], 4], [[], 0], [[3, 3], 3]]\n"
        "    results = [2, 0, 0]\n"
        "    for inp, exp in zip(inputs, results):\n"
        "        assertion(candidate(*inp), exp, 0)\n",
    },
]
MBPP_ROWS = [
    {
        "task_id": 2,
        "code": "def shared(a, b):\n    return tuple(set(a) & set(b))\n",
        "prompt": "Write a function to find the shared elements of two lists, sorted.",
        "source_file": "Benchmark Questions Verification V2.ipynb",
        "test_imports": ["import math"],
        "test_list": ["assert shared([1, 2, 3], [2, 3, 4]) == [2, 3]"],
        "test": _ASSERTION + "\ninputs = [[[1, 2, 3], [2, 3, 4]], [[5], [6]]]\n"
        "results = [[2, 3], []]\n"
        "for inp, exp in zip(inputs, results):\n"
        "    assertion(shared(*inp), exp, 0)\n",
    },
]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_humaneval_and_mbpp_adapters(tmp_path):
    he = load_records(
        _write_jsonl(tmp_path / "he.jsonl", HUMANEVAL_ROWS), adapter=HUMANEVAL_ADAPTER
    )
    (rec,) = he.records
    assert rec.prompt == HUMANEVAL_ROWS[0]["prompt"] and rec.answer is None
    assert rec.tests.rstrip().endswith("check(count_big)")
    assert rec.extra == {"task_id": "HumanEval/0", "code_prefix": "from typing import List"}
    mb = load_records(_write_jsonl(tmp_path / "mb.jsonl", MBPP_ROWS), adapter=MBPP_ADAPTER)
    (rec,) = mb.records
    assert rec.prompt.startswith("Write a function to find the shared elements")
    assert rec.prompt.endswith("assert shared([1, 2, 3], [2, 3, 4]) == [2, 3]")
    assert rec.tests.startswith("import math\n")
    bad = dict(MBPP_ROWS[0], test_list=[])
    with pytest.raises(ValueError, match="test_list"):
        load_records(_write_jsonl(tmp_path / "bad.jsonl", [bad]), adapter=MBPP_ADAPTER)


HE_GOOD = (
    "```python\ndef count_big(xs: List[int], t: int) -> int:\n"
    "    return sum(x > t for x in xs)\n```"
)
HE_WRONG = "```python\ndef count_big(xs, t):\n    return sum(x >= t for x in xs)\n```"
MB_GOOD = "Here:\n```python\ndef shared(a, b):\n    return sorted(set(a) & set(b))\n```"
MB_WRONG = "```python\ndef shared(a, b):\n    return list(set(a) | set(b))\n```"


def test_code_benchmarks_through_the_sandbox(tmp_path):
    he = load_records(
        _write_jsonl(tmp_path / "he.jsonl", HUMANEVAL_ROWS), adapter=HUMANEVAL_ADAPTER
    )
    mb = load_records(_write_jsonl(tmp_path / "mb.jsonl", MBPP_ROWS), adapter=MBPP_ADAPTER)
    records = he.records + mb.records
    # HE_GOOD uses List without importing it: the prompt's imports run first.
    script = [[HE_GOOD, HE_WRONG, "no code", HE_GOOD], [MB_WRONG, MB_GOOD, MB_GOOD, MB_GOOD]]
    policy = ScriptedPolicy(script)
    with RewardScorer(score_code_with_prefix, num_workers=0) as scorer:
        out = _run(policy, records, 4, scorer, pass_ks=(1, 4))
    assert out["avg@4"] == pytest.approx(5 / 8, abs=1e-12)
    assert out["pass@4"] == 1.0
    assert "maj@4" not in out  # no final answers to vote on in code


def test_parse_benchmark_args():
    parsed = parse_benchmark_args(["aime24=/d/a.parquet", "mine:math500=/d/m.jsonl"])
    assert parsed["aime24"][0] is BENCHMARKS["aime24"] and parsed["aime24"][1] == "/d/a.parquet"
    assert parsed["mine"][0].adapter == "math500" and parsed["mine"][0].reward == "math"
    for bad, msg in [("aime24", "NAME=PATH"), ("unknown=/x", "not one of"), ("=x", "NAME=PATH")]:
        with pytest.raises(ValueError, match=msg):
            parse_benchmark_args([bad])
    with pytest.raises(ValueError, match="given twice"):
        parse_benchmark_args(["aime24=/a", "aime24=/b"])


# ---------------------------------------------------------------------------------------------
# The whole command on a tiny random model and local benchmark files.


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from flax import nnx

    from delta_jax.demo import build_char_tokenizer
    from delta_jax.models import ModelConfig, Transformer, save_pretrained

    tok = build_char_tokenizer()
    config = ModelConfig.tiny(
        "qwen3",
        vocab_size=128,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    path = tmp_path_factory.mktemp("tiny_model")
    save_pretrained(Transformer(config, rngs=nnx.Rngs(0)), path, tokenizer=tok)
    return path


def test_eval_command_on_tiny_model(tiny_model_dir, tmp_path, capsys):
    aime = [
        {"ID": f"2024-I-{i}", "Problem": f"What is {i}+{i}?", "Answer": 2 * i} for i in range(3)
    ]
    math500 = [{"problem": "What is 1+1?", "answer": "2", "subject": "Algebra", "level": 1}]
    _write_jsonl(tmp_path / "aime24.jsonl", aime)
    (tmp_path / "m").mkdir()
    _write_jsonl(tmp_path / "m" / "train.jsonl", math500)  # a directory with a train split only
    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    out = tmp_path / "res" / "results.json"
    args = parser.parse_args(
        [
            "--model",
            str(tiny_model_dir),
            "--bench",
            f"aime24={tmp_path / 'aime24.jsonl'}",
            "--bench",
            f"m:math500={tmp_path / 'm'}",
            "--k",
            "2",
            "--max-new-tokens",
            "6",
            "--limit",
            "2",
            "--workers",
            "0",
            "--out",
            str(out),
        ]
    )
    assert (args.temperature, args.top_p) == (1.0, 0.7)  # the paper's evaluation defaults
    assert run_eval_cli(args) == 0
    results = json.loads(out.read_text())
    assert results["settings"]["k"] == 2 and results["settings"]["top_p"] == 0.7
    assert list(results["benchmarks"]) == ["aime24", "m"]
    a = results["benchmarks"]["aime24"]
    assert a["problems"] == 2 and len(a["correct_per_problem"]) == 2
    assert a["avg@2"] == pytest.approx(sum(a["correct_per_problem"]) / 4, abs=1e-12)
    assert sum(a["reasons"].values()) == 4
    assert set(a) >= {"avg@2", "pass@1", "pass@2", "maj@2", "response_length_mean"}
    assert 1 <= a["response_length_mean"] <= 6
    assert results["average"]["paper_suite"]["benchmarks"] == ["aime24"]
    assert results["average"]["all"]["problems"] == 3
    printed = capsys.readouterr().out
    assert "aime24" in printed and "Avg (all, weighted)" in printed and "maj@2" in printed
    assert format_table(results) in printed


def test_evaluate_benchmarks_rejects_empty(tiny_model_dir):
    with pytest.raises(ValueError, match="benchmarks is empty"):
        evaluate_benchmarks(tiny_model_dir, {})
