"""Reading a W&B run file (`run-<id>.wandb`, what offline mode writes) without W&B's service: a LevelDB log of
protobuf records (W&B's own format: a 7-byte header, 32 KiB blocks, each record framed as crc32, length, type).
wandb 0.31 keeps its reader in the Go core only; a resumed offline run needs the steps an earlier attempt wrote,
and a test reads the history back."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Iterator

BLOCK = 32 * 1024
FILE_HEADER = 7  # ":W&B", magic 0xBEE1, version
RECORD_HEADER = 7  # crc32, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> Iterator[bytes]:
    """Each record's payload, in the order written (a torn record at the end of a killed run's file is dropped)."""
    data = Path(path).read_bytes()
    position, pending = FILE_HEADER, b""
    while position + RECORD_HEADER <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < RECORD_HEADER:  # a block's tail too short for a header is padding
            position += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + RECORD_HEADER])
        start = position + RECORD_HEADER
        if kind == 0 or start + length > len(data):
            return
        payload = data[start:start + length]
        position = start + length
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            yield pending + payload
            pending = b""


def history(path: str | Path) -> list[dict]:
    """The run file's history rows: {"_step": n, metric: value, ...} (values as W&B stored them, JSON-decoded)."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in _records_of(path, "history")]


def summary_updates(path: str | Path) -> list[dict]:
    """The run file's summary updates, in order: {key: value} each (JSON-decoded)."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.summary.update}
            for record in _records_of(path, "summary")]


def exit_codes(path: str | Path) -> list[int]:
    """The exit codes the run file records (one per finished attempt; 1: the run failed)."""
    return [record.exit.exit_code for record in _records_of(path, "exit")]


def _records_of(path: str | Path, kind: str) -> list:
    from wandb.proto import wandb_internal_pb2

    found = []
    for payload in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == kind:
            found.append(record)
    return found


def attempt_files(directory: Path, run_id: str) -> list[Path]:
    """The run files every earlier attempt of run `run_id` wrote under `directory`, oldest first.

    An attempt writes `wandb/offline-run-<second>-<id>/`, and wandb adds `-1`, `-2`, ... when an attempt of the same
    id started in the same second (a kill and its rerun can): those count too.
    """
    found = []
    for path in directory.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb"):
        match = re.fullmatch(rf"offline-run-(.+)-{re.escape(run_id)}(?:-(\d+))?", path.parent.name)
        if match:
            found.append(((match[1], int(match[2] or 0)), path))
    return [path for _, path in sorted(found)]


def last_step(run_files: list[Path]) -> int | None:
    """The highest step any of these run files holds (None: none)."""
    steps = [row["_step"] for path in run_files for row in history(path) if "_step" in row]
    return max(steps) if steps else None
