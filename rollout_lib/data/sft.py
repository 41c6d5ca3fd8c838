"""SFT examples JSONL -> Arrow (wire.EXAMPLES), in either of the seed's two row shapes:

    {"prompt": "Q", "completion": "A"}                          -> [user: Q, assistant: A]
    {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}, ...]}

Beyond the seed: a conversation may hold several assistant turns (each one is trained) and a leading system
message; OpenAI tool calls (an assistant's `tool_calls`, `tool` messages) and a row's `tools` (function schemas),
as TRL's SFT data has them (data/tool_messages.py). An optional "id" is allowed (and not used), so datasets can
name their rows. Other keys are errors.
Blank lines are skipped; a malformed row (neither shape, no assistant turn, bad JSON) is an error
`path:lineno: reason`.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from rollout_lib import wire
from rollout_lib.data.jsonl import DataError, iter_jsonl_objects, require_string
from rollout_lib.data.sources import describe_columns, is_table_source, read_table, table_schema
from rollout_lib.data.tool_messages import NO_TOOLS, require_chat, require_tools

_KNOWN_KEYS = {"prompt", "completion", "messages", "tools", "id"}


def load_examples(path: str | Path) -> pa.Table:
    rows: dict[str, list] = {name: [] for name in wire.EXAMPLES.names}
    for lineno, obj in iter_jsonl_objects(path):
        where = f"{path}:{lineno}"
        rows["messages"].append(example_messages(obj, where))
        rows["tools"].append(require_tools(obj.get("tools"), where))
        rows["source_line"].append(lineno)
    if not rows["messages"]:
        raise DataError(f"{path}: no examples (the file is empty)")
    return pa.Table.from_pydict(rows, schema=wire.EXAMPLES)


def read_examples(dataset, where: str) -> pa.Table:
    """The EXAMPLES of a dataset setting (config.common.DatasetSource): a JSONL file or a table (data/sources.py).
    `where`: the setting's locator (`algorithm.sft.dataset`), which names a table's errors."""
    if not is_table_source(dataset):
        return load_examples(dataset.path)
    table = read_table(dataset, ("prompt", "completion", "messages", "tools", "id"), where)
    if "messages" not in table.column_names and not {"prompt", "completion"} <= set(table.column_names):
        present = describe_columns(table_schema(dataset, where))
        raise DataError(f"{where}: {dataset.path} has no 'messages' column and no 'prompt' + 'completion' columns "
                        f"(rollout's names; its columns: {present}); map the table's own "
                        f"with {where}.columns, e.g. columns = {{ prompt = \"question\", completion = \"answer\" }}")
    rows: dict[str, list] = {name: [] for name in wire.EXAMPLES.names}
    for index, obj in enumerate(table.to_pylist()):  # SFT sets are small: each row is checked as a JSONL line is
        # TRL's conversational prompt-completion: two message lists, one conversation.
        if isinstance(obj.get("prompt"), list) and isinstance(obj.get("completion"), list):
            obj = {"messages": obj.pop("prompt") + obj.pop("completion"), **obj}
        obj = {key: value for key, value in obj.items() if value is not None}  # a column a row leaves empty
        rows["messages"].append(example_messages(obj, f"{dataset.path}: row {index}"))
        rows["tools"].append(require_tools(obj.get("tools"), f"{dataset.path}: row {index}"))
        rows["source_line"].append(index + 1)
    if not rows["messages"]:
        raise DataError(f"{where}: {dataset.path}: no examples (the table is empty)")
    return pa.Table.from_pydict(rows, schema=wire.EXAMPLES)


def example_messages(obj: dict, where: str) -> list[dict]:
    """The conversation of one row, validated; `where` (`path:lineno`) prefixes every error."""
    unknown = sorted(set(obj) - _KNOWN_KEYS)
    if unknown:
        raise DataError(f"{where}: unknown field(s) {unknown}; an SFT row has {sorted(_KNOWN_KEYS)}")
    chat, completion = "messages" in obj, "prompt" in obj or "completion" in obj
    if chat == completion:
        raise DataError(
            f"{where}: " + ("give either 'messages' or 'prompt'/'completion', not both" if chat else
                            "neither shape: expected 'messages' (a chat) or 'prompt' and 'completion' (strings)")
        )
    if completion:
        return [{"role": "user", "content": require_string(obj, "prompt", where), **NO_TOOLS},
                {"role": "assistant", "content": require_string(obj, "completion", where), **NO_TOOLS}]

    messages = require_chat(obj, "messages", where)
    for index, message in enumerate(messages[1:], start=1):
        if message["role"] == "system":
            raise DataError(f"{where}: messages[{index}]: a system message may only come first")
    if not any(message["role"] == "assistant" for message in messages):
        raise DataError(f"{where}: 'messages' has no assistant turn to train on")
    return messages
