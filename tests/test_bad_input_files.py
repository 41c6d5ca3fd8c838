"""A dataset file that is not UTF-8, and a dataset path that is a directory, fail like every other bad input: one
`rollout: error:` line naming the place (`path:line:` for a bad byte, the path for a directory), exit code 2."""

from __future__ import annotations

import json

import pytest

from clirun import run_rollout
from rollout_lib.data import DataError, load_examples, load_jsonl_prompts, load_pairs, load_responses

LOADERS = (load_pairs, load_responses, load_examples, lambda path: load_jsonl_prompts(path, env="words"))
PAIR = {"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"}


def pairs_with_latin1_on(tmp_path, bad_line: int):
    """A file whose line `bad_line` has 'café' in Latin-1 (byte 0xe9), the usual way a non-UTF-8 file arrives."""
    lines = [json.dumps(PAIR).encode()] * (bad_line - 1) + [b'{"prompt": "caf\xe9", "chosen": "4", "rejected": "5"}']
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n" + json.dumps(PAIR).encode() + b"\n")
    return path


@pytest.mark.parametrize("bad_line", [2, 700])  # 700: far past the first read buffer, the line is still right
def test_invalid_utf8_names_the_file_line_and_byte(tmp_path, bad_line):
    path = pairs_with_latin1_on(tmp_path, bad_line)
    with pytest.raises(DataError) as info:
        load_pairs(path)
    assert str(info.value) == f"{path}:{bad_line}: invalid UTF-8: byte 0xe9 at byte 16 of the line"


def test_every_loader_reads_through_the_same_check(tmp_path):
    path = pairs_with_latin1_on(tmp_path, 1)  # line 1: before any loader's own row checks
    for load in LOADERS:
        with pytest.raises(DataError) as info:
            load(path)
        assert str(info.value) == f"{path}:1: invalid UTF-8: byte 0xe9 at byte 16 of the line", load


def test_a_directory_is_named_as_one(tmp_path):
    for load in LOADERS:
        with pytest.raises(DataError) as info:
            load(tmp_path)
        assert str(info.value) == f"{tmp_path}: is a directory; a dataset is one JSONL file", load


def test_the_cli_prints_one_error_line_for_each(tmp_path):
    latin1 = pairs_with_latin1_on(tmp_path, 3)
    for dataset, expected in [(latin1, f"{latin1}:3: invalid UTF-8: byte 0xe9 at byte 16 of the line"),
                              (tmp_path, f"{tmp_path}: is a directory; a dataset is one JSONL file")]:
        done = run_rollout("train", "rm", "--config", "configs/rm-tiny.toml", "--dry-run",
                           "--set", f"algorithm.rm.dataset.path={dataset}")
        assert (done.returncode, done.stdout) == (2, "")
        assert done.stderr == f"rollout: error: {expected}\n"
