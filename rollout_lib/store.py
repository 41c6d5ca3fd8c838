"""Content-addressed object store on any fsspec filesystem (local directory, ``memory://``, ``s3://``).

Layout under ``<root>``:

* ``objects/<first two hex>/<blake3 hex>``: immutable objects, named by the blake3 of their bytes;
* ``refs/<name>``: small mutable pointers (an object id and a newline), e.g. ``refs/runs/rm-default/latest``;
  ``refs/chains/...`` is an index of checkpoints by training chain and step, a cache (``rollout gc`` may drop it);
* ``tmp/<uuid>``: staging area for atomic writes on local disks;
* ``prefect-results/<cache key>``: the Prefect task results of runs on this store (written by Prefect, see
  ``flows/common.py``), so that wiping a store also wipes the cache entries that point into it.

Writes are atomic, durable on local disks (the file, then its directory, are fsynced around the rename) and
idempotent; every read re-hashes the bytes, so corruption fails loudly, naming the object. A put of an object
that is already stored checks the stored copy and rewrites it when it is not intact, so putting the true content
repairs a corrupt object: on a local disk the stored file is re-hashed (from the page cache: ~50 ms per 256 MB);
on a remote store its size is compared (one HEAD) and objects up to 16 MiB are re-hashed (one GET), while a
larger one with the right size is taken as intact, to keep a checkpoint put from downloading the checkpoint.

A run name belongs to one training identity: ``refs/runs/<name>/identity`` points at a record of the identity
that claimed the name (rollout_lib/identity/claims.py), written with :meth:`ObjectStore.create_ref`, which never
overwrites.

Tensors are stored as safetensors (store_tensors.py) and tables as Arrow IPC streams: nothing in the store is ever
unpickled. Its errors: store_errors.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import blake3
import fsspec
import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem

from rollout_lib import wire
from rollout_lib.store_errors import CorruptObjectError, ObjectNotFoundError, StoreError
from rollout_lib.store_tensors import TensorObjects

# A content id: the blake3 of an object's bytes in hex. The one place its shape is written down.
CONTENT_ID_PATTERN = "[0-9a-f]{64}"
_ID_RE = re.compile(CONTENT_ID_PATTERN)


def is_content_id(text: object) -> bool:
    """Whether `text` has the shape of a content id (a checkpoint id, an object id)."""
    return isinstance(text, str) and _ID_RE.fullmatch(text) is not None
_REF_SEGMENT_RE = re.compile(r"[A-Za-z0-9_.\-]+")
_PARALLEL_HASH_BYTES = 1 << 20  # above this, blake3's multithreading pays for itself (large weight files)
_REMOTE_REVERIFY_MAX_BYTES = 16 << 20  # a remote object this small is re-read on put; a larger one is size-checked

RESULTS_DIR = "prefect-results"  # Prefect task results of runs on this store, beside the objects they name
# refs/chains/... index checkpoints by training chain and step (trainer/segment.chain_ref), so that a run reuses
# finished steps: a cache like prefect-results/, not a pointer anyone keeps; `rollout gc` treats it so.
CHAIN_INDEX_REFS = "chains/"


@dataclass(frozen=True)
class StoredFile:
    """A file in the store, as listed: its name under the root (``objects/ab/ab12...``), its path on
    ``store.fs``, its size and its modification time (POSIX seconds; None where the filesystem gives none)."""

    name: str
    path: str
    size: int
    modified: float | None


def content_id(data: bytes) -> str:
    """The blake3 hex digest of ``data``: the id of an object with these bytes."""
    threads = blake3.blake3.AUTO if len(data) >= _PARALLEL_HASH_BYTES else 1
    return blake3.blake3(data, max_threads=threads).hexdigest()


def file_content_id(path: str) -> str:
    """The id of a local file's bytes, hashed where they lie (mmap, all cores): also a large file's digest."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    hasher.update_mmap(path)
    return hasher.hexdigest()


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs_durably(directory: str) -> None:
    """``os.makedirs``, with each new directory's entry fsynced in its parent (a new shard or run directory would
    otherwise vanish in a crash, with the files renamed into it)."""
    if os.path.isdir(directory):
        return
    parent = os.path.dirname(directory)
    _make_dirs_durably(parent)
    try:
        os.mkdir(directory)
    except FileExistsError:
        return
    _fsync_dir(parent)


def _modified_seconds(info: dict) -> float | None:
    """A listing entry's modification time: ``mtime`` (local), ``LastModified`` (s3), ``created`` (memory)."""
    for key in ("mtime", "LastModified", "created"):
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
    return None


def canonical_json(obj: Any) -> bytes:
    """One byte string per JSON value: sorted keys, no whitespace, UTF-8, and no NaN/Infinity."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _check_id(object_id: str) -> str:
    if not isinstance(object_id, str) or not _ID_RE.fullmatch(object_id):
        raise StoreError(f"invalid object id {object_id!r}: expected 64 lowercase hex characters")
    return object_id


def _check_ref_name(name: str) -> str:
    segments = name.split("/") if isinstance(name, str) else []
    if not segments or any(not _REF_SEGMENT_RE.fullmatch(s) or s in (".", "..") for s in segments):
        raise StoreError(
            f"invalid ref name {name!r}: expected '/'-separated segments of letters, digits, '_', '-', '.' "
            "(no leading '/', no '.' or '..' segments)"
        )
    return name


def is_process_local(root: str) -> bool:
    """A store only this process can read (fsspec's in-memory filesystem, ``memory://``): no other process, node
    or server finds anything in it."""
    return fsspec.core.split_protocol(os.fspath(root))[0] == "memory"


class ObjectStore(TensorObjects):
    """A content-addressed store rooted at a local path or fsspec URL."""

    def __init__(self, root: str, storage_options: dict | None = None):
        self.storage_options = dict(storage_options or {})
        self.fs, path = fsspec.core.url_to_fs(os.fspath(root), **self.storage_options)
        self._local = isinstance(self.fs, LocalFileSystem)
        self._base = path.rstrip("/") or path  # fsspec path: no protocol; absolute for local
        self.root = self._base if self._local else self.fs.unstrip_protocol(self._base)

    def __repr__(self) -> str:
        return f"ObjectStore({self.root!r})"

    # --- paths -----------------------------------------------------------------------------------------------

    def object_path(self, object_id: str) -> str:
        """``<root>/objects/<first two hex>/<hex>``."""
        _check_id(object_id)
        return f"{self.root}/objects/{object_id[:2]}/{object_id}"

    def _object_fspath(self, object_id: str) -> str:
        _check_id(object_id)
        return f"{self._base}/objects/{object_id[:2]}/{object_id}"

    def _holds_intact(self, path: str, object_id: str, size: int) -> bool:
        """Whether ``path`` already holds the object's true bytes, so that a put may skip writing them (the
        module docstring says how much is checked where)."""
        self.fs.invalidate_cache(path)
        try:
            if self.fs.size(path) != size:
                return False
            if self._local:
                if file_content_id(path) != object_id:
                    return False
                os.utime(path)  # a re-put object counts as new for `rollout gc`'s grace period
                return True
            return size > _REMOTE_REVERIFY_MAX_BYTES or content_id(self.fs.cat_file(path)) == object_id
        except FileNotFoundError:  # absent, or removed (by gc) while we looked
            return False

    def _write_atomic(self, path: str, data: bytes) -> None:
        """Make ``path`` hold exactly ``data``, never visible half-written."""
        if not self._local:
            # A single PUT on s3 (or a dict assignment in memory://) is already all-or-nothing.
            self.fs.pipe_file(path, data)
            return
        with self._staged() as tmp:
            with open(tmp, "wb") as f:
                f.write(data)
            self._commit_local(tmp, path)

    @contextlib.contextmanager
    def _staged(self) -> Iterator[str]:
        """A staging file's path (under ``tmp/`` on a local store, else the system's), removed on exit unless it
        was moved into place."""
        if self._local:
            os.makedirs(f"{self._base}/tmp", exist_ok=True)
            tmp = f"{self._base}/tmp/{uuid.uuid4().hex}"
        else:
            with tempfile.NamedTemporaryFile(prefix="rollout-tensors-", delete=False) as staging:
                tmp = staging.name
        try:
            yield tmp
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @staticmethod
    def _commit_local(tmp: str, path: str) -> None:
        """Move a fully written staging file to its final path, durably."""
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # the bytes must be on disk before the name points at them
        directory = os.path.dirname(path)
        _make_dirs_durably(directory)
        os.replace(tmp, path)  # atomic within one filesystem, which tmp/, objects/ and refs/ share
        _fsync_dir(directory)  # and the name itself must survive a crash, or the object (or ref) is lost

    # --- bytes -----------------------------------------------------------------------------------------------

    def put_bytes(self, data: bytes) -> str:
        """Store ``data`` and return its id; no write when the object is already stored intact, a repair when
        its stored copy is not."""
        data = bytes(data)
        object_id = content_id(data)
        path = self._object_fspath(object_id)
        if not self._holds_intact(path, object_id, len(data)):
            self._write_atomic(path, data)
        return object_id

    def get_bytes(self, object_id: str) -> bytes:
        """The bytes of an object, after checking that they still hash to its id."""
        path = self._object_fspath(object_id)
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            raise ObjectNotFoundError(f"object {object_id} not found in store {self.root}") from None
        actual = content_id(data)
        if actual != object_id:
            raise CorruptObjectError(f"object {object_id} in {self.root} is corrupted: content hash is {actual}")
        return data

    def has(self, object_id: str) -> bool:
        """Whether the object is stored (its content is not checked)."""
        path = self._object_fspath(object_id)
        self.fs.invalidate_cache(path)  # s3fs caches listings; another process may have written it since
        return self.fs.exists(path)

    # --- JSON ------------------------------------------------------------------------------------------------

    def put_json(self, obj: Any) -> str:
        return self.put_bytes(canonical_json(obj))

    def get_json(self, object_id: str) -> Any:
        return json.loads(self.get_bytes(object_id))

    # --- Arrow tables ----------------------------------------------------------------------------------------

    def put_table(self, table: pa.Table) -> str:
        """Store a table as an Arrow IPC stream; equal tables (and schemas) give equal bytes and ids."""
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            # One batch per table, whatever its chunking, so that the bytes depend only on the content.
            writer.write_table(table.combine_chunks())
        return self.put_bytes(sink.getvalue().to_pybytes())

    def get_table(self, object_id: str, schema: pa.Schema | None = None) -> pa.Table:
        """Read a table; with ``schema``, conform it to that wire schema (ValueError if it cannot)."""
        table = pa.ipc.open_stream(pa.py_buffer(self.get_bytes(object_id))).read_all()
        if schema is None:
            return table
        try:
            return wire.conform(table, schema)
        except ValueError as exc:
            raise ValueError(f"table {object_id} in {self.root}: {exc}") from exc

    def _put_staged_file(self, tmp: str) -> str:
        """Store a complete staging file's bytes; their id. Local stores hash it where it lies and move it into
        place (no in-memory copy); others read it and upload."""
        if not self._local:
            with open(tmp, "rb") as f:
                return self.put_bytes(f.read())
        object_id = file_content_id(tmp)
        path = self._object_fspath(object_id)
        if not self._holds_intact(path, object_id, os.path.getsize(tmp)):
            self._commit_local(tmp, path)
        return object_id

    # --- refs ------------------------------------------------------------------------------------------------

    def set_ref(self, name: str, object_id: str) -> None:
        """Point ``refs/<name>`` at an object, which must already be stored (refs are written last)."""
        path = f"{self._base}/refs/{_check_ref_name(name)}"
        if not self.has(object_id):
            raise ObjectNotFoundError(f"cannot point ref {name!r} at object {object_id}: not in store {self.root}")
        self._write_atomic(path, f"{object_id}\n".encode())

    def get_ref(self, name: str) -> str | None:
        """The object id ``refs/<name>`` points at, or None if the ref does not exist."""
        path = f"{self._base}/refs/{_check_ref_name(name)}"
        try:
            text = self.fs.cat_file(path).decode().strip()
        except FileNotFoundError:
            return None
        try:
            return _check_id(text)
        except StoreError:
            raise StoreError(f"ref {name!r} in {self.root} holds {text!r}, not an object id") from None

    def create_ref(self, name: str, object_id: str) -> bool:
        """Write a ref that must not exist yet; False when it does (exclusive on local disks only)."""
        path = f"{self._base}/refs/{name}"
        if not self._local:
            self._write_atomic(path, f"{object_id}\n".encode())
            return True
        with self._staged() as tmp:
            with open(tmp, "wb") as f:
                f.write(f"{object_id}\n".encode())
                f.flush()
                os.fsync(f.fileno())
            _make_dirs_durably(os.path.dirname(path))
            try:
                os.link(tmp, path)  # unlike a rename, fails when the name exists
            except FileExistsError:
                return False
            _fsync_dir(os.path.dirname(path))
            return True

    # --- listing (for `rollout gc`) --------------------------------------------------------------------------

    def exists(self) -> bool:
        """Whether anything is stored under the root."""
        self.fs.invalidate_cache(self._base)
        return self.fs.exists(self._base)

    def list_objects(self) -> dict[str, StoredFile]:
        """Every stored object, by id (one listing; contents are not read)."""
        objects = {}
        for stored in self.list_files("objects"):
            object_id = stored.name.rsplit("/", 1)[-1]
            if _ID_RE.fullmatch(object_id) and stored.name == f"objects/{object_id[:2]}/{object_id}":
                objects[object_id] = stored
        return objects

    def list_refs(self) -> dict[StoredFile, str]:
        """Every ref: its file (``refs/<name>``) -> the object id it points at."""
        refs = {}
        for stored in self.list_files("refs"):
            object_id = self.get_ref(stored.name.removeprefix("refs/"))
            if object_id is not None:  # None: removed since the listing
                refs[stored] = object_id
        return refs

    def put_transfer_file(self, name: str, local_path: str | os.PathLike) -> str:
        """Copy a local file to ``<root>/transfer/<name>``, replacing what was there whole (a reader sees the old
        file or the new one, never half of one), and return its URL. ``transfer/`` holds what is shipped, not
        kept: a policy state for a policy server on another node (serving/store_fetch.py), rewritten each step
        and removed by its writer; it holds no object a ref reaches."""
        path = f"{self._base}/transfer/{name}"
        if self._local:
            with self._staged() as tmp:  # no fsync: what is shipped need only never be seen half-written
                shutil.copyfile(local_path, tmp)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.replace(tmp, path)
        else:  # one PUT is all-or-nothing
            self.fs.put_file(str(local_path), path)
        self.fs.invalidate_cache(path)
        return f"{self.root}/transfer/{name}"

    def remove_transfer(self, name: str) -> None:
        """Remove ``<root>/transfer/<name>`` (a file or a directory) if there is one."""
        path = f"{self._base}/transfer/{name}"
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)
        self.fs.invalidate_cache(path)

    def list_files(self, area: str) -> list[StoredFile]:
        """The files under ``<root>/<area>`` (``objects``, ``refs``, ``tmp``, ``prefect-results``), by name."""
        directory = f"{self._base}/{area}"
        self.fs.invalidate_cache(directory)
        root = self.fs._strip_protocol(self._base).rstrip("/") + "/"
        files = []
        for path, info in self.fs.find(directory, detail=True).items():
            if info.get("type") == "file":
                name = self.fs._strip_protocol(path).removeprefix(root)
                files.append(StoredFile(name, path, int(info.get("size") or 0), _modified_seconds(info)))
        return sorted(files, key=lambda stored: stored.name)

    def delete_file(self, stored: StoredFile) -> None:
        """Remove a listed file (``rollout gc``); one already gone is fine."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(stored.path)
        self.fs.invalidate_cache(stored.path)
