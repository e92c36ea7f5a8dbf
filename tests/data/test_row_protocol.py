"""A data row that breaks the protocol (not a dict, a column missing, a prompt that is empty,
of the wrong type, or not valid Unicode; a prompt too long) is skipped and counted with
``on_bad_row="skip"``, or a one-line error naming the data set, row and field with ``"error"``;
whatever passes encodes without error. Driven with generated rows (hypothesis)."""

import logging

import datasets
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delta_jax.data import BadRowError, encode_prompts
from delta_jax.data.objects import RowConverter, StreamPrompts, records_from_object
from tests.envs.helpers import word_tokenizer

TOK = word_tokenizer()
PLAIN = word_tokenizer(chat_template=None)  # a prompt's tokens are its words
GOOD = {"prompt": "w1 w2", "answer": "1"}

surrogate = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2).map(
    lambda s: "w3 " + s
)
text = st.one_of(st.text(max_size=8), surrogate, st.sampled_from(["", "  \n", "w1 w2 w3"]))
scalar = st.one_of(
    st.none(), st.integers(), st.floats(), st.binary(max_size=4), st.booleans(), text
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", 3])}, optional={"content": scalar}
)
prompt = st.one_of(
    scalar, st.lists(message, max_size=3), st.builds(dict), st.lists(scalar, max_size=2)
)
row = st.one_of(
    st.fixed_dictionaries(
        {}, optional={"prompt": prompt, "answer": scalar, "extra": scalar, 7: scalar}
    ),
    scalar,
    st.lists(scalar, max_size=2),
)


def _one_line(error):
    assert "\n" not in str(error), str(error)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(row, max_size=6))
def test_bad_rows_are_skipped_and_counted_or_a_one_line_error(rows):
    data = [GOOD, *rows]  # the columns exist: a bad row is the row's fault
    result = records_from_object(data, on_bad_row="skip")
    assert len(result.records) + result.skipped == len(data)
    assert sum(result.skip_reasons.values()) == result.skipped
    assert set(result.first_skips) == set(result.skip_reasons)
    for first in result.first_skips.values():
        _one_line(first)
        assert first.startswith("train_dataset: row ")
    for record in result.records:
        assert isinstance(record.prompt, str) and record.prompt.strip()
        record.prompt.encode("utf-8")
    enc = encode_prompts(result.records, TOK, max_prompt_length=4)
    assert len(enc.ids) + enc.dropped == len(result.records)
    try:
        strict = records_from_object(data)
    except (BadRowError, TypeError) as e:  # the first bad row, named
        assert result.skipped and str(e).startswith("train_dataset: row ")
        _one_line(e)
    else:
        assert strict.records == result.records and not result.skipped


def test_a_stream_counts_its_skips_and_logs_each_reason_once(caplog):
    rows = [
        GOOD,
        {"prompt": "", "answer": "1"},
        {"prompt": "w1 \ud800", "answer": "1"},
        {"prompt": "w1 w2 w3 w4 w5 w6 w7 w8", "answer": "1"},  # too long
        {"answer": "1"},  # no prompt column in this row
        "not a row",
        {"prompt": None, "answer": "1"},
        {"prompt": "", "answer": "1"},
        {"prompt": "w4", "answer": "2"},
        {"prompt": "w5", "answer": "3"},
    ]
    convert = RowConverter("generic", None, "train_dataset", "skip")

    def encode(records):
        return encode_prompts(records, PLAIN, max_prompt_length=6)

    stream = StreamPrompts(
        rows, batch_size=3, encode=encode, convert=convert, seed=0, shuffle=False
    )
    with caplog.at_level(logging.WARNING, "delta_jax.data.objects"):
        batch = next(stream)
    assert [r.prompt for _, r in batch] == ["w1 w2", "w4", "w5"]
    assert stream.take_skipped() == 7 and stream.take_skipped() == 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5 and all("\n" not in line for line in lines), lines
    assert lines[0].startswith("train_dataset: row 1: field 'prompt' empty: column 'prompt' is")
    assert "row 2: field 'prompt' invalid: column 'prompt' is not valid Unicode" in lines[1]
    assert "row 3: the prompt is longer than the maximum prompt length" in lines[2]
    assert "row 4: field 'prompt' missing: no column 'prompt'" in lines[3]
    assert "row 5: field 'row' wrong type: a str" in lines[4]
    assert all("counted in data/skipped" in line for line in lines)


@pytest.mark.parametrize(
    "make",
    [
        list,
        datasets.Dataset.from_list,
        lambda rows: StreamPrompts(
            datasets.IterableDataset.from_generator(lambda: iter(rows)),
            batch_size=1, encode=None, seed=0, shuffle=False,
            convert=RowConverter("generic", None, "train_dataset", "skip"),
        ),
    ],
    ids=["list", "Dataset", "stream"],
)  # fmt: skip
def test_a_column_that_no_row_has_is_a_start_up_error(make):
    rows = [{"question": "w1", "answer": "1"}, {"question": "w2", "answer": "2"}]
    with pytest.raises(ValueError, match="train_dataset: adapter 'generic' needs column 'prompt'"):
        data = make(rows)
        if not isinstance(data, StreamPrompts):
            records_from_object(data, on_bad_row="skip")


def test_a_column_some_rows_lack_is_their_fault_not_the_schemas():
    rows = [{"answer": "0"}, GOOD, {"prompt": "w3"}]
    result = records_from_object(rows, on_bad_row="skip")
    assert [r.prompt for r in result.records] == ["w1 w2"]
    assert result.skip_reasons == {"prompt: missing": 1, "answer: missing": 1}
    with pytest.raises(BadRowError, match="^train_dataset: row 0: field 'prompt' missing"):
        records_from_object(rows)
