"""Mini data sets in the schemas of the real ones, and writers for every supported format.

Each ``*_ROWS`` list copies the column names, nesting and value types of the published data set
(strings shortened); each ``*_EXPECTED`` list is what the matching adapter must make of it,
written out by hand.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
EURUS_SYSTEM = "\nWhen tackling complex reasoning tasks, you have access to the following actions."
EURUS_TESTS_IO = json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]})
EURUS_TESTS_FN = json.dumps({"fn_name": "add", "inputs": [[1, 2]], "outputs": [[3]]})

DEEPMATH_ROWS = [
    {
        "question": "Evaluate the limit \\( \\lim_{x\\to 0} \\frac{\\sin x}{x} \\).",
        "final_answer": "1",
        "difficulty": 3.0,
        "topic": "Mathematics -> Calculus -> Limits",
        "r1_solution_1": "Okay, so ... \\boxed{1}",
        "r1_solution_2": "Alright ... \\boxed{1}",
        "r1_solution_3": "Hmm ... \\boxed{1}",
    },
    {
        "question": "Find the sum of the roots of x^2 - 5x + 6 = 0.",
        "final_answer": "\\dfrac{10}{2}",
        "difficulty": 2.5,
        "topic": "Mathematics -> Algebra -> Polynomials",
        "r1_solution_1": "a",
        "r1_solution_2": "b",
        "r1_solution_3": "c",
    },
]
DEEPMATH_EXPECTED = [
    (DEEPMATH_ROWS[0]["question"], "1", None, None),
    (DEEPMATH_ROWS[1]["question"], "\\dfrac{10}{2}", None, None),
]

DAPO_ROWS = [
    {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_PREFIX + "What is 3 + 4?" + DAPO_SUFFIX, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "7", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"},
    },
    {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_PREFIX + "Compute 2^10." + DAPO_SUFFIX, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "1024", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "b426d104-244d-4831-a2c4-cd756b61700a"},
    },
]
DAPO_EXPECTED = [
    (DAPO_PREFIX + "What is 3 + 4?" + DAPO_SUFFIX, "7", None, None),
    (DAPO_PREFIX + "Compute 2^10." + DAPO_SUFFIX, "1024", None, None),
]

GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 friends in April, and half as many in May. Total?",
        "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\n48+24 = <<48+24=72>>72\n#### 72",
    },
    {
        "question": "A farm has 1,200 hens and buys 300 more. How many hens?",
        "answer": "1200 + 300 = <<1200+300=1500>>1500\n#### 1,500",
    },
]
GSM8K_EXPECTED = [
    (GSM8K_ROWS[0]["question"], "72", None, None),
    (GSM8K_ROWS[1]["question"], "1500", None, None),
]

MATH500_ROWS = [
    {
        "problem": "Convert the point $(0,3)$ to polar coordinates.",
        "solution": "We have $r = 3$, $\\theta = \\frac{\\pi}{2}$ ... \\boxed{(3,\\frac{\\pi}{2})}",
        "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
        "subject": "Precalculus",
        "level": 2,
        "unique_id": "test/precalculus/807.json",
    },
    {
        "problem": "What is $1+1$?",
        "solution": "\\boxed{2}",
        "answer": "2",
        "subject": "Prealgebra",
        "level": 1,
        "unique_id": "test/prealgebra/1.json",
    },
]
MATH500_EXPECTED = [
    (MATH500_ROWS[0]["problem"], "\\left( 3, \\frac{\\pi}{2} \\right)", None, None),
    ("What is $1+1$?", "2", None, None),
]

# HuggingFaceH4/aime_2024 style: problem, string answer, id, solution, url, year.
AIME_H4_ROWS = [
    {
        "id": 60,
        "problem": "Find the number of positive divisors of 2024.",
        "solution": "2024 = 2^3 * 11 * 23 ...",
        "answer": "016",
        "url": "https://artofproblemsolving.com/wiki/index.php/2024_AIME_I_Problems/Problem_1",
        "year": "2024",
    },
    {
        "id": 61,
        "problem": "Compute 7 * 11 * 13.",
        "solution": "...",
        "answer": "1001",
        "url": "https://artofproblemsolving.com/wiki/index.php/2024_AIME_I_Problems/Problem_2",
        "year": "2024",
    },
]
AIME_H4_EXPECTED = [
    (AIME_H4_ROWS[0]["problem"], "016", None, None),
    (AIME_H4_ROWS[1]["problem"], "1001", None, None),
]
# opencompass/AIME2025 style: question, integer answer, no id.
AIME_QUESTION_ROWS = [
    {"question": "Find the sum of all bases b > 9 for which 17_b divides 97_b.", "answer": 70},
    {"question": "How many ordered pairs ...?", "answer": 117},
]
AIME_QUESTION_EXPECTED = [
    (AIME_QUESTION_ROWS[0]["question"], "70", None, None),
    ("How many ordered pairs ...?", "117", None, None),
]
# Maxwell-Jia/AIME_2024 style: capitalised columns.
AIME_CAPS_ROWS = [
    {"ID": "2024-I-1", "Problem": "Aya walks 9 km.", "Solution": "...", "Answer": 204},
    {"ID": "2024-I-2", "Problem": "There exist real numbers x, y.", "Solution": "", "Answer": 25},
]
AIME_CAPS_EXPECTED = [
    ("Aya walks 9 km.", "204", None, None),
    ("There exist real numbers x, y.", "25", None, None),
]

EURUS_ROWS = [
    {
        "data_source": "taco",
        "prompt": [
            {"content": EURUS_SYSTEM, "role": "system"},
            {"content": "Write Python code to solve the task:\nPrint a+b.", "role": "user"},
        ],
        "ability": "code",
        "reward_model": {"ground_truth": EURUS_TESTS_IO, "style": "rule"},
        "extra_info": {"index": 0, "split": "dummy"},
    },
    {
        "data_source": "apps",
        "prompt": [
            {"content": EURUS_SYSTEM, "role": "system"},
            {"content": "Write a function add(a, b).", "role": "user"},
        ],
        "ability": "code",
        "reward_model": {"ground_truth": EURUS_TESTS_FN, "style": "rule"},
        "extra_info": {"index": 1, "split": "dummy"},
    },
]
EURUS_EXPECTED = [
    (
        "Write Python code to solve the task:\nPrint a+b.",
        None,
        EURUS_SYSTEM,
        EURUS_TESTS_IO,
    ),
    ("Write a function add(a, b).", None, EURUS_SYSTEM, EURUS_TESTS_FN),
]

# adapter name -> (rows, expected (prompt, answer, system, tests) per row)
SCHEMAS = {
    "deepmath": (DEEPMATH_ROWS, DEEPMATH_EXPECTED),
    "dapo_math": (DAPO_ROWS, DAPO_EXPECTED),
    "gsm8k": (GSM8K_ROWS, GSM8K_EXPECTED),
    "math500": (MATH500_ROWS, MATH500_EXPECTED),
    "aime": (AIME_H4_ROWS, AIME_H4_EXPECTED),
    "eurus2_code": (EURUS_ROWS, EURUS_EXPECTED),
}


def write_rows(rows: list[dict], path: Path) -> Path:
    """Writes ``rows`` to ``path`` in the format its suffix names (.parquet/.jsonl/.json/.arrow)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif suffix == ".arrow":
        # The Arrow IPC stream format, as `datasets` writes its own .arrow files.
        table = pa.Table.from_pylist(rows)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    else:
        raise ValueError(f"unknown suffix {suffix}")
    return path


def as_tuples(records) -> list[tuple]:
    return [(r.prompt, r.answer, r.system, r.tests) for r in records]


def build_cached_dataset(
    cache_dir: Path, repo_id: str, config: str, splits: dict[str, list[dict]], staging: Path
) -> Path:
    """Puts a data set into a ``datasets`` cache as if ``load_dataset(repo_id, config)`` had run.

    The Parquet builder prepares the Arrow files and ``dataset_info.json``; they are placed at
    ``<cache_dir>/<namespace>___<name>/<config>/0.0.0/<hash>/``, the layout the library's
    offline lookup of a Hub name searches.
    """
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    files = {s: [str(write_rows(rows, staging / f"{s}.parquet"))] for s, rows in splits.items()}
    namespace, name = repo_id.split("/")
    builder = Parquet(
        cache_dir=str(staging / "cache"),
        dataset_name=name,
        config_name=config,
        data_files=DataFilesDict.from_patterns(files),
    )
    builder.download_and_prepare()
    target = cache_dir / f"{namespace}___{name}" / config / "0.0.0" / "0123abcd"
    target.parent.mkdir(parents=True)
    shutil.copytree(builder.cache_dir, target)
    return target
