"""A file's digest for cache keys and identities: the one definition, on the ground floor, since both a data file
(every entry point's tasks) and a user module's source (reward functions, custom losses: reward/locate.py) are
keyed by it. It imports nothing heavy: its import closure is part of every task's code version, and the reward
functions' processes reach it too."""

from __future__ import annotations

from pathlib import Path

import blake3


def file_digest(path: str | Path) -> str:
    """blake3 of the file's bytes; "missing" when it cannot be read (whoever reads the file reports it, named)."""
    try:
        return blake3.blake3(Path(path).read_bytes()).hexdigest()
    except OSError:  # missing, a directory, unreadable
        return "missing"
