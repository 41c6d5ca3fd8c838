"""What stands for a file's content in a cache key or an identity, never its path: a file's digest (a chat template, a
JSONL file), a table source's (its type, split, column mapping and its files' digests, kept in rollout's cache by
file version). A user module's source (code outside the project's code version) is identity/sources.py's
`module_source_digest`."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import blake3

from rollout_lib.data.sources import data_files, is_table_source
from rollout_lib.paths import rollout_cache_dir
from rollout_lib.store import file_content_id


def prompt_source_identity(source, where: str = "dataset") -> dict | None:
    """What an RL prompt source's data contributes: a JSONL file's content digest, a table's identity, never where
    this checkout keeps them; None for a generated source (its settings are all it is)."""
    if source.type == "jsonl_path":
        return {"type": source.type, "file": file_digest(source.path)}
    return source_identity(source, where) if is_table_source(source) else None


def source_identity(source, where: str = "dataset") -> dict:
    """What a table source contributes to a cache key or identity: its type, split, column mapping and content
    digest; never its path, so the same table moved or copied is the same data."""
    return {"type": source.type, "content": content_digest(source, where), "split": source.split,
            "columns": dict(sorted(source.columns.items()))}


def content_digest(source, where: str = "dataset") -> str:
    """blake3 over the digests of the files holding the split, in row order."""
    digest = blake3.blake3()
    for path in data_files(source, where):
        digest.update(cached_file_digest(path).encode() + b"\0")
    return digest.hexdigest()


def file_digest(path: str | Path) -> str:
    """blake3 of the file's bytes; "missing" when it cannot be read (whoever reads the file reports it, named)."""
    try:
        return blake3.blake3(Path(path).read_bytes()).hexdigest()
    except OSError:  # missing, a directory, unreadable
        return "missing"


def cached_file_digest(path: Path) -> str:
    """A file's blake3, kept in rollout's cache by (path, size, mtime) so a large set is hashed once, not at every
    plan: a rewritten file has a new mtime and is hashed again."""
    stat = path.stat()
    key = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    known = _digest_cache()
    if key not in known:
        known[key] = file_content_id(str(path))
        _save_digest_cache(known)
    return known[key]


_DIGEST_CACHE_FILE = "data-file-digests.json"


@functools.cache
def _digest_cache() -> dict[str, str]:
    try:
        return json.loads((rollout_cache_dir() / _DIGEST_CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _save_digest_cache(known: dict[str, str]) -> None:
    # Written whole and renamed: a concurrent writer loses at most an entry (hashed again), never the file.
    target = rollout_cache_dir() / _DIGEST_CACHE_FILE
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(json.dumps(known))
        staging.replace(target)
    except OSError:
        pass  # a read-only cache dir costs a rehash next time, nothing else
