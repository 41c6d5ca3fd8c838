"""Line-by-line JSONL reading with errors that name `path:lineno:`."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """Bad input data; the message starts with `path:lineno:` so it is easy to grep and fix."""


def iter_jsonl_objects(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (1-based line number, object) for every non-blank line; blank lines are skipped."""
    path = Path(path)
    try:
        fh = path.open("r", encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: dataset file not found") from None
    with fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: invalid JSON: {exc.msg} (column {exc.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def require_string(obj: dict, key: str, where: str) -> str:
    if key not in obj:
        raise DataError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def optional_number(obj: dict, key: str, where: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{where}: field {key!r} must be a finite number, got {value!r}")
    return float(value)
