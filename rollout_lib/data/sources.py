"""Data sources beside JSONL: parquet files, Arrow files and `save_to_disk` folders (config.common.TableDataset),
read offline into Arrow (their content digest, which stands for them in cache keys and identities: identity/digests.py).

Nothing here turns rows into Python objects: parquet is decoded column by column into Arrow buffers (only the
columns rollout reads), Arrow files and `save_to_disk` folders are memory-mapped. What a loader does with the table
is its own business (SFT and RM tables are small and checked row by row; RL prompt sets can be large and are
built column-wise, rollout_lib/data/prompts.py).

Errors are DataErrors naming the config's locator (`algorithm.rl.envs[0].source.columns.prompt`), the path and
what to do: a dataset has no line numbers.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rollout_lib.data.jsonl import DataError
from rollout_lib.paths import rollout_cache_dir

TABLE_TYPES = frozenset({"parquet", "arrow", "hf_disk"})
DATASETS_EXTRA = "pip install -e '.[datasets]' (scripts/setup.sh installs it)"
_SUFFIX = {"parquet": ".parquet", "arrow": ".arrow"}
# The hub's sharded file names: `data/train-00000-of-00003.parquet` is split "train".
_SHARD = re.compile(r"(.+?)-\d+-of-\d+$")


def is_table_source(source) -> bool:
    return getattr(source, "type", None) in TABLE_TYPES


# --- reading ---------------------------------------------------------------------------------------------------


def read_table(source, reads: tuple[str, ...], where: str) -> pa.Table:
    """The source's rows with rollout's columns `reads` that the table has, renamed from the table's names by
    `source.columns` (a dotted name reaches into a struct column: verl's `reward_model.ground_truth`); the
    table's other columns are not read."""
    unknown = sorted(set(source.columns) - set(reads))
    if unknown:
        raise DataError(f"{where}.columns.{unknown[0]}: rollout reads no column {unknown[0]!r} here; it reads "
                        f"{', '.join(reads)}")
    schema = table_schema(source, where)
    wanted: dict[str, str] = {}
    for name in reads:
        column = source.columns.get(name, name)
        if _field_type(schema, column) is not None:
            wanted[name] = column
        elif name in source.columns:
            raise DataError(f"{where}.columns.{name}: no column {column!r} in {source.path} (its columns: "
                            f"{describe_columns(schema)})")
    table = _read_columns(source, sorted({column.split(".")[0] for column in wanted.values()}), where)
    arrays = [_column(table, column) for column in wanted.values()]
    return pa.Table.from_arrays(arrays, names=list(wanted)) if arrays else pa.table({})


def table_schema(source, where: str) -> pa.Schema:
    """The table's schema, read without its rows (a parquet footer, an Arrow file's header)."""
    if source.type == "hf_disk":
        return _hf_table(source, where).schema
    files = data_files(source, where)
    if source.type == "parquet":
        return pq.read_schema(files[0])
    return _arrow_file(files[0], where).schema


def describe_columns(schema: pa.Schema) -> str:
    return ", ".join(schema.names) or "none"


def _field_type(schema: pa.Schema, dotted: str) -> pa.DataType | None:
    """The type of a column, or of a struct field inside one (`reward_model.ground_truth`); None if absent."""
    head, *rest = dotted.split(".")
    if head not in schema.names:
        return None
    kind = schema.field(head).type
    for part in rest:
        if not pa.types.is_struct(kind) or kind.get_field_index(part) < 0:
            return None
        kind = kind.field(part).type
    return kind


def _column(table: pa.Table, dotted: str) -> pa.ChunkedArray:
    head, *rest = dotted.split(".")
    column = table.column(head)
    return pc.struct_field(column, rest) if rest else column


def _read_columns(source, columns: list[str], where: str) -> pa.Table:
    if source.type == "hf_disk":
        return _hf_table(source, where).select(columns)
    files = data_files(source, where)
    try:
        if source.type == "parquet":
            return pa.concat_tables(pq.read_table(path, columns=columns, memory_map=True) for path in files)
        return pa.concat_tables(_arrow_file(path, where).select(columns) for path in files)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{where}.path: cannot read {source.type} data from {source.path}: {exc}") from None


def _arrow_file(path: Path, where: str) -> pa.Table:
    """An Arrow IPC file, memory-mapped: the file format (Feather v2) or the stream format (what `datasets` writes)."""
    try:
        try:
            return pa.ipc.open_file(pa.memory_map(str(path))).read_all()
        except pa.ArrowInvalid:
            return pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{where}.path: {path} is not an Arrow IPC file or stream: {exc}") from None


# --- which files ------------------------------------------------------------------------------------------------


def data_files(source, where: str) -> list[Path]:
    """The files holding the source's split, in row order."""
    if source.type == "hf_disk":
        return [Path(entry["filename"]) for entry in _hf_dataset(source.path, source.split, where).cache_files]
    root = Path(source.path)
    if not root.exists():  # validated when the config loaded; gone since
        raise DataError(f"{where}.path: no file or folder {root}")
    if root.is_file():
        if source.split is not None:
            raise DataError(f"{where}.split: {root} is one file, which has no splits; a split picks the files of a "
                            "folder (leave split out)")
        return [root]
    suffix = _SUFFIX[source.type]
    files = sorted(path for path in root.rglob(f"*{suffix}")
                   if path.is_file() and not any(part.startswith(".") for part in path.relative_to(root).parts))
    if not files:
        raise DataError(f"{where}.path: no {suffix} files in {root}")
    splits = {path: _split_name(path.relative_to(root)) for path in files}
    named = sorted({name for name in splits.values() if name is not None})
    if source.split is None:
        if len(named) > 1:  # reading train and test as one set is never what was meant
            raise DataError(f"{where}.split: {root} holds several splits ({', '.join(named)}); set split to one")
        return files
    chosen = [path for path in files if source.split in (splits[path], path.stem)
              or source.split in path.relative_to(root).parts[:-1]]
    if not chosen:
        present = ", ".join(named) if named else "none named; files: " + ", ".join(
            str(path.relative_to(root)) for path in files[:5])
        raise DataError(f"{where}.split: no split {source.split!r} in {root} (its splits: {present})")
    return chosen


def _split_name(relative: Path) -> str | None:
    """A file's split by the hub's conventions: `train-00000-of-00002.parquet`, or `train/0000.parquet`."""
    match = _SHARD.fullmatch(relative.stem)
    if match:
        return match.group(1)
    return relative.parts[-2] if len(relative.parts) > 1 else None


# --- save_to_disk folders (the `datasets` extra) ----------------------------------------------------------------


def _datasets(where: str):
    # Offline, and its cache in rollout's cache dir, never ~/.cache/huggingface: set before the first import.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_CACHE", str(rollout_cache_dir() / "datasets"))
    try:
        import datasets
    except ImportError:
        raise DataError(f"{where}: type = \"hf_disk\" needs the `datasets` package, which is not installed: "
                        f"{DATASETS_EXTRA}") from None
    return datasets


def _hf_dataset(path: str, split: str | None, where: str):
    datasets = _datasets(where)
    try:
        loaded = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{where}.path: {path} is not a folder written by save_to_disk ({first})") from None
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
        if split is None:
            if len(names) == 1:
                return loaded[names[0]]
            raise DataError(f"{where}.split: {path} holds splits {', '.join(names)}; set split to one of them")
        if split not in loaded:
            raise DataError(f"{where}.split: no split {split!r} in {path} (its splits: {', '.join(names)})")
        return loaded[split]
    if split is not None and loaded.split is not None and str(loaded.split) != split:
        raise DataError(f"{where}.split: {path} holds one dataset, split {str(loaded.split)!r}, not {split!r}")
    return loaded


def _hf_table(source, where: str) -> pa.Table:
    dataset = _hf_dataset(source.path, source.split, where)
    # The memory-mapped table itself; a dataset saved after select() has no indices mapping (save_to_disk
    # flattens it), so its rows are the table's rows.
    return dataset.with_format("arrow")[:] if dataset._indices is not None else dataset.data.table
