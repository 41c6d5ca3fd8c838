"""A policy state of an RL run, as the store records it: a checkpoint, or a pending step on top of one.

RL trains one optimizer step per RL step (the next step samples from its result), and snapshots every
`checkpoint_interval` steps. Between snapshots a policy state is a small *pending-step record* in the store:
(the last checkpoint, the step, the micro-batches it trained on, the previous state). A process that holds no
trainer at a state (a rerun after a crash) rebuilds it from the record chain: load the last checkpoint, replay the
recorded steps. Replay needs no sampling: the micro-batches are in the store.

`FrozenPolicy` is the model at one state, detached from training: what off-policy stages and data-parallel runs
sample and score with (rl/policy.py decides when).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

from rollout_lib.config.rl import RlConfig
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.base import TrainingInputs
from rollout_lib.trainer.causal import CausalLmTrainer, RecordedBatches
from rollout_lib.trainer.identity import training_identity

PENDING_STEP_KIND = "rollout.rl.pending_step/v1"
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


def pending_steps(store: ObjectStore, state_id: str) -> tuple[str, dict[int, str]]:
    """(the checkpoint under `state_id`, step -> micro-batches id of every pending step on top of it)."""
    batches: dict[int, str] = {}
    while True:
        record = store.get_json(state_id)
        if record.get("kind") != PENDING_STEP_KIND:
            return state_id, batches
        batches[record["step"]] = record["micro_batches"]
        state_id = record["parent"]


def rebuild_policy(inputs: TrainingInputs, state_id: str, data_parallel=None) -> CausalLmTrainer:
    """The trainer at `state_id` from the store alone: its checkpoint, then the pending steps replayed (on one rank
    of a data-parallel group, `data_parallel`: replayed by every rank together, as they were trained)."""
    checkpoint_id, batches = pending_steps(inputs.store, state_id)
    trainer = CausalLmTrainer.from_checkpoint(inputs, checkpoint_id, batches=RecordedBatches(inputs.store, batches))
    trainer.data_parallel = data_parallel
    if batches:
        logger.info("no resident policy at this state: replaying steps %d..%d from checkpoint %s", min(batches),
                    max(batches), checkpoint_id)
    for step in sorted(batches):
        trainer.train_step(step)
    return trainer


def record_new_state(inputs: TrainingInputs, trainer: CausalLmTrainer, state_id: str, step: int,
                     micro_batches_id: str, *, snapshot: bool, snapshot_metrics: dict) -> str:
    """The state `trainer` reached by training step `step` from `state_id`, written to the store: a checkpoint
    (`snapshot`; its manifest keeps `snapshot_metrics`) or a pending-step record."""
    if snapshot:
        return trainer.snapshot(snapshot_metrics)
    return inputs.store.put_json({"kind": PENDING_STEP_KIND, "checkpoint": trainer.checkpoint_id, "step": step,
                                  "micro_batches": micro_batches_id, "parent": state_id,
                                  "training_identity": inputs.identity})
