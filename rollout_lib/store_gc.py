"""Garbage collection of a store (`rollout gc`): delete the objects no ref reaches, and the cached task results that
name them.

Kept are the roots and every object they reach:

* the object of every ref (`runs/<name>/latest`, `runs/<name>/identity`, ...) but the chain index
  (`refs/chains/...`), which is a cache of finished steps: an index entry whose checkpoint goes, goes with it;
* every object modified within the grace period (default 24 h), for a running flow, which sets its ref only at
  its end (a local put of an object already stored refreshes its modification time). Where the filesystem gives
  no modification time, the object counts as new;
* every object named by a task result (`prefect-results/`) or a chain index entry written within the grace
  period: a task that just finished may have returned an object stored long ago.

An object reaches the objects it names: objects are content-addressed, so any 64-hex string inside a JSON object
that is the id of a stored object counts (a checkpoint manifest names its weights, optimizer state, model config,
tokenizer files, parent and data tables; an RL pending-step record its micro-batches and parent). Safetensors and
Arrow objects name nothing and are never read whole.

A cached task result (or chain index entry) that names an object gc deletes is deleted with it, and first:
otherwise a rerun would come back `Cached` with ids whose objects are gone; this way the rerun recomputes them.
Staging files in `tmp/` older than the grace period are leftovers of killed writers and go too.

Not covered: a flow that resumes, while gc runs, from cache entries older than the grace period whose objects no
ref reaches (a run that crashed long ago) can lose them under its feet. It then fails naming the missing object,
and its rerun recomputes them. Run gc between runs, or keep the grace period longer than a run.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

from rollout_lib.store import CHAIN_INDEX_REFS, CONTENT_ID_PATTERN, RESULTS_DIR, ObjectStore, StoredFile, StoreError

DEFAULT_GRACE_HOURS = 24.0

_NAMED_ID_RE = re.compile(rb"(?<![0-9a-f])" + CONTENT_ID_PATTERN.encode() + rb"(?![0-9a-f])")
_JSON_SNIFF_BYTES = 16


@dataclass(frozen=True)
class GcPlan:
    """What a collection deletes, in the order it deletes it, and what it keeps."""

    results: list[StoredFile]  # cached task results naming a deleted object: deleted first
    index_refs: list[StoredFile]  # chain index entries pointing at a deleted checkpoint: deleted first too
    objects: list[StoredFile]
    staging: list[StoredFile]
    kept_objects: int
    kept_for_grace: int  # of the kept objects, those no ref reaches: new, or named by a new cache entry
    refs: int  # the refs that keep objects (the chain index does not)

    @property
    def files(self) -> list[StoredFile]:
        return [*self.results, *self.index_refs, *self.objects, *self.staging]

    @property
    def bytes(self) -> int:
        return sum(stored.size for stored in self.files)


def plan_gc(store: ObjectStore, grace_seconds: float = DEFAULT_GRACE_HOURS * 3600,
            now: float | None = None) -> GcPlan:
    """Decide what a collection of ``store`` deletes; nothing is deleted."""
    if not store.exists():
        raise StoreError(f"no store at {store.root}")
    cutoff = (time.time() if now is None else now) - grace_seconds

    def is_new(stored: StoredFile) -> bool:
        return stored.modified is None or stored.modified >= cutoff

    objects = store.list_objects()
    refs = store.list_refs()
    index_refs = {stored: refs.pop(stored) for stored in list(refs)
                  if stored.name.startswith(f"refs/{CHAIN_INDEX_REFS}")}
    results = {stored: _named_ids(_read(store, stored)) & objects.keys() for stored in store.list_files(RESULTS_DIR)}

    reached = _reach(store, objects, refs.values(), set())
    reached_from_refs = len(reached)
    grace_roots = {object_id for object_id, stored in objects.items() if is_new(stored)}
    grace_roots.update(*(named for stored, named in results.items() if is_new(stored)))
    grace_roots.update(object_id for stored, object_id in index_refs.items() if is_new(stored))
    _reach(store, objects, grace_roots, reached)

    doomed = objects.keys() - reached
    return GcPlan(
        results=[stored for stored, named in results.items() if named & doomed],
        index_refs=[stored for stored, object_id in index_refs.items() if object_id in doomed],
        objects=sorted((objects[object_id] for object_id in doomed), key=lambda stored: stored.name),
        staging=[stored for stored in store.list_files("tmp") if not is_new(stored)],
        kept_objects=len(reached),
        kept_for_grace=len(reached) - reached_from_refs,
        refs=len(refs),
    )


def collect_garbage(store: ObjectStore, plan: GcPlan) -> None:
    """Delete what ``plan`` says, cache and index entries before the objects they name: a collection cut short
    never leaves an entry naming a deleted object."""
    for stored in plan.files:
        store.delete_file(stored)


def _reach(store: ObjectStore, objects: dict[str, StoredFile], roots: Iterable[str], reached: set[str]) -> set[str]:
    """Add to ``reached`` every stored object reachable from ``roots`` (ids not stored are skipped)."""
    pending = [object_id for object_id in roots if object_id in objects and object_id not in reached]
    reached.update(pending)
    while pending:
        stored = objects[pending.pop()]
        for named in _named_ids(_json_bytes(store, stored)) & objects.keys():
            if named not in reached:
                reached.add(named)
                pending.append(named)
    return reached


def _json_bytes(store: ObjectStore, stored: StoredFile) -> bytes:
    """The object's bytes when it looks like JSON (a weight file is never read whole), else b""."""
    return _read(store, stored) if _looks_like_json(_read(store, stored, _JSON_SNIFF_BYTES)) else b""


def _read(store: ObjectStore, stored: StoredFile, length: int | None = None) -> bytes:
    try:
        return store.fs.cat_file(stored.path, start=0 if length else None, end=length)
    except FileNotFoundError:  # deleted since the listing (another gc)
        return b""


def _looks_like_json(head: bytes) -> bool:
    """JSON starts with an object or array and has no control bytes; safetensors starts with a little-endian
    header length (zero bytes), Arrow IPC streams with 0xFFFFFFFF."""
    text = head.lstrip(b" \t\r\n")
    return text[:1] in (b"{", b"[") and all(byte >= 0x20 or byte in b"\t\r\n" for byte in head)


def _named_ids(data: bytes) -> set[str]:
    """Every 64-hex string in ``data`` (in a task result, ids sit inside the JSON-encoded result string)."""
    return {match.decode() for match in _NAMED_ID_RE.findall(data)}
