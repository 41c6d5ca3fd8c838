"""Pieces every flow shares: loading settings inside a run, result storage, artifacts."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

from prefect import Task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

from rollout_lib.config.loading import load_config

# rollout_lib logs through the standard library (it never imports Prefect); PREFECT_LOGGING_EXTRA_LOGGERS=rollout_lib
# (set by the CLI and the deployments) routes these records into the flow run's logs.
logging.getLogger("rollout_lib").setLevel(logging.INFO)


def load_run_config(config_cls, config_path: str, overrides: list[str] | dict[str, Any] | None,
                    max_steps: int | None, max_steps_key: str):
    overrides = dict(_as_pairs(overrides))
    if max_steps is not None:
        overrides[max_steps_key] = max_steps
    return load_config(config_cls, config_path, overrides)


def _as_pairs(overrides):
    if not overrides:
        return []
    if isinstance(overrides, dict):
        return list(overrides.items())
    from rollout_lib.config.loading import parse_override

    return [(".".join(path), value) for path, value in map(parse_override, overrides)]


def bind(task: Task, config) -> Task:
    """Task results live beside the store they describe (for local stores), so wiping a store also wipes the
    cache entries that point into it."""
    if "://" in config.run.store:
        return task
    return task.with_options(result_storage=Path(config.run.store) / "prefect-results")


def artifact_key(*parts: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    text = "-".join(parts).lower()
    return "".join(c if c.isalnum() else "-" for c in text).strip("-")


def metrics_table(cfg, flow_name: str, history: list[dict], columns: tuple[str, ...]) -> None:
    """The per-step metrics table artifact (floats rounded; a metric a step lacks is an empty cell)."""
    def cell(value):
        return round(value, 6) if isinstance(value, float) else ("" if value is None else value)

    create_table_artifact([{name: cell(m.get(name)) for name in columns} for m in history],
                          key=artifact_key(cfg.run.name, "metrics"), description=f"{flow_name} metrics per step")


class Progress:
    """A progress artifact updated while training (shown live in the UI)."""

    def __init__(self, key: str, total: int, description: str):
        self.total = total
        self.artifact_id = create_progress_artifact(0.0, key=key, description=description)

    def update(self, done: int) -> None:
        update_progress_artifact(self.artifact_id, progress=100.0 * done / self.total)


def train_steps(t: Callable[[Task], Task], train_step_task: Task, snapshot_task: Task, cfg, data_ids: tuple[str, ...],
                state: str, *, total: int, checkpoint_interval: int,
                progress: Progress) -> Iterator[tuple[int, dict, str | None]]:
    """Steps 1..total, each `train_step_task(cfg, *data_ids, state, step)`, and `snapshot_task(cfg, *data_ids,
    state, step, metrics)` every `checkpoint_interval` steps and at the last one. Yields (step, metrics, the
    snapshot's checkpoint id or None); the last step always yields the final checkpoint."""
    step_task, snapshot = t(train_step_task), t(snapshot_task)  # bound once: this loop is the hot path
    for step in range(1, total + 1):
        result = step_task(cfg, *data_ids, state, step)
        state, metrics = result["state"], result["metrics"]
        checkpoint = None
        if step % checkpoint_interval == 0 or step == total:
            state = checkpoint = snapshot(cfg, *data_ids, state, step, metrics)["checkpoint"]
        if step % 10 == 0 or step == total:
            progress.update(step)
        yield step, metrics, checkpoint
