"""A run's per-step metrics, kept in its store as each step completes: the history that outlives the run.

A local store: ``runs/<name>/metrics.jsonl``, one line per optimizer step, appended (and flushed) when the step
completes; a remote one (no appends there): ``runs/<name>/metrics/<step, 9 digits>.json`` (docs/runs.md). The
reader takes both layouts. A line is the step's metrics as the
trainer reported them, with ``"step"`` first and ``"wall_time"`` (POSIX seconds, when the line was written) last;
a float that JSON cannot hold is written as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` and read back
as that float. Step 0, when a run evaluates its initial model on held-out data, is a line of that evaluation alone
(``eval/<name>``, :meth:`MetricsFile.annotate`): readers that want optimizer steps take ``step >= 1``.

A run resumed after a kill replays the steps after its last snapshot, and publishes them again: a step recorded
again replaces its line and drops the lines after it (they belong to the attempt being replayed), so the file
holds each step once and never grows with replays. Steps a run reuses without training them (a cached segment, a
segment an earlier run trained) are added only where missing (:meth:`MetricsFile.backfill`). A run opened with a
shorter budget than an earlier run of the same name drops the steps past it: the file tells the run whose
``runs/<name>/latest`` it is. One process writes a run's metrics at a time.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
import uuid
from typing import Any, Iterable

from fsspec.implementations.local import LocalFileSystem

from rollout_lib.store import ObjectStore, StoreError

RUNS_DIR = "runs"  # <root>/runs/<name>/: what a run keeps beside its refs (refs/runs/<name>/...)
METRICS_FILE = "metrics.jsonl"  # local stores
STEP_OBJECTS_DIR = "metrics"  # remote stores: metrics/<step>.json
WALL_TIME = "wall_time"

_STEP_OBJECT_RE = re.compile(r"(\d+)\.json")
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def check_run_name(name: str) -> str:
    """A run name as `run.name` allows it (so that it is one directory, never a path out of `runs/`)."""
    from pydantic import ValidationError

    from rollout_lib.config.common import RunSettings

    try:
        return RunSettings.model_validate({"name": name}).name
    except ValidationError:
        raise StoreError(f"invalid run name {name!r}: expected letters, digits, '.', '_', '-', starting with a "
                         "letter or digit") from None


def run_dir(store: ObjectStore, run_name: str) -> str:
    """``<root>/runs/<name>``: a path on ``store.fs``."""
    return f"{store.root}/{RUNS_DIR}/{check_run_name(run_name)}"


def is_local(store: ObjectStore) -> bool:
    return isinstance(store.fs, LocalFileSystem)


# --- lines ------------------------------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    """``value`` as plain JSON: non-finite floats as strings, numpy/torch scalars as numbers, anything else that JSON
    cannot hold as its text (a step's metrics are for reading; losing a value's type beats losing the step)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return value
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    item = getattr(value, "item", None)  # numpy and torch scalars
    if callable(item):
        try:
            return _jsonable(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


def encode_record(step: int, metrics: dict, wall_time: float | None = None) -> str:
    """One line of the metrics file (no newline); ``wall_time`` defaults to now."""
    record = {"step": int(step), **{name: value for name, value in metrics.items() if name not in ("step", WALL_TIME)},
              WALL_TIME: time.time() if wall_time is None else wall_time}
    return json_line(record)


def json_line(record: dict) -> str:
    """A record as one line of valid JSON (non-finite floats as strings)."""
    return json.dumps(_jsonable(record), ensure_ascii=False, allow_nan=False)


def decode_record(text: str | bytes) -> dict | None:
    """A line back as a dict, non-finite floats restored; None for a line that is not a record (the half-written
    last line of a killed writer)."""
    try:
        record = json.loads(text)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return {name: _NON_FINITE.get(value, value) if isinstance(value, str) else value
            for name, value in record.items()}


def _last_per_step(records: Iterable[dict]) -> list[dict]:
    by_step: dict[int, dict] = {}
    for record in records:
        by_step[record["step"]] = record  # a later line of a step replaces an earlier one
    return [by_step[step] for step in sorted(by_step)]


# --- reading ----------------------------------------------------------------------------------------------------


def read_metrics(store: ObjectStore, run_name: str) -> list[dict]:
    """Every recorded step of the run, sorted by step, each step once; [] when the run recorded none (a run older
    than the metrics file: see runlog.runs.run_history for its checkpoints' metrics)."""
    directory = run_dir(store, run_name)
    return _last_per_step([*_read_lines(store, f"{directory}/{METRICS_FILE}"),
                           *_read_step_objects(store, f"{directory}/{STEP_OBJECTS_DIR}")])


def _read_lines(store: ObjectStore, path: str) -> list[dict]:
    store.fs.invalidate_cache(path)
    try:
        data = store.fs.cat_file(path)
    except FileNotFoundError:
        return []
    return [record for record in map(decode_record, data.splitlines()) if record is not None]


def _step_objects(store: ObjectStore, directory: str) -> dict[int, str]:
    """Step -> path of each per-step object under ``directory``."""
    store.fs.invalidate_cache(directory)
    found = {}
    for path in store.fs.find(directory):
        match = _STEP_OBJECT_RE.fullmatch(path.rsplit("/", 1)[-1])
        if match:
            found[int(match.group(1))] = path
    return found


def _read_step_objects(store: ObjectStore, directory: str, objects: dict[int, str] | None = None,
                       steps: Iterable[int] | None = None) -> list[dict]:
    """The records of per-step objects (``objects``: a listing already made; ``steps``: only these)."""
    objects = _step_objects(store, directory) if objects is None else objects
    paths = [objects[step] for step in (sorted(objects) if steps is None else steps) if step in objects]
    if not paths:
        return []
    strip = store.fs._strip_protocol  # fsspec keys what it read by path without the protocol
    contents = {strip(path): data for path, data in store.fs.cat(paths, on_error="omit").items()}  # concurrently
    records = (decode_record(contents[strip(path)]) for path in paths if isinstance(contents.get(strip(path)), bytes))
    return [record for record in records if record is not None]


def last_record(store: ObjectStore, run_name: str) -> dict | None:
    """The run's last recorded step (for listing runs: a remote run's other steps are not fetched)."""
    directory = f"{run_dir(store, run_name)}/{STEP_OBJECTS_DIR}"
    objects = _step_objects(store, directory)
    records = _last_per_step([*_read_lines(store, f"{run_dir(store, run_name)}/{METRICS_FILE}"),
                              *_read_step_objects(store, directory, objects, steps=[max(objects)] if objects else [])])
    return records[-1] if records else None


# --- writing ----------------------------------------------------------------------------------------------------


class MetricsFile:
    """Writes one run's metrics as its steps complete (the module docstring says where and how).

    ``total_steps``: the run's budget; steps past it (an earlier, longer run of the same name) are dropped."""

    def __init__(self, store: ObjectStore, run_name: str, total_steps: int | None = None):
        self.store = store
        self.run_name = run_name
        self.directory = run_dir(store, run_name)
        self.local = is_local(store)
        self.path = f"{self.directory}/{METRICS_FILE}" if self.local else f"{self.directory}/{STEP_OBJECTS_DIR}"
        self._records: list[dict] = []  # local: the file's records, in file order
        self._objects: dict[int, str] = {}  # remote: step -> its object's path
        if self.local:
            self._records = self._read_local()
            if total_steps is not None and any(record["step"] > total_steps for record in self._records):
                self._rewrite_local([record for record in self._records if record["step"] <= total_steps])
        else:
            self._objects = _step_objects(store, self.path)
            if total_steps is not None:
                self._remove_objects([step for step in self._objects if step > total_steps])

    @property
    def steps(self) -> list[int]:
        """The steps recorded so far, sorted."""
        return sorted({record["step"] for record in self._records} if self.local else self._objects)

    def _last_step(self) -> int | None:
        return max(self.steps, default=None)

    def record(self, step: int, metrics: dict) -> None:
        """Training has (re)done ``step``: its line replaces an earlier one, and lines after it go."""
        line = encode_record(step, metrics)
        last = self._last_step()
        replay = last is not None and last >= step
        if self.local:
            if replay:
                self._rewrite_local([record for record in self._records if record["step"] < step])
            self._append_local(line)
        else:
            if replay:
                self._remove_objects([known for known in self._objects if known > step])
            self._put_object(step, line)

    def backfill(self, history: Iterable[dict]) -> list[dict]:
        """Record the steps of ``history`` (metrics dicts with ``"step"``) that are not recorded yet: steps a run
        reused without training them. Returns those it recorded."""
        known = {record["step"] for record in self._records} if self.local else set(self._objects)
        added = []
        for metrics in history:
            step = metrics.get("step")
            if isinstance(step, int) and step not in known:
                line = encode_record(step, metrics)
                if self.local:
                    self._append_local(line)
                else:
                    self._put_object(step, line)
                known.add(step)
                added.append(metrics)
        return added

    def annotate(self, step: int, extra: dict) -> None:
        """Add ``extra`` (held-out evaluation at that step) to ``step``'s line, keeping its wall time; a step without
        a line gets one of ``extra`` alone (step 0: the evaluation before training), in step order."""
        if self.local:
            if any(record["step"] == step for record in self._records):
                self._rewrite_local([{**record, **extra} if record["step"] == step else record
                                     for record in self._records])
            elif step < (self._last_step() or 0):  # a rerun's step 0
                self._rewrite_local(sorted([*self._records, decode_record(encode_record(step, extra))],
                                           key=lambda record: record["step"]))
            else:
                self._append_local(encode_record(step, extra))
            return
        found = _read_step_objects(self.store, self.path, self._objects, steps=[step])
        base = found[0] if found else {"step": step}
        self._put_object(step, encode_record(step, {**base, **extra}, base.get(WALL_TIME)))

    # --- local: one JSONL file, appended -------------------------------------------------------------------

    def _read_local(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            data = b""
        records = [record for record in map(decode_record, data.splitlines()) if record is not None]
        if data and (not data.endswith(b"\n") or len(records) != len(data.splitlines())):
            self._rewrite_local(records)  # a killed writer's half line: gone before anything is appended to it
        return records

    def _append_local(self, line: str) -> None:
        os.makedirs(self.directory, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        self._records.append(decode_record(line))

    def _rewrite_local(self, records: list[dict]) -> None:
        """Replace the file with ``records``, atomically (a reader sees the old file or the new one)."""
        os.makedirs(self.directory, exist_ok=True)
        tmp = f"{self.path}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                for record in records:
                    f.write(encode_record(record["step"], record, record.get(WALL_TIME)) + "\n")
            os.replace(tmp, self.path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self._records = list(records)

    # --- remote: one object per step ------------------------------------------------------------------------

    def _put_object(self, step: int, line: str) -> None:
        path = f"{self.path}/{step:09d}.json"
        self.store.fs.pipe_file(path, (line + "\n").encode())
        self._objects[step] = path

    def _remove_objects(self, steps: list[int]) -> None:
        if not steps:
            return
        paths = [self._objects.pop(step) for step in steps]
        with contextlib.suppress(FileNotFoundError):
            self.store.fs.rm(paths)
        self.store.fs.invalidate_cache(self.path)
