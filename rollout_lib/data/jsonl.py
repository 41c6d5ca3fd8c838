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
        fh = path.open("rb")  # bytes, decoded line by line: a bad byte is reported on its own line
    except FileNotFoundError:
        raise DataError(f"{path}: dataset file not found") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory; a dataset is one JSONL file") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read the dataset file: {exc.strerror}") from None
    with fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{lineno}: invalid UTF-8: byte {raw[exc.start]:#04x} at byte "
                                f"{exc.start + 1} of the line") from None
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


MESSAGE_ROLES = ("system", "user", "assistant", "tool")


def require_messages(obj: dict, key: str, where: str) -> list[dict[str, str]]:
    """A non-empty list of {"role", "content"} objects (exactly those keys, a known role, string content)."""
    messages = obj.get(key)
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {key!r} must be a non-empty list of {{role, content}} objects")
    out = []
    for index, message in enumerate(messages):
        at = f"{where}: {key}[{index}]"
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise DataError(f"{at}: must be an object with exactly 'role' and 'content'")
        role, content = message["role"], message["content"]
        if role not in MESSAGE_ROLES:
            raise DataError(f"{at}: role must be one of {list(MESSAGE_ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise DataError(f"{at}: content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out
