"""What every checkpointed trainer shares: build from its inputs, step in order, snapshot, reopen a snapshot.

A subclass says which model it trains (`load_model`) and how to train one step (`run_step`); this class builds
(model, tokenizer, optimizer) from the inputs (`build`) and owns the step order, the learning-rate schedule and
per-step seeding (`train_step`) and the checkpoint round trip (`initial`, `from_checkpoint`, `snapshot`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from rollout_lib.adapters import adapter_config, with_adapter
from rollout_lib.store import ObjectStore
from rollout_lib.checkpoint import (ADAPTER_KEY, gathered_weights, model_weights, read_manifest, restore_checkpoint,
                                    save_checkpoint, save_model_files)
from rollout_lib.hardware import hardware_of_config, hardware_settings, place_model
from rollout_lib.model.loading import load_tokenizer, model_content_digest, resolve_model
from rollout_lib.model.chat import use_chat_template
from rollout_lib.determinism import GLOBAL_RNG, seed_for_step, seed_torch
from rollout_lib.trainer.optim import build_optimizer, lr_at, set_lr
from rollout_lib.trainer.sharding import (full_weights, load_full_optimizer_state, receive_optimizer_state,
                                          shard_model, stream_state, trainable_names)


class NonFiniteLossError(FloatingPointError):
    """A training step produced a NaN/inf loss or gradient; the step fails instead of corrupting the weights."""


@dataclass(frozen=True)
class TrainingInputs:
    """What a trainer is built from: the store, the validated settings (an RmConfig, SftConfig or RlConfig), the
    chain's identity (`identity.training.training_identity`: what decides the weights), and the content ids of the
    tables its steps read (recorded in every checkpoint)."""

    store: ObjectStore
    config: Any
    identity: str
    data_ids: dict[str, str] = field(default_factory=dict)

    @property
    def settings(self):
        return self.config.settings


def is_timing_metric(name: str) -> bool:
    """Metrics that measure the machine or when a run did its work, not the training (`train_s`, `tokens_per_s`;
    `behaviour/precomputed_rows`, rows whose forward ran ahead of its stage): they differ run to run, or with
    settings outside the training identity, so checkpoint manifests leave them out."""
    return name.endswith(("_s", "/precomputed_rows"))


# `sampled_entropy` (rl/sample.py), a mean of the sampler's own logprobs: an engine's vary ~1e-5 with batch
# composition, so a step sampled again after a kill reports other bits while it trains on the same tokens.
SAMPLER_LOGPROB_METRICS = frozenset({"sampled_entropy"})


def deterministic_metrics(metrics: dict) -> dict:
    """The metrics a checkpoint id may depend on: numbers that are the same in every identical run (no timings,
    no numbers of an engine's logprobs, no text such as reward error messages, which can carry addresses or
    pids)."""
    return {name: value for name, value in metrics.items()
            if isinstance(value, (int, float)) and not is_timing_metric(name) and name not in SAMPLER_LOGPROB_METRICS}


def adapted(model, inputs: TrainingInputs, task: str):
    """`model` with the entry point's adapter (`algorithm.<kind>.adapter`) wrapped around it, or as it is when the
    settings ask for none. Seed torch first: the adapter's A matrices are drawn from its RNG."""
    settings = getattr(inputs.settings, "adapter", None)
    if settings is None:
        return model
    return with_adapter(model, settings, task=task, where=f"algorithm.{inputs.config.algorithm.kind}.adapter")


def adapter_record(model, base_model) -> dict:
    """The manifest's ADAPTER_KEY entry: adapter_config.json's content, the base's reference and its content
    identity (model_content_digest: a checkpoint's id, or the blake3 of a local model's files)."""
    return {"config": adapter_config(model, base_model.uri), "base_model": base_model.uri,
            "base_model_content": model_content_digest(base_model)}


class CheckpointedTrainer:
    kind_of_model: ClassVar[str]
    # Set on each rank of a data-parallel segment (trainer.data_parallel.DataParallelRank): run_step then trains the
    # rank's share of the step and sums counts and gradients over the ranks. None: one process trains it all.
    data_parallel = None

    def __init__(self, inputs: TrainingInputs, model, tokenizer, optimizer, step: int, checkpoint_id: str | None,
                 model_files: dict):
        self.inputs = inputs
        self.model = model
        self.tokenizer = tokenizer
        self.optimizer = optimizer
        self.step = step
        self.checkpoint_id = checkpoint_id  # the last snapshot this state descends from
        self.snapshot_step = step if checkpoint_id else None  # the step of that snapshot
        self.model_files = model_files

    # --- what a subclass provides -------------------------------------------------------------------------

    @classmethod
    def load_model(cls, resolved, inputs: TrainingInputs, hardware):
        """The base model as this trainer trains it; `build` has seeded torch, so a new head starts from the seed."""
        raise NotImplementedError

    def run_step(self, step: int) -> dict:
        """Forward, backward and optimizer step for `step` (learning rate and seed already set); its metrics."""
        raise NotImplementedError

    # --- what this class provides -------------------------------------------------------------------------

    @classmethod
    def build(cls, inputs: TrainingInputs) -> tuple[Any, Any, Any]:
        """(model, tokenizer, optimizer) at step 0, deterministically from the settings and seed: the base model
        (`load_model`) with the entry point's adapter, placed on its hardware."""
        hardware = hardware_of_config(inputs.config)
        hardware.use_deterministic_kernels(inputs.config.run.torch_threads)
        resolved = resolve_model(inputs.settings.base_model)
        # RL's `chat_template` override: the policy's prompts, env replies and checkpoints use it.
        tokenizer = use_chat_template(load_tokenizer(resolved), getattr(inputs.settings, "chat_template", None))
        torch.manual_seed(inputs.config.run.seed)  # a new head (the reward model's score head) starts from the seed
        model = cls.load_model(resolved, inputs, hardware)
        model.config.pad_token_id = tokenizer.pad_token_id
        model = adapted(model, inputs, cls.kind_of_model)  # a reward model's score head trains in full
        place_model(model, hardware, trainable=True)  # before the optimizer: it holds the placed parameters
        return model, tokenizer, build_optimizer(model.parameters(), inputs.settings.optimizer)

    def train_step(self, step: int) -> dict:
        """One optimizer step. Steps run strictly in order, each with its scheduled learning rate and its own seed
        (dropout masks), so replaying steps after a crash retraces exactly the same updates."""
        if step != self.step + 1:
            raise RuntimeError(f"{self.kind_of_model} trainer is at step {self.step}; cannot run step {step}")
        settings = self.inputs.settings
        lr = lr_at(step, settings.optimizer, settings.budget.max_steps)
        set_lr(self.optimizer, lr)
        with GLOBAL_RNG:
            seed_torch(seed_for_step(self.inputs.config.run.seed, step))
            metrics = self.run_step(step)
        self.step = step
        return {"step": step, "lr": lr, **metrics}

    # --- the checkpoint round trip ------------------------------------------------------------------------

    @classmethod
    def initial(cls, inputs: TrainingInputs, **options) -> "CheckpointedTrainer":
        """Step 0 (the base model, any new head initialised from the seed), snapshotted so later steps replay.
        `options` go to the subclass's constructor."""
        with GLOBAL_RNG:  # build seeds the RNG (a new head's init): never while another thread trains
            model, tokenizer, optimizer = cls.build(inputs)
        trainer = cls(inputs, model, tokenizer, optimizer, 0, None, save_model_files(inputs.store, model, tokenizer),
                      **options)
        trainer.snapshot(metrics={})
        return trainer

    @classmethod
    def from_checkpoint(cls, inputs: TrainingInputs, checkpoint_id: str, *, optimizer_state: bool = True,
                        **options) -> "CheckpointedTrainer":
        """The trainer at `checkpoint_id`; without `optimizer_state`, its optimizer starts empty (open_sharded: the
        state comes from another rank)."""
        manifest = read_manifest(inputs.store, checkpoint_id)
        with GLOBAL_RNG:  # build seeds the RNG (a new head's init): never while another thread trains
            model, tokenizer, optimizer = cls.build(inputs)
        restore_checkpoint(inputs.store, manifest, model, optimizer if optimizer_state else None)
        return cls(inputs, model, tokenizer, optimizer, manifest["step"], checkpoint_id, manifest["model"], **options)

    @classmethod
    def open_sharded(cls, inputs: TrainingInputs, checkpoint_id: str, data_parallel,
                     **options) -> "CheckpointedTrainer":
        """One rank's sharded trainer at `checkpoint_id` (every rank of the group calls it): each rank builds the model
        with the checkpoint's weights; the optimizer state (AdamW's: twice the model) is never whole on any rank:
        rank 0 streams it from the store one tensor at a time, and every rank keeps its rows (`shard`)."""
        trainer = cls.from_checkpoint(inputs, checkpoint_id, optimizer_state=False, **options)
        trainer.data_parallel = data_parallel
        trainer.shard(optimizer_id=read_manifest(inputs.store, checkpoint_id)["optimizer"])
        return trainer

    # --- sharded (trainer/sharding.py) ---------------------------------------------------------------------------

    sharded_names: list[str] | None = None  # the trainable parameters' names once sharded (the optimizer's order)

    def shard(self, optimizer_id: str | None = None) -> None:
        """Shard the model over the process group (`hardware.sharding = "fsdp"`) and rebuild the optimizer over
        the shards, its state split the same way: the state the trainer holds (restored whole), or with
        `optimizer_id` that object of the store, streamed (open_sharded). Every rank calls it."""
        hardware = hardware_settings(self.inputs.settings)
        names = trainable_names(self.model)
        state = self.optimizer.state_dict()
        shard_model(self.model, bf16=hardware.precision == "bf16", cpu_offload=hardware.cpu_offload)
        self.optimizer = build_optimizer(self.model.parameters(), self.inputs.settings.optimizer)
        if optimizer_id is not None:
            receive_optimizer_state(self.model, self.optimizer, names, self.inputs.store, optimizer_id)
        elif state["state"]:
            load_full_optimizer_state(self.model, self.optimizer, state, names)
        self.sharded_names = names

    def weights_for_export(self, keeper: int = 0) -> dict | None:
        """model_weights of the trainer's model, sharded or not; a sharded one's on rank `keeper` only (every rank
        calls it; None elsewhere)."""
        if self.sharded_names is None:
            return model_weights(self.model)
        full = full_weights(self.model, keeper)
        return gathered_weights(self.model, full) if full is not None else None

    def manifest_facts(self) -> dict:
        """What a model-specific trainer records in its checkpoints' manifests for their readers (none here)."""
        return {}

    def snapshot(self, metrics: dict, history: list[dict] | None = None) -> str | None:
        """Write weights, optimizer state and a manifest; return the checkpoint id. `history`: every step's
        metrics since the last snapshot (kept in the store, so a reused checkpoint still tells its curve).
        A trainer that has not stepped since its last snapshot returns that snapshot's id. A sharded trainer: every
        rank calls it (its tensors are gathered one by one, trainer/sharding.stream_state), rank 0 writes the same
        checkpoint a 1-process trainer would and returns its id, the other ranks return None."""
        if self.checkpoint_id is not None and self.snapshot_step == self.step:
            return self.checkpoint_id
        store = self.inputs.store
        stored = None
        if self.sharded_names is not None:
            stored = stream_state(store, self.model, self.optimizer)
            if stored is None:  # not rank 0: it has done its part
                return None
        extra = {"kind_of_model": self.kind_of_model, "base_model": self.inputs.settings.base_model.uri,
                 "data": {**self.inputs.data_ids, "cursor": self.step},
                 "seed": self.inputs.config.run.seed, "metrics": deterministic_metrics(metrics)}
        max_seq_len = getattr(self.inputs.settings, "max_seq_len", None)
        if max_seq_len is not None:  # what it was trained on: a reward model scores at most this much by default
            extra["max_seq_len"] = max_seq_len
        if getattr(self.inputs.settings, "adapter", None) is not None:  # the weights are the adapter's alone
            extra[ADAPTER_KEY] = adapter_record(self.model, self.inputs.settings.base_model)
        extra.update(self.manifest_facts())
        if history:
            extra["history"] = store.put_json([deterministic_metrics(m) for m in history])
        self.checkpoint_id = save_checkpoint(
            store, model=self.model, optimizer=self.optimizer, model_files=self.model_files, step=self.step,
            parent=self.checkpoint_id, identity=self.inputs.identity, extra=extra, stored=stored,
        )
        self.snapshot_step = self.step
        return self.checkpoint_id
