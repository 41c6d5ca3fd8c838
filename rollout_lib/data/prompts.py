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

import pyarrow as pa

from rollout_lib import wire
from rollout_lib.data.jsonl import DataError, iter_jsonl_objects, require_messages, require_string

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


def load_env_prompts(env) -> pa.Table:
    """The PROMPTS table of one env's source (config.rl.EnvSettings)."""
    source = env.source
    if source.type == "jsonl_path":
        return load_jsonl_prompts(source.path, env.name, env.system_prompt)
    if source.type == "reasoning_gym":
        return generate_reasoning_gym_prompts(source.dataset, source.size, source.seed, env.name, source.config,
                                              env.system_prompt)
    raise DataError(f"env {env.name!r}: unknown prompt source type {source.type!r}")


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
