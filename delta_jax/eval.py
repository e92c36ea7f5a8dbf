"""Evaluation: k samples per problem, sampled and scored; benchmark suites, their table, the CLI.

:func:`sample_and_score` draws ``k`` responses per prompt and scores them; the metrics computed
from them (avg@k, unbiased pass@k, maj@k, weighted averages) are defined in
:mod:`delta_jax.eval_metrics` and importable from here too. :func:`evaluate_benchmarks` runs
the paper's protocol on benchmark files (their schemas: :mod:`delta_jax.eval_sets`).

A suite's average weights each benchmark by its number of problems, as the paper's "Avg"
column (30 questions per set, 33 for HMMT26-Feb). Results are fractions in ``[0, 1]``; the
printed table shows percentages. The trainer's periodic evaluation calls
:func:`evaluate_prompts`, the same code as ``delta-jax eval``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from delta_jax.data import encode_prompts, load_records
from delta_jax.envs.episodes import episode_row
from delta_jax.eval_metrics import (
    SampleScores,
    default_pass_ks,
    majority_correct,
    normalize_answer,
    pass_at_k,
    summarize,
    weighted_average,
)
from delta_jax.eval_sets import PAPER_SUITE, Benchmark, parse_benchmark_args, resolve_benchmark
from delta_jax.models import from_pretrained, load_tokenizer
from delta_jax.rewards import RewardScorer, extract_last_boxed
from delta_jax.sampling import Sampler

if TYPE_CHECKING:
    from delta_jax.data import EncodedPrompts

# The metrics of eval_metrics stay importable from here, where they were first defined.
__all__ = [
    "PAPER_K",
    "PAPER_MAX_NEW_TOKENS",
    "PAPER_TEMPERATURE",
    "PAPER_TOP_P",
    "BenchmarkLoading",
    "EvalSampling",
    "SampleScores",
    "add_eval_arguments",
    "default_pass_ks",
    "evaluate_benchmarks",
    "evaluate_prompts",
    "format_table",
    "majority_correct",
    "normalize_answer",
    "pass_at_k",
    "run_eval_cli",
    "sample_and_score",
    "suite_averages",
    "summarize",
    "weighted_average",
]

log = logging.getLogger(__name__)

PAPER_TEMPERATURE = 1.0
PAPER_TOP_P = 0.7
PAPER_K = 16
PAPER_MAX_NEW_TOKENS = 30000


@dataclasses.dataclass(frozen=True)
class EvalSampling:
    """How an evaluation samples: ``k`` responses per prompt, drawn with these settings.

    The defaults are the paper's protocol (DELTA_SPEC §7), ``batch_prompts`` that of
    ``delta-jax eval``.

    Attributes:
      k: samples per prompt.
      max_new_tokens: response budget.
      temperature: sampling temperature.
      top_p: nucleus mass.
      seed: sampling seed; the ``j``-th sampler call uses ``seed + j``.
      stop_token_ids: ids that end a response; None: :func:`evaluate_benchmarks` takes the
        tokenizer's and the model's EOS ids (:func:`sample_and_score` needs them given).
      batch_prompts: prompts per sampler call (None: all at once).
    """

    k: int = PAPER_K
    max_new_tokens: int = PAPER_MAX_NEW_TOKENS
    temperature: float = PAPER_TEMPERATURE
    top_p: float = PAPER_TOP_P
    seed: int = 0
    stop_token_ids: tuple[int, ...] | None = None
    batch_prompts: int | None = 64


def sample_and_score(
    *,
    sampler,
    params,
    scorer,
    tokenizer,
    prompts: EncodedPrompts,
    sampling: EvalSampling,
    episodes=None,
) -> SampleScores:
    """Samples ``k`` responses per prompt (``batch_prompts`` per sampler call) and scores them.

    Args:
      sampler: a :class:`~delta_jax.sampling.Sampler` (or anything with its ``generate``).
      params: the parameters to sample with (None: the sampler's model's own).
      scorer: a :class:`~delta_jax.rewards.RewardScorer`.
      tokenizer: decodes the sampled ids (``batch_decode``).
      prompts: ``P`` prompts: their token ids and :class:`~delta_jax.data.PromptRecord`
        (answer, tests, extra -> the item).
      sampling: :class:`EvalSampling`, with its ``stop_token_ids``.
      episodes: an :class:`~delta_jax.envs.episodes.EpisodeRunner`: each response is a
        multi-turn episode (observations included in the scored text).

    Returns:
      :class:`SampleScores`.
    """
    prompt_ids, records, k = prompts.ids, prompts.records, sampling.k
    if len(prompt_ids) != len(records) or not prompt_ids:
        raise ValueError(
            f"need as many prompt_ids as records (> 0), got {len(prompt_ids)} and {len(records)}"
        )
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if sampling.stop_token_ids is None:
        raise ValueError("sampling.stop_token_ids is None: give the ids that end a response")
    step = sampling.batch_prompts or len(prompt_ids)
    if step < 1:
        raise ValueError(f"batch_prompts must be >= 1 or None, got {sampling.batch_prompts}")
    texts: list[str] = []
    lengths: list[int] = []
    for j, start in enumerate(range(0, len(prompt_ids), step)):
        chunk = [r for r in records[start : start + step] for _ in range(k)]
        turns = None
        if episodes is not None:
            turns = episodes.start([episode_row(r) for r in chunk]).turns
        out = sampler.generate(
            [list(p) for p in prompt_ids[start : start + step]],
            n=k,
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stop_token_ids=tuple(sampling.stop_token_ids),
            seed=sampling.seed + j,
            params=params,
            turns=turns,
        )
        texts += tokenizer.batch_decode(out.tokens, skip_special_tokens=True)
        lengths += [int(x) for x in out.lengths]
    rows = [r for r in records for _ in range(k)]
    items = [{"answer": r.answer, "tests": r.tests, **r.extra} for r in rows]
    scored = scorer.score([r.prompt for r in rows], texts, items)
    answers = [extract_last_boxed(t) for t in texts]
    return SampleScores(
        rewards=np.asarray(scored.rewards, np.float64).reshape(len(records), k),
        answers=[answers[i * k : (i + 1) * k] for i in range(len(records))],
        lengths=np.asarray(lengths).reshape(len(records), k),
        reasons=dict(scored.counts),
        texts=texts,
    )


def evaluate_prompts(
    *,
    sampler,
    params,
    scorer,
    tokenizer,
    prompts: EncodedPrompts,
    sampling: EvalSampling,
    prefix: str = "",
    pass_ks: Sequence[int] | None = None,
    majority: bool | None = None,
    episodes=None,
) -> dict[str, float]:
    """Sample ``k`` responses per prompt, score them; return avg@k, pass@k (and maj@k).

    The trainer's periodic evaluation (``prefix="eval/"``, ``k=1``) and ``delta-jax eval`` both
    call this. Arguments are those of :func:`sample_and_score`, plus:

    Args:
      prefix: prepended to every metric name.
      pass_ks: the k values of pass@k (each ``<= k``; default ``(k,)``).
      majority: add ``maj@k``; default: when ``k > 1`` and the scorer's kind is ``"math"``.

    Returns:
      ``{prefix + "avg@k": ..., prefix + "pass@k": ..., [prefix + "maj@k": ...,]
      prefix + "response_length_mean": ...}``.
    """
    scores = sample_and_score(
        sampler=sampler,
        params=params,
        scorer=scorer,
        tokenizer=tokenizer,
        prompts=prompts,
        sampling=sampling,
        episodes=episodes,
    )
    if majority is None:
        majority = sampling.k > 1 and getattr(scorer, "kind", None) == "math"
    return summarize(scores, pass_ks=pass_ks, majority=majority, prefix=prefix)


@dataclasses.dataclass(frozen=True)
class BenchmarkLoading:
    """Which problems of each benchmark file are read, and how their prompts are cut.

    Attributes:
      limit: the first ``limit`` problems of each set (None: all).
      max_prompt_length: longer prompts are cut from the left.
      split: split of a benchmark directory (None: ``"test"``, else ``"train"`` when the
        directory has no test split; a single file is read whole).
    """

    limit: int | None = None
    max_prompt_length: int = 2048
    split: str | None = None


def _load_benchmark(bench: Benchmark, path: str, tokenizer, loading: BenchmarkLoading):
    split, limit, max_prompt_length = loading.split, loading.limit, loading.max_prompt_length
    try:
        loaded = load_records(path, adapter=bench.adapter, split=split or "test", limit=limit)
    except ValueError as e:
        # Hub copies of the competition sets often have a single "train" split.
        if split is not None or "split" not in str(e):
            raise
        loaded = load_records(path, adapter=bench.adapter, split="train", limit=limit)
    if loaded.skipped:
        log.warning("%s: skipped %d bad rows %s", bench.name, loaded.skipped, loaded.skip_reasons)
    if limit is None and bench.problems is not None and len(loaded.records) != bench.problems:
        log.warning(
            "%s: %s has %d problems, the published set has %d",
            bench.name,
            path,
            len(loaded.records),
            bench.problems,
        )
    enc = encode_prompts(
        loaded.records,
        tokenizer,
        max_prompt_length=max_prompt_length,
        truncation="left",
        template=bench.template,
    )
    if enc.truncated:
        log.warning("%s: %d prompts cut to %d tokens", bench.name, enc.truncated, max_prompt_length)
    return enc


def _correct_per_problem(scores) -> list[int]:
    return [int(c) for c in (scores.rewards >= 1.0).sum(axis=1)]


def _response_budget(name: str, ids, context: int, max_new_tokens: int) -> int:
    """``max_new_tokens``, capped (with a warning) to what the context holds after the longest
    prompt; a prompt that leaves no room is an error."""
    budget = min(max_new_tokens, context - max(len(p) for p in ids))
    if budget < 1:
        raise ValueError(
            f"benchmark {name!r}: prompts of up to {max(map(len, ids))} tokens leave no "
            f"room in the model's context ({context} positions); lower max_prompt_length"
        )
    if budget < max_new_tokens:
        log.warning(
            "%s: max_new_tokens %d capped to %d by the model's context",
            name,
            max_new_tokens,
            budget,
        )
    return budget


def evaluate_benchmarks(
    model_dir: str | Path | None,
    benchmarks: Mapping[str, str | tuple[Benchmark, str]],
    *,
    sampling: EvalSampling = EvalSampling(),
    loading: BenchmarkLoading = BenchmarkLoading(),
    num_workers: int = 2,
    pass_ks: Sequence[int] | None = None,
    out_path: str | Path | None = None,
    model=None,
    tokenizer=None,
) -> dict[str, Any]:
    """Evaluates a model on benchmark files with the paper's protocol; JSON-ready results.

    Args:
      model_dir: Hugging Face model directory (ignored when ``model`` and ``tokenizer`` given).
      benchmarks: ``{name: path}`` for names of :data:`~delta_jax.eval_sets.BENCHMARKS`, or
        ``{name: (Benchmark, path)}``.
      sampling: :class:`EvalSampling` (default: the paper's, ``k=16`` at temperature 1.0, top-p
        0.7, 30000 new tokens); ``max_new_tokens`` is capped to what the model's context holds
        after the longest prompt, with a warning.
      loading: :class:`BenchmarkLoading`: problems per set, prompt length, split.
      num_workers: reward-scoring processes.
      pass_ks: k values of pass@k (default: 1, 2, 4, ..., k).
      out_path: also write the results there as JSON.
      model: an already loaded model (with ``tokenizer``) instead of ``model_dir``.
      tokenizer: its tokenizer.

    Returns:
      ``{"settings": {...}, "benchmarks": {name: {"problems", "avg@k", "pass@j"..., "maj@k",
      "response_length_mean", "reasons", "correct_per_problem"}}, "average": {"paper_suite"
      and/or "all": {"benchmarks", "problems", metric: problem-weighted mean}}}``.
    """
    if not benchmarks:
        raise ValueError("benchmarks is empty: give at least one name -> path")
    if model is None or tokenizer is None:
        model, tokenizer = from_pretrained(str(model_dir)), load_tokenizer(str(model_dir))
    k = sampling.k
    pass_ks = tuple(pass_ks or default_pass_ks(k))
    if sampling.stop_token_ids is None:
        eos = {tokenizer.eos_token_id, getattr(model.config, "eos_token_id", None)}
        stop_ids = tuple(sorted(int(s) for s in eos if isinstance(s, int | np.integer)))
        sampling = dataclasses.replace(sampling, stop_token_ids=stop_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sampler = Sampler(model, pad_token_id=pad)
    settings = {f: getattr(sampling, f) for f in ("k", "temperature", "top_p", "max_new_tokens")}
    results: dict[str, Any] = {
        "settings": dict(model=str(model_dir), **settings, seed=sampling.seed, limit=loading.limit),
        "benchmarks": {},
    }
    for name, spec in benchmarks.items():
        bench, path = spec if isinstance(spec, tuple) else (resolve_benchmark(name), spec)
        enc = _load_benchmark(bench, str(path), tokenizer, loading)
        if not enc.ids:
            raise ValueError(f"benchmark {name!r}: {path} has no usable problems")
        budget = _response_budget(
            name, enc.ids, model.config.max_position_embeddings, sampling.max_new_tokens
        )
        timeout = 10.0 if bench.is_math else 30.0
        with RewardScorer(bench.reward, num_workers=num_workers, timeout_s=timeout) as scorer:
            scores = sample_and_score(
                sampler=sampler,
                params=None,
                scorer=scorer,
                tokenizer=tokenizer,
                prompts=enc,
                sampling=dataclasses.replace(sampling, max_new_tokens=budget),
            )
        row = {"problems": len(enc.ids), "path": str(path)}
        row |= summarize(scores, pass_ks=[j for j in pass_ks if j <= k], majority=bench.is_math)
        row |= {"reasons": scores.reasons, "correct_per_problem": _correct_per_problem(scores)}
        results["benchmarks"][name] = row
        log.info("%s: avg@%d %.4f over %d problems", name, k, row[f"avg@{k}"], len(enc.ids))
    results["average"] = suite_averages(results["benchmarks"])
    if out_path is not None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(results, indent=2) + "\n")
    return results


def suite_averages(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Problem-weighted means of every metric the benchmarks share, per group.

    Groups: ``"paper_suite"`` (the benchmarks of :data:`PAPER_SUITE` present) and ``"all"``
    (only when it differs from the former).
    """
    groups = {"paper_suite": [b for b in rows if b in PAPER_SUITE], "all": list(rows)}
    if groups["all"] == groups["paper_suite"]:
        del groups["all"]
    out: dict[str, dict[str, Any]] = {}
    for group, names in groups.items():
        if not names:
            continue
        metrics = [m for m, v in rows[names[0]].items() if isinstance(v, float)]
        counts = {b: rows[b]["problems"] for b in names}
        out[group] = {"benchmarks": names, "problems": sum(counts.values())}
        for m in metrics:
            if all(m in rows[b] for b in names):
                out[group][m] = weighted_average({b: rows[b][m] for b in names}, counts)
    return out


def format_table(results: Mapping[str, Any]) -> str:
    """The results of :func:`evaluate_benchmarks` as a fixed-width table, scores in %."""
    rows = dict(results["benchmarks"])
    for group, values in results.get("average", {}).items():
        rows[f"Avg ({group}, weighted)"] = values
    first = next(iter(results["benchmarks"].values()))
    cols = [m for m in first if m.split("@")[0] in ("avg", "pass", "maj")]
    k = results.get("settings", {}).get("k")
    if k is not None:  # avg@k, maj@k and the largest pass@k; every pass@j stays in the JSON
        cols = [m for m in cols if not m.startswith("pass@") or m == f"pass@{k}"]
    width = max(len(n) for n in rows) + 2
    lines = [f"{'benchmark':<{width}}{'problems':>9}" + "".join(f"{c:>10}" for c in cols)]
    for name, row in rows.items():
        cells = "".join(
            f"{100 * row[c]:>10.2f}" if isinstance(row.get(c), float) else f"{'-':>10}"
            for c in cols
        )
        lines.append(f"{name:<{width}}{row['problems']:>9}" + cells)
    return "\n".join(lines)


def add_eval_arguments(parser) -> None:
    """Adds the ``delta-jax eval`` options to an ``argparse`` (sub)parser."""
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument(
        "--bench",
        action="append",
        default=[],
        metavar="NAME[:ADAPTER]=PATH",
        help="benchmark file or directory, repeatable; known names: aime24 aime25 aime26 "
        "hmmt25_feb hmmt25_nov hmmt26_feb brumo25 math500 gsm8k humaneval_plus mbpp_plus",
    )
    parser.add_argument("--k", type=int, default=PAPER_K, help="samples per problem")
    parser.add_argument("--max-new-tokens", type=int, default=PAPER_MAX_NEW_TOKENS)
    parser.add_argument("--temperature", type=float, default=PAPER_TEMPERATURE)
    parser.add_argument("--top-p", type=float, default=PAPER_TOP_P)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="first N problems of each set")
    parser.add_argument("--workers", type=int, default=2, help="reward-scoring processes")
    parser.add_argument("--max-prompt-length", type=int, default=2048)
    parser.add_argument(
        "--split", default=None, help="split of benchmark directories (default: test, else train)"
    )
    parser.add_argument("--batch-prompts", type=int, default=64, help="prompts per sampler call")
    parser.add_argument("--out", default=None, help="write the results JSON here")


def run_eval_cli(args) -> int:
    """``delta-jax eval``: evaluate, print the table (and the JSON path); returns the exit code."""
    if not args.bench:
        raise ValueError("give at least one --bench NAME=PATH")
    results = evaluate_benchmarks(
        args.model,
        parse_benchmark_args(args.bench),
        sampling=EvalSampling(
            k=args.k,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            batch_prompts=args.batch_prompts,
        ),
        loading=BenchmarkLoading(
            limit=args.limit, max_prompt_length=args.max_prompt_length, split=args.split
        ),
        num_workers=args.workers,
        out_path=args.out,
    )
    print(format_table(results))
    if args.out:
        print(f"results: {args.out}")
    return 0
