"""`--dry-run`: validate everything that can be validated without loading a model, and describe the plan."""

from __future__ import annotations

import math

from rollout_lib.config.rm import RmConfig
from rollout_lib.data import load_pairs
from rollout_lib.model.loading import resolve_model


def describe_plan(config) -> dict:
    if isinstance(config, RmConfig):
        return _rm_plan(config)
    raise TypeError(f"no plan for {type(config).__name__}")


def _rm_plan(config: RmConfig) -> dict:
    settings = config.settings
    train_rows = load_pairs(settings.dataset.path).num_rows  # parses every row: a bad one fails here
    eval_rows = load_pairs(settings.eval_dataset.path).num_rows if settings.eval_dataset else 0
    resolved = resolve_model(settings.base_model)
    steps = settings.budget.max_steps
    return {
        "entry_point": "train-rm",
        "run": config.run.name,
        "store": config.run.store,
        "model": {"reference": settings.base_model.uri, "resolved": resolved.source, "gguf_file": resolved.gguf_file},
        "train_pairs": train_rows,
        "eval_pairs": eval_rows,
        "steps": steps,
        "pairs_per_step": settings.minibatch_size,
        "batches_per_epoch": math.ceil(train_rows / settings.minibatch_size),
        "epochs": round(steps * settings.minibatch_size / train_rows, 3),
        "snapshots_at": sorted({*range(settings.checkpoint_interval, steps + 1, settings.checkpoint_interval), steps}),
        "optimizer": settings.optimizer.model_dump(mode="json"),
    }
