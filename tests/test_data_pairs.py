"""Pairs JSONL -> Arrow, with `path:lineno:` errors, as the RM seed specifies."""

import pytest

from rollout_lib import wire
from rollout_lib.data import DataError, load_pairs, load_responses


def write(tmp_path, text, name="pairs.jsonl"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_seed_example_loads_with_declared_schema(tmp_path):
    path = write(tmp_path, '{"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"}\n\n'
                           '{"prompt": "Capital of France?", "chosen": "Paris", "rejected": "London", "margin": 2}\n')
    table = load_pairs(path)
    assert table.schema.equals(wire.PAIRS)
    assert table.column("prompt").to_pylist() == ["What is 2+2?", "Capital of France?"]
    assert table.column("margin").to_pylist() == [None, 2.0]
    assert table.column("source_line").to_pylist() == [1, 3]  # the blank line 2 is skipped


@pytest.mark.parametrize(
    "line, reason",
    [
        ('{"prompt": "p", "chosen": "c"}', "missing field 'rejected'"),
        ('{"prompt": "p", "chosen": "c", "rejected": 5}', "field 'rejected' must be a string"),
        ('{"prompt": "p", "chosen": "c", "rejected": "r", "margin": "big"}', "field 'margin' must be a finite number"),
        ('{"prompt": "p", "chosen": "c", "rejected": "r"', "invalid JSON"),
        ('["p", "c", "r"]', "expected a JSON object"),
    ],
)
def test_malformed_row_is_an_error_naming_file_and_line(tmp_path, line, reason):
    path = write(tmp_path, '{"prompt": "a", "chosen": "b", "rejected": "c"}\n' + line + "\n")
    with pytest.raises(DataError) as info:
        load_pairs(path)
    assert str(info.value).startswith(f"{path}:2: ")
    assert reason in str(info.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="dataset file not found"):
        load_pairs(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no preference pairs"):
        load_pairs(write(tmp_path, "\n\n"))


def test_responses_for_scoring(tmp_path):
    table = load_responses(write(tmp_path, '{"prompt": "q", "response": "a"}\n'))
    assert table.to_pylist() == [{"prompt": "q", "response": "a", "source_line": 1}]
    with pytest.raises(DataError, match=r":1: missing field 'response'"):
        load_responses(write(tmp_path, '{"prompt": "q"}\n', "bad.jsonl"))
