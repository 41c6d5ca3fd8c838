"""Preference pairs JSONL -> Arrow (wire.PAIRS): {"prompt", "chosen", "rejected"} plus an optional "margin"."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from rollout_lib import wire
from rollout_lib.data.jsonl import DataError, iter_jsonl_objects, optional_number, require_string

PAIR_FIELDS = ("prompt", "chosen", "rejected")


def load_pairs(path: str | Path) -> pa.Table:
    rows = {name: [] for name in wire.PAIRS.names}
    for lineno, obj in iter_jsonl_objects(path):
        where = f"{path}:{lineno}"
        for key in PAIR_FIELDS:
            rows[key].append(require_string(obj, key, where))
        rows["margin"].append(optional_number(obj, "margin", where))
        rows["source_line"].append(lineno)
    if not rows["prompt"]:
        raise DataError(f"{path}: no preference pairs (the file is empty)")
    return pa.Table.from_pydict(rows, schema=wire.PAIRS)


def load_responses(path: str | Path) -> pa.Table:
    """(prompt, response) rows to score with a reward model (wire.RESPONSES)."""
    rows = {name: [] for name in wire.RESPONSES.names}
    for lineno, obj in iter_jsonl_objects(path):
        where = f"{path}:{lineno}"
        rows["prompt"].append(require_string(obj, "prompt", where))
        rows["response"].append(require_string(obj, "response", where))
        rows["source_line"].append(lineno)
    if not rows["prompt"]:
        raise DataError(f"{path}: no rows to score (the file is empty)")
    return pa.Table.from_pydict(rows, schema=wire.RESPONSES)
