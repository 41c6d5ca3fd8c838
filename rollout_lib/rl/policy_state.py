"""A policy state of an RL run, as the store records it, and how a process rebuilds the trainer at one.

RL trains one optimizer step per RL step (the next step samples from its result). The state after step n is a
small *step record* in the store: (the state before, the step, the micro-batches it trained on, the training
identity); the state after step 0 is the initial checkpoint. A state's id therefore depends only on what was
trained, never on when the run snapshots: changing `checkpoint_interval` reuses every finished step (their task
keys are made of state ids) instead of retraining all steps after the first snapshot that moved.

Snapshots are separate: every `checkpoint_interval` steps (and at the last) the run writes a checkpoint of the
state and indexes it under the state's id and the interval (`chains/rl-state-<id>-every-<N>`, a cache like
trainer/segment.py's chain index: `rollout gc` may drop an entry whose checkpoint it deletes). A checkpoint names
its parent (the snapshot before it), so runs of another interval have other checkpoints of the same weights: each
interval indexes its own. A process that holds no trainer at a state (a rerun after a crash) rebuilds it from the
store: walk the records back to the newest state the run's own schedule snapshots (a multiple of its interval, or
step 0) that has a checkpoint of that interval, load that, replay the recorded steps after it. Replay needs no
sampling (the micro-batches are in the store), and the next checkpoint names the parent an uninterrupted run of
the same interval would have named.

`FrozenPolicy` is the model at one state, detached from training: what off-policy stages and data-parallel runs
sample and score with (rl/policy.py decides when).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

from rollout_lib.config.rl import RlConfig
from rollout_lib.store import CHAIN_INDEX_REFS, ObjectStore
from rollout_lib.trainer.base import TrainingInputs
from rollout_lib.trainer.causal import CausalLmTrainer, RecordedBatches
from rollout_lib.trainer.segment import SnapshotSchedule
from rollout_lib.identity.training import training_identity

STEP_STATE_KIND = "rollout.rl.step_state/v1"
logger = logging.getLogger(__name__)


def policy_inputs(store: ObjectStore, config: RlConfig, prompts_ids: dict[str, str]) -> TrainingInputs:
    return TrainingInputs(store, config, training_identity(config),
                          {f"prompts/{env}": prompts_id for env, prompts_id in sorted(prompts_ids.items())})


@dataclass(frozen=True)
class FrozenPolicy:
    """The policy's model at one state, detached from training: what off-policy stages sample and score with."""

    state_id: str
    model: Any
    tokenizer: Any

    @classmethod
    def copy_of(cls, state_id: str, trainer: CausalLmTrainer) -> "FrozenPolicy":
        model = copy.deepcopy(trainer.model).eval()
        model.requires_grad_(False)
        return cls(state_id, model, trainer.tokenizer)


def snapshot_ref(state_id: str, checkpoint_interval: int) -> str:
    """The index entry of a state's checkpoint in runs that snapshot every `checkpoint_interval` steps."""
    return f"{CHAIN_INDEX_REFS}rl-state-{state_id}-every-{checkpoint_interval}"


def snapshot_of_state(store: ObjectStore, state_id: str, checkpoint_interval: int) -> str | None:
    """The checkpoint id that holds a policy state: the state itself for the initial checkpoint, the snapshot
    indexed for the interval for a step record; None when it has none (or the index names one that is gone)."""
    if store.get_json(state_id).get("kind") != STEP_STATE_KIND:
        return state_id
    checkpoint = store.get_ref(snapshot_ref(state_id, checkpoint_interval))
    return checkpoint if checkpoint is not None and store.has(checkpoint) else None


def pending_steps(store: ObjectStore, state_id: str, checkpoint_interval: int) -> tuple[str, dict[int, str]]:
    """(the checkpoint to rebuild `state_id` from, step -> micro-batches id of every step after it): the newest
    state on the chain whose step is on the run's snapshot schedule (a multiple of `checkpoint_interval`) and has a
    checkpoint of that interval, else the initial checkpoint."""
    batches: dict[int, str] = {}
    while True:
        record = store.get_json(state_id)
        if record.get("kind") != STEP_STATE_KIND:
            return state_id, batches
        if SnapshotSchedule(checkpoint_interval).takes(record["step"]):
            checkpoint = snapshot_of_state(store, state_id, checkpoint_interval)
            if checkpoint is not None:
                return checkpoint, batches
        batches[record["step"]] = record["micro_batches"]
        state_id = record["parent"]


def rebuild_policy(inputs: TrainingInputs, state_id: str, data_parallel=None, shard: bool = False) -> CausalLmTrainer:
    """The trainer at `state_id` from the store alone: a checkpoint, then the steps after it replayed (on one rank
    of a data-parallel group, `data_parallel`: replayed by every rank together, as they were trained; `shard`:
    sharded first, as a sharded group trained them)."""
    checkpoint_id, batches = pending_steps(inputs.store, state_id, inputs.config.settings.checkpoint_interval)
    recorded = RecordedBatches(inputs.store, batches)
    if shard:
        trainer = CausalLmTrainer.open_sharded(inputs, checkpoint_id, data_parallel, batches=recorded)
    else:
        trainer = CausalLmTrainer.from_checkpoint(inputs, checkpoint_id, batches=recorded)
        trainer.data_parallel = data_parallel
    if batches:
        logger.info("no resident policy at this state: replaying steps %d..%d from checkpoint %s", min(batches),
                    max(batches), checkpoint_id)
    for step in sorted(batches):
        trainer.train_step(step)
    return trainer


def record_step_state(inputs: TrainingInputs, state_id: str, step: int, micro_batches_id: str) -> str:
    """The id of the state reached by training step `step` from `state_id` on `micro_batches_id` (written)."""
    return inputs.store.put_json({"kind": STEP_STATE_KIND, "parent": state_id, "step": step,
                                  "micro_batches": micro_batches_id, "training_identity": inputs.identity})


def snapshot_state(inputs: TrainingInputs, trainer: CausalLmTrainer, state_id: str, metrics: dict) -> str | None:
    """The checkpoint of `trainer` (at `state_id`) for the run's interval: the one indexed already (then the
    trainer adopts it, so its next checkpoint names it as parent, as a run that wrote it would have), else written
    now (its manifest keeps `metrics`) and indexed. A sharded trainer: every rank calls it (all read the index before
    any writes it: rank 0 writes only after the gathers every rank takes part in); the others get None when it is
    written now."""
    interval = inputs.config.settings.checkpoint_interval
    checkpoint = snapshot_of_state(inputs.store, state_id, interval)
    if checkpoint is None:
        checkpoint = trainer.snapshot(metrics)
        if checkpoint is None:
            return None
        inputs.store.set_ref(snapshot_ref(state_id, interval), checkpoint)
    adopt_snapshot(trainer, checkpoint)
    return checkpoint


def adopt_snapshot(trainer: CausalLmTrainer, checkpoint_id: str) -> None:
    """Make `checkpoint_id` (a checkpoint of the trainer's current weights) the snapshot it descends from."""
    trainer.checkpoint_id, trainer.snapshot_step = checkpoint_id, trainer.step
