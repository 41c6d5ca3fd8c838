"""Preference pairs JSONL -> Arrow (wire.PAIRS): {"prompt", "chosen", "rejected"} plus an optional "margin"."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa

from rollout_lib import wire
from rollout_lib.data.jsonl import DataError, iter_jsonl_objects, optional_number, require_string
from rollout_lib.data.sources import describe_columns, is_table_source, read_table, table_schema

PAIR_FIELDS = ("prompt", "chosen", "rejected")


def load_pairs(path: str | Path) -> pa.Table:
    table = _pairs_table((f"{path}:{lineno}", lineno, obj) for lineno, obj in iter_jsonl_objects(path))
    if table.num_rows == 0:
        raise DataError(f"{path}: no preference pairs (the file is empty)")
    return table


def _pairs_table(numbered: Iterable[tuple[str, int, dict]]) -> pa.Table:
    """PAIRS from (where, source line, object) triples, each object checked, `where` naming it in errors."""
    rows = {name: [] for name in wire.PAIRS.names}
    for where, line, obj in numbered:
        for key in PAIR_FIELDS:
            rows[key].append(require_string(obj, key, where))
        rows["margin"].append(optional_number(obj, "margin", where))
        rows["source_line"].append(line)
    return pa.Table.from_pydict(rows, schema=wire.PAIRS)


def read_pairs(dataset, where: str) -> pa.Table:
    """The PAIRS of a dataset setting (config.common.DatasetSource): a JSONL file or a table with TRL's explicit-
    prompt preference columns (data/sources.py). `where`: the setting's locator (`algorithm.rm.dataset`)."""
    if not is_table_source(dataset):
        return load_pairs(dataset.path)
    table = read_table(dataset, (*PAIR_FIELDS, "margin"), where)
    missing = [key for key in PAIR_FIELDS if key not in table.column_names]
    if missing:
        present = describe_columns(table_schema(dataset, where))
        raise DataError(f"{where}: {dataset.path} has no {', '.join(repr(key) for key in missing)} column (rollout's "
                        f"names; its columns: {present}); map the table's own with {where}.columns, e.g. "
                        "columns = { prompt = \"question\" }")
    for key in PAIR_FIELDS:  # TRL's conversational pairs are message lists; the reward model here scores text
        if not pa.types.is_string(table.column(key).type) and not pa.types.is_large_string(table.column(key).type):
            raise DataError(f"{where}: {dataset.path}: column {dataset.columns.get(key, key)!r} ({key}) holds "
                            f"{table.column(key).type}, not text: rollout's reward model reads prompt, chosen and "
                            "rejected as strings (conversational pairs are not supported)")
    pairs = _pairs_table((f"{dataset.path}: row {index}", index + 1, obj)
                         for index, obj in enumerate(table.to_pylist()))
    if pairs.num_rows == 0:
        raise DataError(f"{where}: {dataset.path}: no preference pairs (the table is empty)")
    return pairs


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
