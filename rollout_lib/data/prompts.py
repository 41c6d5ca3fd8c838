"""RL prompt sources -> wire.PROMPTS: JSONL files and generated reasoning-gym sets.

JSONL rows: exactly one of
    {"prompt": "text"}                                    a single user message
    {"messages": [{"role": "...", "content": "..."}, ...]} a conversation (system/user/assistant turns)
plus optional "answer" (string or number, what rule-based rewards compare with), "info" (a JSON object handed
to reward functions) and "id" (a unique example id; default `<env>/<line number>`). Blank lines are skipped;
a malformed row is a `path:lineno: reason` error.

reasoning-gym sets: `size` items of `dataset` generated with `seed`; each row's info carries what the
`reasoning_gym` reward built-in needs to call the dataset's own `score_answer` (rg_dataset, rg_entry, rg_config).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rollout_lib import wire
from rollout_lib.data.jsonl import MESSAGE_ROLES, DataError, iter_jsonl_objects, require_messages, require_string
from rollout_lib.data.sources import describe_columns, is_table_source, read_table, table_schema

_KNOWN_KEYS = {"prompt", "messages", "answer", "info", "id"}


def load_jsonl_prompts(path: str | Path, env: str, system_prompt: str | None = None) -> pa.Table:
    rows: dict[str, list] = {name: [] for name in wire.PROMPTS.names}
    seen: dict[str, int] = {}
    for lineno, obj in iter_jsonl_objects(path):
        where = f"{path}:{lineno}"
        unknown = sorted(set(obj) - _KNOWN_KEYS)
        if unknown:
            raise DataError(f"{where}: unknown field(s) {unknown}; a prompt row has {sorted(_KNOWN_KEYS)}")
        example_id = require_string(obj, "id", where) if "id" in obj else f"{env}/{lineno}"
        if example_id in seen:
            raise DataError(f"{where}: id {example_id!r} repeats line {seen[example_id]}")
        seen[example_id] = lineno
        rows["example_id"].append(example_id)
        rows["env"].append(env)
        rows["messages"].append(_with_system(_messages(obj, where), system_prompt))
        rows["answer"].append(_answer(obj, where))
        rows["info"].append(_info(obj, where))
        rows["source_line"].append(lineno)
    if not rows["example_id"]:
        raise DataError(f"{path}: no prompts (the file is empty)")
    return pa.Table.from_pydict(rows, schema=wire.PROMPTS)


def generate_reasoning_gym_prompts(dataset: str, size: int, seed: int, env: str,
                                   config: dict[str, Any] | None = None,
                                   system_prompt: str | None = None) -> pa.Table:
    import reasoning_gym

    rg_config = {**(config or {}), "size": size, "seed": seed}
    try:
        items = reasoning_gym.create_dataset(dataset, **rg_config)
    except (ValueError, TypeError, KeyError) as exc:
        raise DataError(f"reasoning-gym dataset {dataset!r} with {rg_config}: {exc}") from None
    rows: dict[str, list] = {name: [] for name in wire.PROMPTS.names}
    for index in range(size):
        # Through JSON once: tuples in metadata become lists, exactly as the scorer will read them back.
        entry = json.loads(json.dumps(items[index]))
        rows["example_id"].append(f"{env}/{index}")
        rows["env"].append(env)
        rows["messages"].append(_with_system([{"role": "user", "content": entry["question"]}], system_prompt))
        rows["answer"].append(None if entry.get("answer") is None else str(entry["answer"]))
        rows["info"].append(json.dumps({"rg_dataset": dataset, "rg_entry": entry, "rg_config": rg_config},
                                       sort_keys=True))
        rows["source_line"].append(None)
    return pa.Table.from_pydict(rows, schema=wire.PROMPTS)


def load_env_prompts(env, where: str | None = None) -> pa.Table:
    """The PROMPTS table of one env's source (config.rl.EnvSettings); `where`: the source setting's locator
    (`algorithm.rl.envs[0].source`), which names a table's errors."""
    source = env.source
    if is_table_source(source):
        return table_prompts(source, env.name, env.system_prompt, where or f"env {env.name!r}: source")
    if source.type == "jsonl_path":
        return load_jsonl_prompts(source.path, env.name, env.system_prompt)
    if source.type == "reasoning_gym":
        return generate_reasoning_gym_prompts(source.dataset, source.size, source.seed, env.name, source.config,
                                              env.system_prompt)
    raise DataError(f"env {env.name!r}: unknown prompt source type {source.type!r}")


PROMPT_COLUMNS = ("prompt", "messages", "answer", "info", "id")


def table_prompts(source, env: str, system_prompt: str | None, where: str) -> pa.Table:
    """PROMPTS from a table (data/sources.py), built column by column: a million-row prompt set never becomes a
    million Python objects. The same rows as the JSONL shape: `prompt` (text, or TRL's/verl's message list) or
    `messages`, optional `answer` (text or a number), `info` (a struct, or JSON text passed as written), `id`."""
    table = read_table(source, PROMPT_COLUMNS, where)
    names = set(table.column_names)
    if not names & {"prompt", "messages"}:
        raise DataError(f"{where}: {source.path} has no 'prompt' or 'messages' column (rollout's names; its columns: "
                        f"{describe_columns(table_schema(source, where))}); map one with {where}.columns, e.g. "
                        "columns = { prompt = \"question\" }")
    if table.num_rows == 0:
        raise DataError(f"{where}: {source.path}: no prompts (the table is empty)")
    located = {key: f"{source.path}: column {source.columns.get(key, key)!r}" for key in ("prompt", "messages")}
    if {"prompt", "messages"} <= names:  # a mixed table, as a JSONL file may be: each row fills exactly one
        messages = _mixed_messages(table, system_prompt, located, source.path)
    else:
        key = "prompt" if "prompt" in names else "messages"
        messages = _prompt_messages(table.column(key).combine_chunks(), system_prompt, located[key])
    rows = table.num_rows
    line = pa.array(np.arange(1, rows + 1, dtype=np.int64))
    return pa.Table.from_arrays([
        _example_ids(table, env, line, source.path, source.columns.get("id", "id")),
        pa.repeat(pa.scalar(env, pa.string()), rows),
        messages,
        _answers(table, source.path, source.columns.get("answer", "answer")),
        _infos(table, source.path, source.columns.get("info", "info")),
        line,
    ], schema=wire.PROMPTS)


def _prompt_messages(column: pa.Array, system_prompt: str | None, located: str) -> pa.Array:
    """PROMPTS messages from a `prompt` column: text (one user message) or a conversation (TRL's, verl's)."""
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return _user_messages(column.cast(pa.string()), system_prompt, located)
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        return _conversations(column, system_prompt, located)
    raise DataError(f"{located} holds {column.type}; a prompt is text or a list of {{role, content}} messages")


def _mixed_messages(table: pa.Table, system_prompt: str | None, located: dict[str, str], path: str) -> pa.Array:
    """Both a `prompt` and a `messages` column: each row's one that is filled, built column-wise (the other rows
    hold a stand-in that is never chosen)."""
    prompt, chat = table.column("prompt").combine_chunks(), table.column("messages").combine_chunks()
    use_prompt = pc.is_valid(prompt)
    bad = _first_row(pc.equal(use_prompt, pc.is_valid(chat)))
    if bad is not None:
        raise DataError(f"{path}: row {bad}: give exactly one of 'prompt' or 'messages'")
    stand_in = [{"role": "user", "content": "-"}]
    prompt = pc.if_else(use_prompt, prompt, pa.scalar(stand_in if pa.types.is_list(prompt.type) else "-", prompt.type))
    chat = pc.if_else(use_prompt, pa.scalar(stand_in, chat.type), chat)
    return pc.if_else(use_prompt, _prompt_messages(prompt, system_prompt, located["prompt"]),
                      _prompt_messages(chat, system_prompt, located["messages"]))


def _first_row(mask: pa.Array) -> int | None:
    """The index of the first true row of a boolean mask (nulls count as false), or None."""
    hits = np.flatnonzero(mask.fill_null(False).to_numpy(zero_copy_only=False))
    return int(hits[0]) if len(hits) else None


def _user_messages(texts: pa.StringArray, system_prompt: str | None, located: str) -> pa.Array:
    bad = _first_row(pc.or_kleene(pc.is_null(texts), pc.equal(pc.utf8_trim_whitespace(texts), "")))
    if bad is not None:
        raise DataError(f"{located}: row {bad}: the prompt is empty")
    rows = len(texts)
    if system_prompt is None:
        roles, contents, per_row = pa.repeat(pa.scalar("user"), rows), texts, 1
    else:  # [system, user] per row: the user texts interleaved with the one system text
        per_row = 2
        order = np.empty(2 * rows, dtype=np.int64)
        order[0::2], order[1::2] = 0, np.arange(1, rows + 1)
        contents = pa.concat_arrays([pa.array([system_prompt]), texts]).take(pa.array(order))
        roles = pa.array(["system", "user"]).take(pa.array(np.tile([0, 1], rows)))
    values = pa.StructArray.from_arrays([roles, contents], fields=list(wire.MESSAGE))
    return pa.ListArray.from_arrays(pa.array(np.arange(0, per_row * rows + 1, per_row, dtype=np.int32)), values)


def _conversations(column: pa.Array, system_prompt: str | None, located: str) -> pa.Array:
    """A list<struct<role, content, ...>> column as PROMPTS messages, checked as a JSONL row's are."""
    item = column.type.value_type
    if not pa.types.is_struct(item) or item.get_field_index("role") < 0 or item.get_field_index("content") < 0:
        raise DataError(f"{located} holds {column.type}; a conversation is a list of {{role, content}} messages")
    lengths = pc.list_value_length(column)
    bad = _first_row(pc.or_kleene(pc.is_null(column), pc.equal(lengths, 0)))
    if bad is not None:
        raise DataError(f"{located}: row {bad}: an empty conversation")
    column = column.cast(pa.list_(item))  # 32-bit offsets, as the wire's
    flat, offsets = column.flatten(), column.offsets.to_numpy() - column.offsets[0].as_py()
    roles, contents = flat.field("role").cast(pa.string()), flat.field("content").cast(pa.string())
    row_of = np.repeat(np.arange(len(column)), lengths.to_numpy())
    for mask, problem in ((pc.invert(pc.is_in(roles, value_set=pa.array(MESSAGE_ROLES))).fill_null(True),
                           f"a role that is not one of {list(MESSAGE_ROLES)}"),
                          (pc.is_null(contents), "a message without content")):
        at = _first_row(mask)
        if at is not None:
            raise DataError(f"{located}: row {int(row_of[at])}: {problem}")
    last = _first_row(pc.equal(roles.take(pa.array(offsets[1:] - 1)), "assistant"))
    if last is not None:
        raise DataError(f"{located}: row {last}: the last message is the assistant's; an RL prompt ends before the "
                        "completion")
    values = pa.StructArray.from_arrays([roles, contents], fields=list(wire.MESSAGE))
    messages = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)
    if system_prompt is None:
        return messages
    # Rare enough (a table of conversations and a system prompt from the config) to go row by row.
    return pa.array([_with_system(row, system_prompt) for row in messages.to_pylist()], pa.list_(wire.MESSAGE))


def _example_ids(table: pa.Table, env: str, line: pa.Array, path: str, column_name: str) -> pa.Array:
    if "id" not in table.column_names:  # `<env>/<row number>`, as a JSONL file's `<env>/<line number>`
        return pc.binary_join_element_wise(pa.scalar(f"{env}/"), line.cast(pa.string()), "")
    ids = table.column("id").combine_chunks()
    if not (pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type)):
        raise DataError(f"{path}: column {column_name!r} (id) holds {ids.type}; example ids are text")
    ids = ids.cast(pa.string())
    bad = _first_row(pc.is_null(ids))
    if bad is not None:
        raise DataError(f"{path}: column {column_name!r}: row {bad}: no id")
    if pc.count_distinct(ids).as_py() != len(ids):
        counts = pc.value_counts(ids)
        repeated = counts.filter(pc.greater(counts.field("counts"), 1))[0]["values"].as_py()
        rows = np.flatnonzero(pc.equal(ids, repeated).to_numpy(zero_copy_only=False))[:2]
        raise DataError(f"{path}: column {column_name!r}: id {repeated!r} repeats (rows {rows[0]} and {rows[1]})")
    return ids


def _answers(table: pa.Table, path: str, column_name: str) -> pa.Array:
    rows = table.num_rows
    if "answer" not in table.column_names:
        return pa.nulls(rows, pa.string())
    answers = table.column("answer").combine_chunks()
    kind = answers.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind):
        return answers.cast(pa.string())
    if pa.types.is_integer(kind):
        return answers.cast(pa.string())  # "4312", as str() of a JSON integer
    if pa.types.is_floating(kind):  # str() of each, as a JSON number is read: Arrow writes 3.0 as "3"
        values = answers.to_pylist()
        bad = next((index for index, value in enumerate(values) if value is not None and not math.isfinite(value)),
                   None)
        if bad is not None:
            raise DataError(f"{path}: column {column_name!r} (answer): row {bad}: not a finite number")
        return pa.array([None if value is None else str(value) for value in values], pa.string())
    raise DataError(f"{path}: column {column_name!r} (answer) holds {kind}; an answer is text or a number")


def _infos(table: pa.Table, path: str, column_name: str) -> pa.Array:
    if "info" not in table.column_names:
        return pa.nulls(table.num_rows, pa.string())
    infos = table.column("info").combine_chunks()
    if pa.types.is_string(infos.type) or pa.types.is_large_string(infos.type):
        return infos.cast(pa.string())  # JSON text, as the table holds it
    if pa.types.is_struct(infos.type) or pa.types.is_map(infos.type):  # row by row: a struct has no JSON kernel
        return pa.array([None if value is None else json.dumps(dict(value), sort_keys=True)
                         for value in infos.to_pylist()], pa.string())
    raise DataError(f"{path}: column {column_name!r} (info) holds {infos.type}; info is a struct or JSON text")


# --- row parts -----------------------------------------------------------------------------------------------


def _messages(obj: dict, where: str) -> list[dict]:
    if ("prompt" in obj) == ("messages" in obj):
        raise DataError(f"{where}: give exactly one of 'prompt' (a string) or 'messages' (a list)")
    if "prompt" in obj:
        text = require_string(obj, "prompt", where)
        if not text.strip():
            raise DataError(f"{where}: 'prompt' is empty")
        return [{"role": "user", "content": text}]
    out = require_messages(obj, "messages", where)
    if out[-1]["role"] == "assistant":
        raise DataError(f"{where}: the last message is the assistant's; an RL prompt ends before the completion")
    return out


def _with_system(messages: list[dict], system_prompt: str | None) -> list[dict]:
    if system_prompt is None or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def _answer(obj: dict, where: str) -> str | None:
    answer = obj.get("answer")
    if answer is None or isinstance(answer, str):
        return answer
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not math.isfinite(answer):
        raise DataError(f"{where}: 'answer' must be a string or a finite number, got {answer!r}")
    return str(answer)


def _info(obj: dict, where: str) -> str | None:
    info = obj.get("info")
    if info is None:
        return None
    if not isinstance(info, dict):
        raise DataError(f"{where}: 'info' must be a JSON object, got {type(info).__name__}")
    return json.dumps(info, sort_keys=True)
