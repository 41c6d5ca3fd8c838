"""Pieces every flow shares: loading settings inside a run, result storage, artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import Task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from rollout_lib.config.loading import load_config


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


class Progress:
    """A progress artifact updated while training (shown live in the UI)."""

    def __init__(self, key: str, total: int, description: str):
        self.total = total
        self.artifact_id = create_progress_artifact(0.0, key=key, description=description)

    def update(self, done: int) -> None:
        update_progress_artifact(self.artifact_id, progress=100.0 * done / self.total)
