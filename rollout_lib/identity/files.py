"""A data file's digest for cache keys (a module of its own: every entry point's tasks read it, and its import closure,
their code version, stays this file)."""

from __future__ import annotations

from pathlib import Path

import blake3


def file_digest(path: str | Path) -> str:
    """blake3 of the file's bytes; "missing" when it cannot be read (the task itself then reports the file, named)."""
    try:
        return blake3.blake3(Path(path).read_bytes()).hexdigest()
    except OSError:  # missing, a directory, unreadable
        return "missing"
