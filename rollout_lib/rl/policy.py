"""The policy's training state across RL steps: a checkpoint, or a pending step on top of one.

RL trains one optimizer step per RL step (the next step samples from its result), and snapshots every
`checkpoint_interval` steps. Between snapshots a policy state is a small *pending-step record* in the store:
(the last checkpoint, the step, the micro-batches it trained on, the previous state). The live trainer stays in
the flow's `ResidentTrainer`; a process that has none at a state (a rerun after a crash) rebuilds it from the
record chain: load the last checkpoint, replay the recorded steps. Replay needs no sampling: the micro-batches
are in the store.

Off-policy steps (`max_off_policy_steps = k > 0`): step n samples from the state of step n-1-k while the trainer
trains step n-1 in the flow's main thread. Those stages read a `FrozenPolicy`, a copy of the model at that state
(`sampling_policy`), never the live trainer: the training thread keeps a copy of every state it produces before
it moves on (`train_policy_step`), and a stage that finds none (a rerun) rebuilds one from the store.

Data-parallel training (`hardware.nproc = N > 1`): the trainer lives in N torchrun processes for the whole run
(rl/policy_group.py), which train each step and write its new state; this process keeps only frozen copies of the
states, loaded from the weights the group exports, and samples, scores and evaluates with those.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any


from rollout_lib.config.common import hardware_settings
from rollout_lib.config.rl import RlConfig
from rollout_lib.rl.policy_group import PolicyGroup
from rollout_lib.trainer.identity import training_identity
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.base import TrainingInputs
from rollout_lib.trainer.causal import CausalLmTrainer, RecordedBatches
from rollout_lib.trainer.resident import ResidentTrainer

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


def off_policy_steps(inputs: TrainingInputs) -> int:
    return inputs.config.settings.max_off_policy_steps


def data_parallel_processes(inputs: TrainingInputs) -> int:
    """How many processes train the policy: above 1, a PolicyGroup's (this process holds frozen copies only)."""
    return hardware_settings(inputs.settings).nproc


def policy_group(inputs: TrainingInputs, resident: ResidentTrainer) -> PolicyGroup:
    """The run's data-parallel processes, kept (and closed) by the flow's resident."""
    return resident.resource("policy_group", lambda: PolicyGroup(inputs, data_parallel_processes(inputs)))


def initial_policy(inputs: TrainingInputs, resident: ResidentTrainer) -> str:
    """Step 0 snapshotted (the base model, a fresh optimizer), and kept resident for the first sample stage."""
    trainer = CausalLmTrainer.initial(inputs, batches=RecordedBatches(inputs.store))
    if data_parallel_processes(inputs) > 1:  # the group opens it from the store; sampling reads a frozen copy
        resident.keep_frozen(trainer.checkpoint_id, FrozenPolicy.copy_of(trainer.checkpoint_id, trainer))
        return trainer.checkpoint_id
    resident.put(trainer.checkpoint_id, trainer)
    if off_policy_steps(inputs):
        resident.keep_frozen(trainer.checkpoint_id, FrozenPolicy.copy_of(trainer.checkpoint_id, trainer))
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


def policy_at(inputs: TrainingInputs, state_id: str, resident: ResidentTrainer) -> CausalLmTrainer:
    """The policy at `state_id`, not advanced: the resident one, or rebuilt and made resident (data-parallel
    training: a frozen copy, as `sampling_policy`)."""
    if data_parallel_processes(inputs) > 1:
        return sampling_policy(inputs, state_id, resident)
    trainer = resident.get(state_id)
    if trainer is None:
        trainer = rebuild_policy(inputs, state_id)
        resident.put(state_id, trainer)
    return trainer


def sampling_policy(inputs: TrainingInputs, state_id: str, resident: ResidentTrainer):
    """The policy a stage samples (or scores behaviour logprobs) with at `state_id`: something with `.model` and
    `.tokenizer`. Synchronous runs use the resident trainer itself; off-policy runs a FrozenPolicy (kept by the
    training thread, or rebuilt here from the store without touching the resident trainer, which the training
    thread may be updating). Data-parallel training: always a FrozenPolicy, from the group's export when missing."""
    data_parallel = data_parallel_processes(inputs) > 1
    if not off_policy_steps(inputs) and not data_parallel:
        return policy_at(inputs, state_id, resident)
    frozen = resident.frozen(state_id)
    if frozen is None and data_parallel:
        group = policy_group(inputs, resident)
        frozen = resident.keep_frozen(state_id, group.frozen_copy(state_id, group.export(state_id)))
    elif frozen is None:
        frozen = resident.keep_frozen(state_id, FrozenPolicy.copy_of(state_id, rebuild_policy(inputs, state_id)))
    return frozen


def train_policy_step(inputs: TrainingInputs, state_id: str, step: int, micro_batches_id: str,
                      resident: ResidentTrainer, *, snapshot: bool, snapshot_metrics: dict | None = None
                      ) -> tuple[str, dict]:
    """Train step `step` of the policy at `state_id` on `micro_batches_id`. Returns (the new state: a checkpoint
    id when `snapshot`, else a pending-step record id; the step's metrics). `snapshot_metrics` (the whole step's
    metrics) go into the checkpoint's manifest beside the train metrics."""
    if data_parallel_processes(inputs) > 1:
        group = policy_group(inputs, resident)
        new_state, metrics, weights = group.train(state_id, step, micro_batches_id, snapshot=snapshot,
                                                  snapshot_metrics=snapshot_metrics)
        resident.keep_frozen(new_state, group.frozen_copy(new_state, weights))
        return new_state, metrics
    trainer = resident.pop(state_id) or rebuild_policy(inputs, state_id)
    trainer.batches.record(step, micro_batches_id)
    metrics = trainer.train_step(step)
    new_state = record_new_state(inputs, trainer, state_id, step, micro_batches_id, snapshot=snapshot,
                                 snapshot_metrics={**(snapshot_metrics or {}), **metrics})
    if off_policy_steps(inputs):
        # Before the trainer moves on: the later steps that sample from this state read this copy.
        resident.keep_frozen(new_state, FrozenPolicy.copy_of(new_state, trainer))
    resident.put(new_state, trainer)
    return new_state, metrics


def record_new_state(inputs: TrainingInputs, trainer: CausalLmTrainer, state_id: str, step: int,
                     micro_batches_id: str, *, snapshot: bool, snapshot_metrics: dict) -> str:
    """The state `trainer` reached by training step `step` from `state_id`, written to the store: a checkpoint
    (`snapshot`; its manifest keeps `snapshot_metrics`) or a pending-step record."""
    if snapshot:
        return trainer.snapshot(snapshot_metrics)
    return inputs.store.put_json({"kind": PENDING_STEP_KIND, "checkpoint": trainer.checkpoint_id, "step": step,
                                  "micro_batches": micro_batches_id, "parent": state_id,
                                  "training_identity": inputs.identity})
