"""The policy's training state across RL steps: a checkpoint, or a pending step on top of one.

RL trains one optimizer step per RL step (the next step samples from its result), and snapshots every
`checkpoint_interval` steps. Between snapshots a policy state is a small *pending-step record* in the store:
(the last checkpoint, the step, the micro-batches it trained on, the previous state). The live trainer stays in
the flow's `ResidentTrainer`; a process that has none at a state (a rerun after a crash) rebuilds it from the
record chain: load the last checkpoint, replay the recorded steps. Replay needs no sampling: the micro-batches
are in the store.
"""

from __future__ import annotations

import logging

from rollout_lib.trainer.identity import training_identity
from rollout_lib.config.rl import RlConfig
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.base import TrainingInputs
from rollout_lib.trainer.causal import CausalLmTrainer, RecordedBatches
from rollout_lib.trainer.resident import ResidentTrainer

PENDING_STEP_KIND = "rollout.rl.pending_step/v1"
logger = logging.getLogger(__name__)


def policy_inputs(store: ObjectStore, config: RlConfig, prompts_ids: dict[str, str]) -> TrainingInputs:
    return TrainingInputs(store, config, training_identity(config),
                          {f"prompts/{env}": prompts_id for env, prompts_id in sorted(prompts_ids.items())})


def initial_policy(inputs: TrainingInputs, resident: ResidentTrainer) -> str:
    """Step 0 snapshotted (the base model, a fresh optimizer), and kept resident for the first sample stage."""
    trainer = CausalLmTrainer.initial(inputs, batches=RecordedBatches(inputs.store))
    resident.put(trainer.checkpoint_id, trainer)
    return trainer.checkpoint_id


def pending_steps(store: ObjectStore, state_id: str) -> tuple[str, dict[int, str]]:
    """(the checkpoint under `state_id`, step -> micro-batches id of every pending step on top of it)."""
    batches: dict[int, str] = {}
    while True:
        record = store.get_json(state_id)
        if record.get("kind") != PENDING_STEP_KIND:
            return state_id, batches
        batches[record["step"]] = record["micro_batches"]
        state_id = record["parent"]


def rebuild_policy(inputs: TrainingInputs, state_id: str) -> CausalLmTrainer:
    """The trainer at `state_id` from the store alone: its checkpoint, then the pending steps replayed."""
    checkpoint_id, batches = pending_steps(inputs.store, state_id)
    trainer = CausalLmTrainer.from_checkpoint(inputs, checkpoint_id, batches=RecordedBatches(inputs.store, batches))
    if batches:
        logger.info("no resident policy at this state: replaying steps %d..%d from checkpoint %s", min(batches),
                    max(batches), checkpoint_id)
    for step in sorted(batches):
        trainer.train_step(step)
    return trainer


def policy_at(inputs: TrainingInputs, state_id: str, resident: ResidentTrainer) -> CausalLmTrainer:
    """The policy at `state_id`, not advanced: the resident one, or rebuilt and made resident."""
    trainer = resident.get(state_id)
    if trainer is None:
        trainer = rebuild_policy(inputs, state_id)
        resident.put(state_id, trainer)
    return trainer


def train_policy_step(inputs: TrainingInputs, state_id: str, step: int, micro_batches_id: str,
                      resident: ResidentTrainer, *, snapshot: bool, snapshot_metrics: dict | None = None
                      ) -> tuple[str, dict]:
    """Train step `step` of the policy at `state_id` on `micro_batches_id`. Returns (the new state: a checkpoint
    id when `snapshot`, else a pending-step record id; the step's metrics). `snapshot_metrics` (the whole step's
    metrics) go into the checkpoint's manifest beside the train metrics."""
    trainer = resident.pop(state_id) or rebuild_policy(inputs, state_id)
    trainer.batches.record(step, micro_batches_id)
    metrics = trainer.train_step(step)
    if snapshot:
        new_state = trainer.snapshot({**(snapshot_metrics or {}), **metrics})
    else:
        new_state = inputs.store.put_json({"kind": PENDING_STEP_KIND, "checkpoint": trainer.checkpoint_id,
                                           "step": step, "micro_batches": micro_batches_id, "parent": state_id,
                                           "training_identity": inputs.identity})
    resident.put(new_state, trainer)
    return new_state, metrics
