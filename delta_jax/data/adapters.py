"""Schema adapters: one row of a known data set -> the fields of a :class:`PromptRecord`.

=============== ===================================================== ==========================
name            data set (columns read)                               record
=============== ===================================================== ==========================
``generic``     any: ``fields`` maps prompt/answer/system/tests        as mapped
``deepmath``    DeepMath-103K (question, final_answer; difficulty,     prompt, answer
                topic kept; the three r1_solution_* are never read)
``dapo_math``   DAPO-Math-17k (prompt messages, reward_model           prompt (instruction kept
                .ground_truth; data_source, ability, extra_info)       as the data set wrote it)
``gsm8k``       GSM8K (question, answer "... #### 42")                 answer = "42"
``math500``     MATH-500 (problem, answer; solution, subject, level,   prompt, answer
                unique_id kept)
``aime``        AIME24/25/26, HMMT, Brumo (problem or question, also   answer str (ints become
                capitalised; answer; id/ID, solution, url, year kept)  their decimal string)
``eurus2_code`` Eurus-2-RL-Data code rows (prompt messages,            tests = ground_truth JSON
                reward_model.ground_truth, ability == "code")          string, answer None
=============== ===================================================== ==========================

Message lists (``[{"role", "content"}, ...]``) must hold one user message, optionally after one
system message; the system text goes to ``PromptRecord.system``. Adapters raise
:class:`BadRowError` for a bad row, with ``kind`` one of ``missing`` (null, or a row without the
column), ``empty`` (blank text), ``wrong type`` and ``invalid`` (well-typed but unusable, e.g.
GSM8K without ``####``, or text that is not valid Unicode: an unpaired surrogate, which no
tokenizer takes).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

GENERIC_FIELDS = ("prompt", "answer", "system", "tests")


class BadRowError(ValueError):
    """A row that an adapter cannot convert.

    Adapters raise it with ``field``, ``kind`` and a detail; the loader re-raises it with
    ``source`` (the file) and ``row`` (0-based index within the file) filled in.
    """

    def __init__(
        self, field: str, kind: str, detail: str, *, source: str | None = None, row: int = -1
    ):
        self.field, self.kind, self.detail, self.source, self.row = field, kind, detail, source, row
        where = f"{source}: row {row}: " if source is not None else ""
        super().__init__(f"{where}field '{field}' {kind}: {detail}")

    @property
    def reason(self) -> str:
        """The key under which a skipped row is counted, e.g. ``"prompt: empty"``."""
        return f"{self.field}: {self.kind}"


@dataclasses.dataclass(frozen=True)
class Adapter:
    """Converts rows of one schema into :class:`PromptRecord` fields.

    Attributes:
      name: short name used in messages and as the key in :data:`ADAPTERS`.
      convert: ``row -> dict`` with keys among ``prompt, answer, system, tests, extra``; raises
        :class:`BadRowError` for a bad row. ``row`` maps the columns below (optional ones only
        when the file has them) to Python values.
      required: columns the file must have; a tuple entry means "at least one of these".
      optional: columns read when present (metadata, mostly).
    """

    name: str
    convert: Callable[[Mapping[str, Any]], dict]
    required: tuple[str | tuple[str, ...], ...]
    optional: tuple[str, ...] = ()

    def columns(self, available: Sequence[str], source: str) -> list[str]:
        """The columns to read from a file with ``available`` columns; raises if one is absent."""
        wanted: list[str] = []
        for need in self.required:
            options = (need,) if isinstance(need, str) else need
            present = [c for c in options if c in available]
            if not present:
                raise ValueError(
                    f"{source}: adapter '{self.name}' needs column "
                    f"{' or '.join(map(repr, options))}; the file has {sorted(map(str, available))}"
                )
            wanted += present
        return wanted + [c for c in self.optional if c in available and c not in wanted]


def require_text(value: Any, field: str, col: str) -> str:
    """``value`` as a plain, non-blank, valid Unicode string, else a :class:`BadRowError`
    naming ``field``/``col``."""
    if value is None:
        raise BadRowError(field, "missing", f"column {col!r} is null")
    if not isinstance(value, str):
        raise BadRowError(field, "wrong type", f"column {col!r} holds {type(value).__name__}")
    value = str.__str__(value)  # a plain str, whatever a subclass overrides
    if not value.strip():
        raise BadRowError(field, "empty", f"column {col!r} is blank")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        detail = f"column {col!r} is not valid Unicode (an unpaired surrogate at index {e.start})"
        raise BadRowError(field, "invalid", detail) from None
    return value


def _answer(value: Any, col: str) -> str:
    # Evaluation sets store integer answers as ints (AIME) and JSON readers may widen them to
    # floats; both mean the same decimal string.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    return require_text(value, "answer", col).strip()


def _struct(value: Any, field: str, col: str) -> Mapping[str, Any]:
    if value is None:
        raise BadRowError(field, "missing", f"column {col!r} is null")
    if not isinstance(value, Mapping):
        raise BadRowError(field, "wrong type", f"column {col!r} holds {type(value).__name__}")
    return value


def _messages(value: Any, col: str) -> tuple[str | None, str]:
    """(system, user) from a chat message list."""
    if value is None:
        raise BadRowError("prompt", "missing", f"column {col!r} is null")
    if not isinstance(value, list | tuple):
        raise BadRowError(
            "prompt", "wrong type", f"column {col!r} holds {type(value).__name__}, not messages"
        )
    system, user = None, None
    for i, msg in enumerate(value):
        if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
            detail = f"message {i} is not a {{role, content}} dict"
            raise BadRowError("prompt", "wrong type", detail)
        role = msg["role"]
        if role == "system" and system is None and user is None and i == 0:
            system = require_text(msg.get("content"), "system", f"{col}[{i}].content")
        elif role == "user" and user is None:
            user = require_text(msg.get("content"), "prompt", f"{col}[{i}].content")
        else:
            raise BadRowError(
                "prompt", "invalid", f"message {i} has role {role!r}; expected [system], user"
            )
    if user is None:
        raise BadRowError("prompt", "missing", f"column {col!r} has no user message")
    return system, user


def _tests_json(value: Any, field: str, col: str) -> str:
    """Validated code tests as a JSON string (``inputs``/``outputs`` lists, optional fn_name)."""
    if isinstance(value, Mapping):
        spec, value = value, json.dumps(value)
    else:
        text = require_text(value, field, col)
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise BadRowError(field, "invalid", f"column {col!r} is not JSON ({e.msg})") from None
    if not isinstance(spec, Mapping):
        raise BadRowError(field, "invalid", f"column {col!r} is JSON but not an object")
    inputs, outputs = spec.get("inputs"), spec.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs:
        raise BadRowError(field, "invalid", f"column {col!r} lacks non-empty inputs/outputs lists")
    if len(inputs) != len(outputs):
        raise BadRowError(
            field, "invalid", f"column {col!r}: {len(inputs)} inputs vs {len(outputs)} outputs"
        )
    if "fn_name" in spec and not isinstance(spec["fn_name"], str):
        raise BadRowError(field, "invalid", f"column {col!r}: fn_name is not a string")
    return value


def _kept(row: Mapping[str, Any], cols: Sequence[str]) -> dict:
    return {c: row[c] for c in cols if c in row}


def generic_adapter(fields: Mapping[str, str] | None = None) -> Adapter:
    """An adapter reading the columns named by ``fields``.

    Args:
      fields: ``{"prompt": col, "answer": col, "system": col, "tests": col}``; ``prompt`` is
        required, the others are read only when given. The prompt column may hold text or a
        message list (whose system message is used unless ``system`` is mapped). ``tests`` may
        hold a JSON string or an object. Default ``{"prompt": "prompt", "answer": "answer"}``.

    Returns:
      An :class:`Adapter` named ``"generic"``.

    Example::

      load_records("rl.jsonl", fields={"prompt": "query", "answer": "gold"})
      load_records("code.parquet", adapter=generic_adapter({"prompt": "q", "tests": "cases"}))
    """
    fields = dict(fields or {"prompt": "prompt", "answer": "answer"})
    unknown = sorted(set(fields) - set(GENERIC_FIELDS))
    if unknown or "prompt" not in fields:
        raise ValueError(
            f"fields must map 'prompt' and optionally {list(GENERIC_FIELDS[1:])} to columns, "
            f"got {fields}"
        )

    def convert(row: Mapping[str, Any]) -> dict:
        value = row[fields["prompt"]]
        if isinstance(value, list | tuple):
            system, prompt = _messages(value, fields["prompt"])
        else:
            system, prompt = None, require_text(value, "prompt", fields["prompt"])
        if "system" in fields and row[fields["system"]] is not None:
            system = require_text(row[fields["system"]], "system", fields["system"])
        answer = _answer(row[fields["answer"]], fields["answer"]) if "answer" in fields else None
        tests = None
        if "tests" in fields:
            tests = _tests_json(row[fields["tests"]], "tests", fields["tests"])
        return dict(prompt=prompt, answer=answer, system=system, tests=tests)

    return Adapter("generic", convert, required=tuple(dict.fromkeys(fields.values())))


def _deepmath(row: Mapping[str, Any]) -> dict:
    return dict(
        prompt=require_text(row["question"], "prompt", "question"),
        answer=_answer(row["final_answer"], "final_answer"),
        extra=_kept(row, ("difficulty", "topic")),
    )


def _dapo_math(row: Mapping[str, Any]) -> dict:
    system, prompt = _messages(row["prompt"], "prompt")
    reward_model = _struct(row["reward_model"], "answer", "reward_model")
    info = row.get("extra_info") or {}
    extra = _kept(row, ("data_source", "ability"))
    if isinstance(info, Mapping) and "index" in info:
        extra["index"] = info["index"]
    return dict(
        prompt=prompt,
        system=system,
        answer=_answer(reward_model.get("ground_truth"), "reward_model.ground_truth"),
        extra=extra,
    )


def _gsm8k(row: Mapping[str, Any]) -> dict:
    solution = require_text(row["answer"], "answer", "answer")
    if "####" not in solution:
        raise BadRowError("answer", "invalid", "column 'answer' has no '#### <number>' line")
    reasoning, _, final = solution.rpartition("####")
    # GSM8K writes thousands with commas ("1,200"); the reference answer is the bare number.
    final = final.strip().replace(",", "")
    if not final:
        raise BadRowError("answer", "empty", "nothing after '####' in column 'answer'")
    return dict(
        prompt=require_text(row["question"], "prompt", "question"),
        answer=final,
        extra={"solution": reasoning.strip()},
    )


def _math500(row: Mapping[str, Any]) -> dict:
    return dict(
        prompt=require_text(row["problem"], "prompt", "problem"),
        answer=_answer(row["answer"], "answer"),
        extra=_kept(row, ("solution", "subject", "level", "unique_id")),
    )


def _aime(row: Mapping[str, Any]) -> dict:
    # Variants name the statement problem/question (some capitalised: AIME_2024 has Problem,
    # Answer, ID); when a file has several, the first non-null one wins.
    cols = [c for c in _AIME_PROMPT if c in row]
    col = next((c for c in cols if row[c] is not None), cols[0])
    answer_col = next(c for c in ("answer", "Answer") if c in row)
    extra = {k.lower(): row[k] for k in ("solution", "Solution", "url", "year") if k in row}
    for key in ("id", "ID", "problem_idx"):
        if key in row:
            extra["id"] = row[key]
    return dict(
        prompt=require_text(row[col], "prompt", col),
        answer=_answer(row[answer_col], answer_col),
        extra=extra,
    )


_AIME_PROMPT = ("problem", "question", "Problem", "Question")


def _eurus2_code(row: Mapping[str, Any]) -> dict:
    ability = row.get("ability")
    if ability != "code":
        raise BadRowError("ability", "invalid", f"column 'ability' is {ability!r}, not 'code'")
    system, prompt = _messages(row["prompt"], "prompt")
    reward_model = _struct(row["reward_model"], "tests", "reward_model")
    tests = _tests_json(reward_model.get("ground_truth"), "tests", "reward_model.ground_truth")
    extra = _kept(row, ("data_source",))
    if isinstance(row.get("extra_info"), Mapping):
        extra.update(row["extra_info"])
    return dict(prompt=prompt, system=system, answer=None, tests=tests, extra=extra)


ADAPTERS: dict[str, Adapter] = {
    "generic": generic_adapter(),
    "deepmath": Adapter(
        "deepmath",
        _deepmath,
        required=("question", "final_answer"),
        optional=("difficulty", "topic"),
    ),
    "dapo_math": Adapter(
        "dapo_math",
        _dapo_math,
        required=("prompt", "reward_model"),
        optional=("data_source", "ability", "extra_info"),
    ),
    "gsm8k": Adapter("gsm8k", _gsm8k, required=("question", "answer")),
    "math500": Adapter(
        "math500",
        _math500,
        required=("problem", "answer"),
        optional=("solution", "subject", "level", "unique_id"),
    ),
    "aime": Adapter(
        "aime",
        _aime,
        required=(_AIME_PROMPT, ("answer", "Answer")),
        optional=("id", "ID", "problem_idx", "solution", "Solution", "url", "year"),
    ),
    "eurus2_code": Adapter(
        "eurus2_code",
        _eurus2_code,
        required=("prompt", "reward_model", "ability"),
        optional=("data_source", "extra_info"),
    ),
}


def resolve_adapter(adapter: str | Adapter, fields: Mapping[str, str] | None) -> Adapter:
    """The :class:`Adapter` for ``adapter`` (a name in :data:`ADAPTERS` or an instance)."""
    if isinstance(adapter, Adapter):
        if fields is not None:
            raise ValueError("fields applies to the 'generic' adapter only, not to an Adapter")
        return adapter
    if adapter == "generic":
        return generic_adapter(fields)
    if adapter not in ADAPTERS:
        raise ValueError(
            f"adapter must be an Adapter or one of {sorted(ADAPTERS)}, got {adapter!r}"
        )
    if fields is not None:
        raise ValueError(f"fields applies to the 'generic' adapter only, not to {adapter!r}")
    return ADAPTERS[adapter]
