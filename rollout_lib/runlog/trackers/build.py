"""The trackers a run lists (`run.trackers`), each on its thread, named for the run and its store.

A tracker's run is found again by a key derived from the store and the run name (blake3 of both), so a rerun of
the same run in the same store continues it; the same name in another store is another tracker run.
"""

from __future__ import annotations

from pathlib import Path

import blake3

from rollout_lib.config.common import RunSettings
from rollout_lib.runlog.metrics_file import RUNS_DIR, check_run_name, is_local
from rollout_lib.runlog.trackers.thread import TrackerThread
from rollout_lib.store import ObjectStore

REMOTE_STORE_WANDB_ROOT = ".rollout/wandb"


def run_key(store: ObjectStore, run_name: str) -> str:
    return blake3.blake3(f"{store.root}\0{run_name}".encode()).hexdigest()[:32]


def wandb_dir(store: ObjectStore, run_name: str) -> Path:
    """W&B's local files: beside the metrics file for a local store, else under the working directory (as
    TensorBoard's event files: runlog/tensorboard.py)."""
    name = check_run_name(run_name)
    if is_local(store):
        return Path(store.root) / RUNS_DIR / name
    return Path(REMOTE_STORE_WANDB_ROOT).resolve() / name


def open_trackers(run: RunSettings, store: ObjectStore, settings: dict[str, str]) -> list[TrackerThread]:
    """A started TrackerThread per tracker in `run.trackers` but TensorBoard (the recorder's own: tensorboard.py),
    each opening its tracker run with `settings` (the resolved settings, one value per dotted key)."""
    key = run_key(store, run.name)
    backends = []
    for tracker in run.trackers:
        if tracker == "mlflow":
            from rollout_lib.runlog.trackers.mlflow_tracker import MlflowBackend

            backends.append(MlflowBackend(run.mlflow, run.name, key))
        elif tracker == "wandb":
            from rollout_lib.runlog.trackers.wandb_tracker import WandbBackend

            directory = Path(run.wandb.dir) if run.wandb.dir else wandb_dir(store, run.name)
            backends.append(WandbBackend(run.wandb, run.name, key, directory))
        elif tracker == "trackio":
            from rollout_lib.runlog.trackers.trackio_tracker import TrackioBackend

            backends.append(TrackioBackend(run.trackio, run.name))
    return [TrackerThread(backend, settings) for backend in backends]
