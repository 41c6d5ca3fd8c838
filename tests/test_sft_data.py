"""SFT examples JSONL: the seed's two row shapes, multi-turn chats, and malformed rows as `path:lineno: reason`."""

import json

import pytest

from rollout_lib import wire
from rollout_lib.data import DataError, load_examples
from rollout_lib.data.tool_messages import template_messages

USER, ASSISTANT, SYSTEM = "user", "assistant", "system"


def msg(role, content):
    return {"role": role, "content": content}


def write(tmp_path, *lines: str):
    path = tmp_path / "examples.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_both_shapes_and_multi_turn_chats(tmp_path):
    chat = [msg(SYSTEM, "Be brief."), msg(USER, "1+1?"), msg(ASSISTANT, "2"), msg(USER, "2+2?"), msg(ASSISTANT, "4")]
    path = write(tmp_path,
                 json.dumps({"prompt": "Q", "completion": "A"}),
                 "",  # blank lines are skipped, line numbers still count them
                 json.dumps({"messages": chat, "id": "row-2"}))
    table = load_examples(path)
    assert table.schema == wire.EXAMPLES
    assert [template_messages(m) for m in table["messages"].to_pylist()] == [[msg(USER, "Q"), msg(ASSISTANT, "A")],
                                                                             chat]
    assert table["tools"].to_pylist() == [None, None]
    assert table["source_line"].to_pylist() == [1, 3]


@pytest.mark.parametrize("line, reason", [
    ('{"text": "hello"}', "unknown field(s) ['text']"),
    ("{}", "neither shape: expected 'messages' (a chat) or 'prompt' and 'completion'"),
    ('{"prompt": "Q"}', "missing field 'completion'"),
    ('{"completion": "A"}', "missing field 'prompt'"),
    ('{"prompt": "Q", "completion": 3}', "field 'completion' must be a string"),
    ('{"prompt": "Q", "completion": "A", "messages": []}', "give either 'messages' or 'prompt'/'completion'"),
    ('{"messages": []}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user", "content": "Q"}]}', "'messages' has no assistant turn to train on"),
    ('{"messages": [{"role": "user", "content": "Q"}, {"role": "system", "content": "S"},'
     ' {"role": "assistant", "content": "A"}]}', "messages[1]: a system message may only come first"),
    ('{"messages": [{"role": "robot", "content": "Q"}]}', "messages[0]: role must be one of"),
    ('{"messages": [{"role": "user", "text": "Q"}]}', "messages[0]: must be an object with exactly 'role' and"),
    ('{"messages": [{"role": "assistant", "content": null}]}', "messages[0]: content must be a string"),
    ('{"prompt": "Q", "completion": "A"', "invalid JSON"),
    ('["prompt", "completion"]', "expected a JSON object, got list"),
])
def test_malformed_rows_name_path_and_line(tmp_path, line, reason):
    path = write(tmp_path, json.dumps({"prompt": "fine", "completion": "row"}), line)
    with pytest.raises(DataError) as info:
        load_examples(path)
    assert str(info.value).startswith(f"{path}:2: ")
    assert reason in str(info.value)


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(DataError, match="no examples"):
        load_examples(write(tmp_path, ""))
    with pytest.raises(DataError, match="dataset file not found"):
        load_examples(tmp_path / "nope.jsonl")
