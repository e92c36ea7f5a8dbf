"""load_records: adapters on mini files of each schema, directories, cached names, bad rows."""

from __future__ import annotations

import json

import datasets
import pyarrow as pa
import pytest

from delta_jax.data import ADAPTERS, BadRowError, LoadResult, PromptRecord, load_records
from tests.data import helpers
from tests.data.helpers import SCHEMAS, as_tuples, write_rows


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "hf_cache"


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_adapter_on_its_schema(tmp_path, cache, name, fmt):
    rows, expected = SCHEMAS[name]
    path = write_rows(rows, tmp_path / f"mini.{fmt}")
    res = load_records(path, adapter=name, cache_dir=cache)
    assert isinstance(res, LoadResult)
    assert as_tuples(res.records) == expected
    assert (res.skipped, res.skip_reasons) == (0, {})
    assert [(r.source, r.row) for r in res.records] == [(str(path), 0), (str(path), 1)]


@pytest.mark.parametrize(
    "rows, expected, fmt",
    [
        (helpers.AIME_QUESTION_ROWS, helpers.AIME_QUESTION_EXPECTED, "json"),
        (helpers.AIME_CAPS_ROWS, helpers.AIME_CAPS_EXPECTED, "arrow"),
        (helpers.AIME_H4_ROWS, helpers.AIME_H4_EXPECTED, "json"),
    ],
)
def test_aime_variants_and_json_arrow_formats(tmp_path, cache, rows, expected, fmt):
    path = write_rows(rows, tmp_path / f"aime.{fmt}")
    res = load_records(path, adapter="aime", cache_dir=cache)
    assert as_tuples(res.records) == expected


def test_arrow_and_json_formats_for_nested_schemas(tmp_path, cache):
    for name, fmt in [("eurus2_code", "arrow"), ("dapo_math", "json")]:
        rows, expected = SCHEMAS[name]
        path = write_rows(rows, tmp_path / f"{name}.{fmt}")
        res = load_records(path, adapter=name, cache_dir=cache)
        assert as_tuples(res.records) == expected


def test_metadata_kept(tmp_path, cache):
    path = write_rows(helpers.DEEPMATH_ROWS, tmp_path / "d.parquet")
    rec = load_records(path, adapter="deepmath", cache_dir=cache).records[0]
    assert rec.extra == {"difficulty": 3.0, "topic": "Mathematics -> Calculus -> Limits"}
    rec = load_records(
        write_rows(helpers.DAPO_ROWS, tmp_path / "p.parquet"), adapter="dapo_math", cache_dir=cache
    ).records[1]
    assert rec.extra == {
        "data_source": "math_dapo",
        "ability": "MATH",
        "index": "b426d104-244d-4831-a2c4-cd756b61700a",
    }
    rec = load_records(
        write_rows(helpers.EURUS_ROWS, tmp_path / "e.jsonl"), adapter="eurus2_code", cache_dir=cache
    ).records[1]
    assert rec.extra == {"data_source": "apps", "index": 1, "split": "dummy"}
    assert json.loads(rec.tests)["fn_name"] == "add"
    rec = load_records(
        write_rows(helpers.AIME_CAPS_ROWS, tmp_path / "a.jsonl"), adapter="aime", cache_dir=cache
    ).records[0]
    assert rec.extra == {"id": "2024-I-1", "solution": "..."}


def test_generic_adapter_with_field_mapping(tmp_path, cache):
    cases = [{"inputs": ["x"], "outputs": ["y"]}, json.dumps({"inputs": ["a"], "outputs": ["b"]})]
    rows = [
        {"q": "Add 1 and 2.", "gold": 3, "sys": "Be brief.", "cases": cases[0]},
        {"q": "Say hi.", "gold": "hi", "sys": None, "cases": cases[1]},
    ]
    # JSON lines may mix value types in a column (int and str answers, object and str tests).
    path = write_rows(rows, tmp_path / "g.jsonl")
    fields = {"prompt": "q", "answer": "gold", "system": "sys", "tests": "cases"}
    res = load_records(path, fields=fields, cache_dir=cache)
    assert [(r.prompt, r.answer, r.system) for r in res.records] == [
        ("Add 1 and 2.", "3", "Be brief."),
        ("Say hi.", "hi", None),
    ]
    assert json.loads(res.records[0].tests) == cases[0]
    assert res.records[1].tests == cases[1]
    # Default mapping, chat-message prompts.
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    rows = [{"prompt": messages, "answer": "1"}]
    res = load_records(write_rows(rows, tmp_path / "m.jsonl"), cache_dir=cache)
    assert as_tuples(res.records) == [("U", "1", "S", None)]


def test_limit(tmp_path, cache):
    path = write_rows(helpers.GSM8K_ROWS * 3, tmp_path / "g.jsonl")
    res = load_records(path, adapter="gsm8k", limit=4, cache_dir=cache)
    assert [r.row for r in res.records] == [0, 1, 2, 3]


def test_directory_with_split_files(tmp_path, cache):
    root = tmp_path / "gsm8k"
    write_rows(helpers.GSM8K_ROWS[:1], root / "data" / "train-00000-of-00002.parquet")
    write_rows(helpers.GSM8K_ROWS[1:], root / "data" / "train-00001-of-00002.parquet")
    write_rows(helpers.GSM8K_ROWS[::-1], root / "data" / "test-00000-of-00001.jsonl")
    (root / "README.md").write_text("# mini gsm8k\n")
    train = load_records(root, adapter="gsm8k", cache_dir=cache)
    assert as_tuples(train.records) == helpers.GSM8K_EXPECTED
    assert [(r.source.rsplit("/", 1)[1], r.row) for r in train.records] == [
        ("train-00000-of-00002.parquet", 0),
        ("train-00001-of-00002.parquet", 0),
    ]
    test = load_records(root, adapter="gsm8k", split="test", cache_dir=cache)
    assert as_tuples(test.records) == helpers.GSM8K_EXPECTED[::-1]
    with pytest.raises(ValueError, match="no files for split 'validation'"):
        load_records(root, adapter="gsm8k", split="validation", cache_dir=cache)


def test_directory_without_split_names_and_save_to_disk(tmp_path, cache):
    root = tmp_path / "plain"
    write_rows(helpers.MATH500_ROWS[:1], root / "a.jsonl")
    write_rows(helpers.MATH500_ROWS[1:], root / "b.parquet")
    assert as_tuples(load_records(root, adapter="math500", cache_dir=cache).records) == (
        helpers.MATH500_EXPECTED
    )
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(helpers.MATH500_ROWS).save_to_disk(str(saved))
    assert as_tuples(load_records(saved, adapter="math500").records) == helpers.MATH500_EXPECTED
    saved_dict = tmp_path / "saved_dict"
    test_split = datasets.Dataset.from_list(helpers.MATH500_ROWS[1:])
    datasets.DatasetDict({"test": test_split}).save_to_disk(str(saved_dict))
    res = load_records(saved_dict, adapter="math500", split="test")
    assert as_tuples(res.records) == helpers.MATH500_EXPECTED[1:]


def test_dataset_name_from_local_cache(tmp_path, cache):
    helpers.build_cached_dataset(
        cache,
        "openai/gsm8k",
        "main",
        {"train": helpers.GSM8K_ROWS, "test": helpers.GSM8K_ROWS[1:]},
        staging=tmp_path / "staging",
    )
    res = load_records(
        "openai/gsm8k", adapter="gsm8k", config="main", split="test", cache_dir=cache
    )
    assert as_tuples(res.records) == helpers.GSM8K_EXPECTED[1:]
    assert res.records[0].source == "openai/gsm8k/main[test]"
    res = load_records("openai/gsm8k", adapter="gsm8k", cache_dir=cache)
    assert as_tuples(res.records) == helpers.GSM8K_EXPECTED
    with pytest.raises(
        FileNotFoundError,
        match="'openai/not_cached' is not in the local cache and HF_HUB_OFFLINE=1",
    ):
        load_records("openai/not_cached", adapter="gsm8k", cache_dir=cache)


def test_missing_local_file_and_bad_arguments(tmp_path, cache):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_records(tmp_path / "nope.parquet", cache_dir=cache)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_records(tmp_path / "x.csv", cache_dir=cache)
    path = write_rows(helpers.GSM8K_ROWS, tmp_path / "g.jsonl")
    with pytest.raises(ValueError, match="on_bad_row"):
        load_records(path, adapter="gsm8k", on_bad_row="ignore")
    with pytest.raises(ValueError, match="adapter must be"):
        load_records(path, adapter="gsm8")
    with pytest.raises(ValueError, match="fields applies to the 'generic' adapter only"):
        load_records(path, adapter="gsm8k", fields={"prompt": "question"})
    with pytest.raises(ValueError, match="fields must map 'prompt'"):
        load_records(path, fields={"answer": "answer"})


def test_missing_column_is_a_schema_error_even_when_skipping(tmp_path, cache):
    path = write_rows([{"question": "q", "solution": "s"}], tmp_path / "g.parquet")
    for mode in ("error", "skip"):
        with pytest.raises(ValueError, match=r"g\.parquet: adapter 'gsm8k' needs column 'answer'"):
            load_records(path, adapter="gsm8k", on_bad_row=mode, cache_dir=cache)


GOOD = {"problem": "What is 2+2?", "answer": "4"}
# (row, field, kind): each is bad in exactly one way.
BAD_ROWS = [
    ({"problem": None, "answer": "4"}, "prompt", "missing"),
    ({"problem": "   ", "answer": "4"}, "prompt", "empty"),
    ({"problem": 17, "answer": "4"}, "prompt", "wrong type"),
    ({"problem": "What?", "answer": None}, "answer", "missing"),
    ({"problem": "What?", "answer": ["4"]}, "answer", "wrong type"),
    ({"problem": "What?"}, "answer", "missing"),  # key absent from this JSON line only
]


@pytest.mark.parametrize("bad, field, kind", BAD_ROWS)
def test_bad_row_error_names_file_row_and_field(tmp_path, cache, bad, field, kind):
    path = write_rows([GOOD, GOOD, bad, GOOD], tmp_path / "aime.jsonl")
    with pytest.raises(BadRowError) as info:
        load_records(path, adapter="aime", cache_dir=cache)
    err = info.value
    assert (err.source, err.row, err.field, err.kind) == (str(path), 2, field, kind)
    assert str(err).startswith(f"{path}: row 2: field '{field}' {kind}")


def test_bad_rows_skipped_and_counted(tmp_path, cache):
    rows = [GOOD] + [bad for bad, _, _ in BAD_ROWS] + [GOOD]
    path = write_rows(rows, tmp_path / "aime.jsonl")
    res = load_records(path, adapter="aime", on_bad_row="skip", cache_dir=cache)
    assert [r.row for r in res.records] == [0, len(rows) - 1]
    assert res.skipped == len(BAD_ROWS)
    assert res.skip_reasons == {
        "prompt: missing": 1,
        "prompt: empty": 1,
        "prompt: wrong type": 1,
        "answer: missing": 2,
        "answer: wrong type": 1,
    }


def test_schema_specific_bad_rows(tmp_path, cache):
    gsm = [dict(helpers.GSM8K_ROWS[0], answer="no final line")]
    with pytest.raises(BadRowError, match=r"row 0: field 'answer' invalid: .*'####"):
        load_records(write_rows(gsm, tmp_path / "g.parquet"), adapter="gsm8k", cache_dir=cache)
    eurus = [dict(r) for r in helpers.EURUS_ROWS]
    eurus[0]["reward_model"] = {"ground_truth": "{not json", "style": "rule"}
    eurus[1]["ability"] = "math"
    path = write_rows(eurus + helpers.EURUS_ROWS, tmp_path / "e.parquet")
    with pytest.raises(BadRowError, match=r"e\.parquet: row 0: field 'tests' invalid: .*not JSON"):
        load_records(path, adapter="eurus2_code", cache_dir=cache)
    res = load_records(path, adapter="eurus2_code", on_bad_row="skip", cache_dir=cache)
    assert res.skip_reasons == {"tests: invalid": 1, "ability: invalid": 1}
    assert [r.row for r in res.records] == [2, 3]
    dapo = [dict(helpers.DAPO_ROWS[0], prompt=[{"role": "assistant", "content": "x"}])]
    with pytest.raises(BadRowError, match=r"'prompt' invalid: message 0 has role 'assistant'"):
        load_records(write_rows(dapo, tmp_path / "p.jsonl"), adapter="dapo_math", cache_dir=cache)


def test_registry_and_record_defaults():
    assert sorted(ADAPTERS) == [
        "aime",
        "dapo_math",
        "deepmath",
        "eurus2_code",
        "generic",
        "gsm8k",
        "math500",
    ]
    rec = PromptRecord(prompt="p", answer=None)
    assert (rec.system, rec.tests, rec.source, rec.row, rec.extra) == (None, None, "", -1, {})


def test_numeric_answers_become_decimal_strings(tmp_path, cache):
    # A JSON column mixing ints and floats is read as float64: 204 arrives as 204.0.
    rows = [{"problem": "p1", "answer": 204}, {"problem": "p2", "answer": 2.5}]
    res = load_records(write_rows(rows, tmp_path / "a.jsonl"), adapter="aime", cache_dir=cache)
    assert [r.answer for r in res.records] == ["204", "2.5"]
    rows = [{"problem": "p1", "answer": True}]
    with pytest.raises(BadRowError, match="'answer' wrong type"):
        load_records(write_rows(rows, tmp_path / "b.jsonl"), adapter="aime", cache_dir=cache)


def test_parquet_reads_only_the_adapter_columns(tmp_path, cache):
    path = write_rows(helpers.DEEPMATH_ROWS, tmp_path / "d.parquet")
    load_records(path, adapter="deepmath", cache_dir=cache)
    cached = list(cache.rglob("*.arrow"))
    assert cached
    for file in cached:
        with pa.OSFile(str(file)) as f:
            names = pa.ipc.open_stream(f).schema.names
        assert sorted(names) == ["difficulty", "final_answer", "question", "topic"]


def test_local_loads_force_offline_mode_and_restore_it(tmp_path, cache, monkeypatch):
    # Simulate a caller whose environment is online: a local file needs no hub, and its load
    # runs offline; the caller's setting is restored after.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    seen = []
    real_load = datasets.load_dataset

    def spy(*args, **kwargs):
        seen.append(datasets.config.HF_HUB_OFFLINE)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    path = write_rows(helpers.GSM8K_ROWS, tmp_path / "g.jsonl")
    assert len(load_records(path, adapter="gsm8k", cache_dir=cache).records) == 2
    assert seen == [True]
    assert datasets.config.HF_HUB_OFFLINE is False


def test_records_are_hashable():
    a = PromptRecord(prompt="p", answer="1", extra={"k": 1})
    assert hash(a) == hash(PromptRecord(prompt="p", answer="1", extra={"k": 2}))
