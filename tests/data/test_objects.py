"""Prompt data as Python objects: Dataset, list of dicts, streams (batches, exact resume)."""

import datasets
import pytest

from delta_jax.data import BadRowError, EncodedPrompts
from delta_jax.data.objects import RowConverter, StreamPrompts, is_stream, records_from_object

ROWS = [{"prompt": f"q{i}", "answer": str(i), "level": i % 3} for i in range(10)]


def _encode(records):
    """Keeps prompts of at most 3 characters, as a max-prompt-length policy would."""
    kept = [r for r in records if len(r.prompt) <= 3]
    return EncodedPrompts([[len(r.prompt)] for r in kept], kept, len(records) - len(kept))


def _stream(data, batch=3, **kw):
    convert = RowConverter("generic", None, "train_dataset", kw.pop("on_bad_row", "error"))
    kw.setdefault("shuffle", False)
    return StreamPrompts(data, batch_size=batch, encode=_encode, convert=convert, seed=0, **kw)


def _prompts(batch):
    return [record.prompt for _, record in batch]


@pytest.mark.parametrize("make", [list, datasets.Dataset.from_list])
def test_map_style_objects_keep_the_other_columns(make):
    result = records_from_object(make(ROWS))
    assert [r.prompt for r in result.records] == [f"q{i}" for i in range(10)]
    assert [r.extra for r in result.records[:2]] == [{"level": 0}, {"level": 1}]
    assert result.records[3].answer == "3" and result.records[3].row == 3
    assert not is_stream(make(ROWS))
    assert len(records_from_object(make(ROWS), limit=4).records) == 4


def test_bad_rows_and_bad_objects():
    rows = [*ROWS[:2], {"prompt": "", "answer": "1", "level": 0}]
    with pytest.raises(BadRowError, match="train_dataset: row 2: field 'prompt' empty"):
        records_from_object(rows)
    result = records_from_object(rows, on_bad_row="skip")
    assert (len(result.records), result.skip_reasons) == (2, {"prompt: empty": 1})
    with pytest.raises(ValueError, match="no column 'answer'"):
        records_from_object([{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    with pytest.raises(TypeError, match="must be a datasets.Dataset"):
        records_from_object({"prompt": ["a"]})
    with pytest.raises(TypeError, match="row 0 is a str"):
        records_from_object(["a prompt"])


@pytest.mark.parametrize("shuffle", [False, True])
def test_stream_batches_epochs_and_exact_resume(shuffle):
    def data():
        return datasets.IterableDataset.from_generator(lambda: iter(ROWS))

    stream = _stream(data(), shuffle=shuffle)
    assert is_stream(stream.data)
    batches = [next(stream) for _ in range(5)]  # 15 prompts from 10 rows: into a second epoch
    seen = [p for b in batches for p in _prompts(b)]
    assert sorted(seen[:10]) == sorted(f"q{i}" for i in range(10))
    assert (seen[:10] == [f"q{i}" for i in range(10)]) == (not shuffle)
    assert stream.get_state() == {"stream": {"epoch": 1, "rows": 5}}
    # A fresh stream at batch 2's state continues exactly as the first one did.
    again = _stream(data(), shuffle=shuffle)
    first = _stream(data(), shuffle=shuffle)
    for _ in range(2):
        next(first)
    again.set_state(first.get_state())
    assert [_prompts(next(again)) for _ in range(3)] == [_prompts(b) for b in batches[2:]]


def test_stream_skips_dropped_prompts_and_refuses_what_it_cannot_read():
    rows = [{"prompt": "long prompt", "answer": "0"}, *ROWS[:4]]
    stream = _stream(rows, batch=2)  # a list is a sequence: not a stream, but readable as one
    assert _prompts(next(stream)) == ["q0", "q1"] and _prompts(next(stream)) == ["q2", "q3"]
    with pytest.raises(TypeError, match="an iterator can be read only once"):
        _stream(iter(ROWS))
    with pytest.raises(ValueError, match="the stream yielded no rows"):
        next(_stream(datasets.IterableDataset.from_generator(lambda: iter([]))))
    with pytest.raises(ValueError, match="a whole pass gave no usable prompt"):
        next(_stream([{"prompt": "too long", "answer": "1"}]))
    with pytest.raises(ValueError, match="not a stream's"):
        _stream(ROWS).set_state({"next_index": 3})
