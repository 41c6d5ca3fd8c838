"""What every checkpointed trainer shares: build for a run, snapshot to the store, reopen from a snapshot.

A subclass says how to build (model, tokenizer, optimizer) for its run (`build`), which content ids its
training reads (`data_ids`) and how to train one step (`run_step`); this class owns the step order, the
learning-rate schedule and per-step seeding (`train_step`) and the checkpoint round trip
that `rollout_lib.trainer.live` relies on. A run object carries `store`, `config` (with `.settings.base_model`
and `.run.seed`) and `settings_hash`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pyarrow as pa
import torch

from rollout_lib.trainer.checkpoint import read_manifest, restore_checkpoint, save_checkpoint, save_model_files
from rollout_lib.trainer.determinism import seed_for_step
from rollout_lib.trainer.optim import lr_at, set_lr


class NonFiniteLossError(FloatingPointError):
    """A training step produced a NaN/inf loss or gradient; the step fails instead of corrupting the weights."""


class CheckpointedTrainer:
    kind_of_model: ClassVar[str]
    # Metrics that differ run to run (timings): kept out of the content-addressed manifest.
    timing_metrics: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, run, model, tokenizer, optimizer, step: int, checkpoint_id: str | None, model_files: dict):
        self.run = run
        self.model = model
        self.tokenizer = tokenizer
        self.optimizer = optimizer
        self.step = step
        self.checkpoint_id = checkpoint_id  # the last snapshot this state descends from
        self.model_files = model_files
        self._tables: dict[str, pa.Table] = {}

    # --- what a subclass provides -------------------------------------------------------------------------

    @classmethod
    def build(cls, run) -> tuple[Any, Any, Any]:
        """(model, tokenizer, optimizer) at step 0, deterministically from the run's settings and seed."""
        raise NotImplementedError

    def data_ids(self) -> dict[str, str]:
        """Content ids of the tables this trainer's steps read; recorded in every checkpoint."""
        raise NotImplementedError

    def run_step(self, step: int) -> dict:
        """Forward, backward and optimizer step for `step` (learning rate and seed already set); its metrics."""
        raise NotImplementedError

    # --- what this class provides -------------------------------------------------------------------------

    def train_step(self, step: int) -> dict:
        """One optimizer step. Steps run strictly in order, each with its scheduled learning rate and its own seed
        (dropout masks), so replaying steps after a crash retraces exactly the same updates."""
        if step != self.step + 1:
            raise RuntimeError(f"{self.kind_of_model} trainer is at step {self.step}; cannot run step {step}")
        settings = self.run.config.settings
        lr = lr_at(step, settings.optimizer, settings.budget.max_steps)
        set_lr(self.optimizer, lr)
        torch.manual_seed(seed_for_step(self.run.config.run.seed, step))
        metrics = self.run_step(step)
        self.step = step
        return {"step": step, "lr": lr, **metrics}

    def table(self, object_id: str, schema: pa.Schema) -> pa.Table:
        """A table the steps read (tokenized data, a plan), fetched from the store once per trainer."""
        if object_id not in self._tables:
            self._tables[object_id] = self.run.store.get_table(object_id, schema)
        return self._tables[object_id]

    # --- the checkpoint round trip ------------------------------------------------------------------------

    @classmethod
    def initial(cls, run) -> "CheckpointedTrainer":
        """Step 0 (the base model, any new head initialised from the seed), snapshotted so later steps replay."""
        model, tokenizer, optimizer = cls.build(run)
        trainer = cls(run, model, tokenizer, optimizer, 0, None, save_model_files(run.store, model, tokenizer))
        trainer.snapshot(metrics={})
        return trainer

    @classmethod
    def initial_checkpoint(cls, run) -> str:
        return cls.initial(run).checkpoint_id

    @classmethod
    def from_checkpoint(cls, run, checkpoint_id: str) -> "CheckpointedTrainer":
        manifest = read_manifest(run.store, checkpoint_id)
        model, tokenizer, optimizer = cls.build(run)
        restore_checkpoint(run.store, manifest, model, optimizer)
        return cls(run, model, tokenizer, optimizer, manifest["step"], checkpoint_id, manifest["model"])

    def snapshot(self, metrics: dict) -> str:
        deterministic = {k: v for k, v in metrics.items() if k not in self.timing_metrics}
        self.checkpoint_id = save_checkpoint(
            self.run.store, model=self.model, optimizer=self.optimizer, model_files=self.model_files,
            step=self.step, parent=self.checkpoint_id, settings_hash=self.run.settings_hash,
            extra={"kind_of_model": self.kind_of_model, "base_model": self.run.config.settings.base_model.uri,
                   "data": {**self.data_ids(), "cursor": self.step},
                   "seed": self.run.config.run.seed, "metrics": deterministic},
        )
        return self.checkpoint_id
