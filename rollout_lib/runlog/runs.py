"""The runs a store holds, for `rollout runs`: a run is a name with refs under ``refs/runs/<name>/`` (its claim,
its latest checkpoint) or a metrics file under ``runs/<name>/``. A run older than metrics files is known from its
latest checkpoint's manifest (its step, its last metrics, and each step's metrics through the manifests' history).
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_lib.runlog.metrics_file import RUNS_DIR, WALL_TIME, check_run_name, last_record, read_metrics
from rollout_lib.store import ObjectStore, StoreError
from rollout_lib.checkpoint import read_manifest

LATEST_REF = "runs/{name}/latest"

# The one number that says how a run is doing, by kind of model: the first of these a record has.
# A reward model: held-out accuracy when the run evaluated one, else training accuracy; an RL policy: the mean
# reward; an SFT model: held-out loss, else training loss.
REWARD_MODEL_HEADLINES = (("eval/accuracy", "held-out accuracy"), ("accuracy", "accuracy"))
CAUSAL_LM_HEADLINES = (("reward_mean", "reward_mean"), ("eval/loss", "held-out loss"), ("loss", "loss"))


@dataclass(frozen=True)
class RunSummary:
    name: str
    checkpoint: str | None  # what runs/<name>/latest points at (None: the run has not finished once)
    checkpoint_step: int | None
    last_step: int | None  # the last recorded step; past checkpoint_step while a run trains (or after a kill)
    kind_of_model: str | None  # "reward_model", "causal_lm"
    headline: tuple[str, float] | None  # (label, value)
    updated: float | None  # POSIX seconds: the last record's wall time or the latest ref's, whichever is later


def run_names(store: ObjectStore) -> list[str]:
    """Every run name in the store, sorted."""
    if not store.exists():
        raise StoreError(f"no store at {store.root}")
    names = set()
    for directory in (f"{store.root}/refs/{RUNS_DIR}", f"{store.root}/{RUNS_DIR}"):
        store.fs.invalidate_cache(directory)
        try:
            entries = store.fs.ls(directory, detail=True)
        except FileNotFoundError:
            continue
        names.update(entry["name"].rstrip("/").rsplit("/", 1)[-1] for entry in entries
                     if entry.get("type") == "directory")
    return sorted(names)


def list_runs(store: ObjectStore) -> list[RunSummary]:
    return [run_summary(store, name) for name in run_names(store)]


def run_summary(store: ObjectStore, name: str) -> RunSummary:
    """What `rollout runs` shows of one run; StoreError naming the store when it holds no run of that name."""
    check_run(store, name)
    checkpoint = store.get_ref(LATEST_REF.format(name=name))
    manifest = read_manifest(store, checkpoint) if checkpoint is not None else None
    record = last_record(store, name)
    if record is None and manifest is not None:
        record = manifest.get("metrics") or None
    kind = manifest.get("kind_of_model") if manifest else None
    updated = [record.get(WALL_TIME)] if record else []
    updated += [stored.modified for stored in store.list_files(f"refs/{RUNS_DIR}/{name}")
                if stored.name == f"refs/{LATEST_REF.format(name=name)}"]
    updated = [time for time in updated if isinstance(time, (int, float))]
    checkpoint_step = manifest["step"] if manifest else None
    return RunSummary(
        name=name, checkpoint=checkpoint, checkpoint_step=checkpoint_step,
        last_step=record["step"] if record and isinstance(record.get("step"), int) else checkpoint_step,
        kind_of_model=kind, headline=headline(record or {}, kind), updated=max(updated) if updated else None)


def check_run(store: ObjectStore, name: str) -> str:
    """``name``, when the store holds a run of that name; else a StoreError that names the store."""
    check_run_name(name)
    if not store.exists():
        raise StoreError(f"no store at {store.root}")
    for directory in (f"{store.root}/refs/{RUNS_DIR}/{name}", f"{store.root}/{RUNS_DIR}/{name}"):
        store.fs.invalidate_cache(directory)
        if store.fs.exists(directory):
            return name
    raise StoreError(f"no run {name!r} in {store.root}")


def headline(record: dict, kind_of_model: str | None = None) -> tuple[str, float] | None:
    """(label, value) of the run's headline metric in ``record`` (see REWARD_MODEL_HEADLINES), or None."""
    if kind_of_model is None:  # no checkpoint yet: a reward model's steps report accuracy, a causal LM's do not
        kind_of_model = "reward_model" if "accuracy" in record else "causal_lm"
    candidates = REWARD_MODEL_HEADLINES if kind_of_model == "reward_model" else CAUSAL_LM_HEADLINES
    for name, label in candidates:
        value = record.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return label, float(value)
    return None


def run_history(store: ObjectStore, name: str) -> list[dict]:
    """Every step's metrics: the run's metrics file, or for a run without one (older than metrics files), the
    metrics its checkpoints keep (runs/<name>/latest and its parents; no timings, no wall times)."""
    check_run(store, name)
    recorded = read_metrics(store, name)
    if recorded:
        return recorded
    checkpoint = store.get_ref(LATEST_REF.format(name=name))
    if checkpoint is None:
        return []
    from rollout_lib.trainer.segment import history_since

    return history_since(store, checkpoint, 1)
