"""Evaluation benchmarks: which file schema, reward and prompt template each one uses.

================== ============ ======= ======================================================
name               adapter      reward  problems (as published; a different count is warned)
================== ============ ======= ======================================================
``aime24``         aime         math    30
``aime25``         aime         math    30
``aime26``         aime         math    30
``hmmt25_feb``     aime         math    30
``hmmt25_nov``     aime         math    30
``hmmt26_feb``     aime         math    33
``brumo25``        aime         math    30
``math500``        math500      math    500
``gsm8k``          gsm8k        math    1319
``humaneval_plus`` humaneval    code    164
``mbpp_plus``      mbpp         code    378
================== ============ ======= ======================================================

The first seven form :data:`PAPER_SUITE`, the paper's evaluation (DELTA_SPEC §7), whose "Avg"
column weights each set by its number of questions.

The two code sets use the schemas of the EvalPlus releases on the Hugging Face hub:

* HumanEval+ (``task_id, prompt, entry_point, test``; ``canonical_solution`` ignored): the
  prompt is a function signature with its docstring; ``test`` defines ``check(candidate)``. The
  item's tests are that script followed by ``check(<entry_point>)``, and the import lines of
  the prompt are run before the response's code (:func:`score_code_with_prefix`), since a chat
  model often returns the function without the ``from typing import List`` it relies on.
* MBPP+ (``task_id, prompt, test_list, test, test_imports``; ``code`` ignored): the prompt is a
  one-line task and the first of ``test_list`` is shown to the model, as in the original MBPP
  setting, so that it knows the function's name and signature; ``test`` is a script that calls
  the function on the plus inputs, preceded by ``test_imports``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from delta_jax.data import Adapter, BadRowError
from delta_jax.data.adapters import require_text
from delta_jax.rewards import extract_code, run_code

CODE_TIMEOUT_S = 20.0  # all of a problem's plus tests together (MBPP+ has some slow ones)
MATH_TEMPLATE = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_TEMPLATE = (
    "Complete the following Python function. Reply with the complete function, including any "
    "imports it needs, in a single ```python code block.\n\n```python\n{prompt}```"
)
MBPP_TEMPLATE = (
    "{prompt}\nWrite the function in Python and reply with it, including any imports it needs, "
    "in a single ```python code block."
)


def _text(row: Mapping[str, Any], col: str, field: str) -> str:
    return require_text(row[col], field, col)


def _import_lines(source: str) -> str:
    """The top-level ``import`` / ``from ... import`` lines of a code prompt."""
    return "\n".join(line for line in source.splitlines() if line.startswith(("import ", "from ")))


def _humaneval(row: Mapping[str, Any]) -> dict:
    prompt = _text(row, "prompt", "prompt")
    entry = _text(row, "entry_point", "tests").strip()
    test = _text(row, "test", "tests")
    return dict(
        prompt=prompt,
        answer=None,
        tests=f"{test}\n\ncheck({entry})\n",
        extra={"task_id": row.get("task_id"), "code_prefix": _import_lines(prompt)},
    )


def _mbpp(row: Mapping[str, Any]) -> dict:
    task = _text(row, "prompt", "prompt").strip()
    examples = row["test_list"]
    if not isinstance(examples, list | tuple) or not examples:
        raise BadRowError("prompt", "invalid", "column 'test_list' holds no example assert")
    example = _text({"test_list[0]": examples[0]}, "test_list[0]", "prompt").strip()
    imports = row.get("test_imports") or []
    if not isinstance(imports, list | tuple) or not all(isinstance(s, str) for s in imports):
        raise BadRowError("tests", "wrong type", "column 'test_imports' is not a list of strings")
    test = _text(row, "test", "tests")
    header = "\n".join(imports)
    return dict(
        prompt=f"{task}\nYour code should pass this test:\n{example}",
        answer=None,
        tests=f"{header}\n{test}\n" if header else f"{test}\n",
        extra={"task_id": row.get("task_id"), "code_prefix": header},
    )


HUMANEVAL_ADAPTER = Adapter(
    "humaneval",
    _humaneval,
    required=("prompt", "entry_point", "test"),
    optional=("task_id",),
)
MBPP_ADAPTER = Adapter(
    "mbpp",
    _mbpp,
    required=("prompt", "test_list", "test"),
    optional=("task_id", "test_imports"),
)


def score_code_with_prefix(prompt: str, response: str, item: Mapping[str, Any]) -> float:
    """1.0 when the response's last code block, after the item's ``code_prefix``, passes its tests.

    A module-level function so that :class:`~delta_jax.rewards.RewardScorer` can ship it to its
    worker processes, which give it the per-item deadline and crash isolation.

    Args:
      prompt: unused (the scorer's calling convention).
      response: the model's response; the code is its last fenced block.
      item: ``{"tests": ..., "code_prefix": ...}`` (``code_prefix`` optional).

    Returns:
      1.0 or 0.0.
    """
    code = extract_code(response)
    if code is None:
        return 0.0
    prefix = item.get("code_prefix") or ""
    program = f"{prefix}\n{code}" if prefix else code
    return float(run_code(program, item["tests"], timeout_s=CODE_TIMEOUT_S).passed)


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """How to read, prompt and score one evaluation set.

    Attributes:
      name: key in :data:`BENCHMARKS` and in the results.
      adapter: a :data:`delta_jax.data.ADAPTERS` name or an :class:`~delta_jax.data.Adapter`.
      reward: ``"math"`` or a picklable ``(prompt, response, item) -> float`` for code.
      template: the user message, ``{prompt}`` replaced by the problem.
      problems: number of problems of the published set (None: unknown).
    """

    name: str
    adapter: str | Adapter
    reward: Any
    template: str
    problems: int | None = None

    @property
    def is_math(self) -> bool:
        """Math sets get maj@k (a vote over final answers); code sets do not."""
        return self.reward == "math"


def _math(name: str, adapter: str, problems: int) -> Benchmark:
    return Benchmark(name, adapter, "math", MATH_TEMPLATE, problems)


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        _math("aime24", "aime", 30),
        _math("aime25", "aime", 30),
        _math("aime26", "aime", 30),
        _math("hmmt25_feb", "aime", 30),
        _math("hmmt25_nov", "aime", 30),
        _math("hmmt26_feb", "aime", 33),
        _math("brumo25", "aime", 30),
        _math("math500", "math500", 500),
        _math("gsm8k", "gsm8k", 1319),
        Benchmark(
            "humaneval_plus", HUMANEVAL_ADAPTER, score_code_with_prefix, HUMANEVAL_TEMPLATE, 164
        ),
        Benchmark("mbpp_plus", MBPP_ADAPTER, score_code_with_prefix, MBPP_TEMPLATE, 378),
    )
}
PAPER_SUITE: tuple[str, ...] = (
    "aime24",
    "aime25",
    "aime26",
    "hmmt25_feb",
    "hmmt25_nov",
    "hmmt26_feb",
    "brumo25",
)


def resolve_benchmark(name: str, adapter: str | None = None) -> Benchmark:
    """The :class:`Benchmark` called ``name``; an unknown name needs ``adapter`` (math reward).

    Args:
      name: a key of :data:`BENCHMARKS`, or any name for a math set read with ``adapter``.
      adapter: overrides the adapter (a :data:`delta_jax.data.ADAPTERS` name).

    Returns:
      The benchmark description.
    """
    known = BENCHMARKS.get(name)
    if known is not None:
        return known if adapter is None else dataclasses.replace(known, adapter=adapter)
    if adapter is None:
        raise ValueError(
            f"benchmark {name!r} is not one of {sorted(BENCHMARKS)}; name its adapter "
            f"(e.g. {name}:math500=PATH on the command line)"
        )
    return Benchmark(name, adapter, "math", MATH_TEMPLATE, None)


def parse_benchmark_args(specs: Sequence[str]) -> dict[str, tuple[Benchmark, str]]:
    """``["aime24=/d/aime24.parquet", "mine:math500=/d/x.jsonl"]`` -> ``{name: (bench, path)}``.

    Each spec is ``NAME=PATH`` or ``NAME:ADAPTER=PATH``.
    """
    out: dict[str, tuple[Benchmark, str]] = {}
    for spec in specs:
        key, sep, path = spec.partition("=")
        if not sep or not key or not path:
            raise ValueError(f"--bench expects NAME=PATH or NAME:ADAPTER=PATH, got {spec!r}")
        name, _, adapter = key.partition(":")
        if name in out:
            raise ValueError(f"--bench: benchmark {name!r} given twice")
        out[name] = (resolve_benchmark(name, adapter or None), path)
    return out
