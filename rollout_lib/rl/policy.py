"""Where the policy's trainer lives during an RL run, and what the other stages read it through: three modes
behind one interface, picked once per run from its settings (`policy_mode`).

    InProcess           k = 0, one process: the flow's ResidentTrainer holds the trainer; sampling, the
                        behaviour logprobs and evaluation read the trainer itself (nothing else changes it then).
    InProcessFrozen     k > 0, one process: step n samples from the state of step n-1-k while the trainer trains
                        step n-1 in the flow's main thread (rl/schedule.py), so those stages read a FrozenPolicy,
                        a copy of the model at that state, never the live trainer: the training thread keeps a
                        copy of every state it produces before it moves on, and a stage that finds none (a rerun)
                        rebuilds one from the store.
    InPolicyGroup       N = nproc x nnodes > 1: the trainer lives in N torchrun processes for the whole run
                        (rl/policy_group.py), which train each step and write its new state; this process keeps
                        only frozen copies of the states, loaded from the weights the group exports.

States are the initial checkpoint or step records, snapshots a checkpoint indexed under a state
(rl/policy_state.py); a process with nothing resident at a state rebuilds it from the store, bit for bit.
"""

from __future__ import annotations

from rollout_lib.hardware import hardware_settings
from rollout_lib.rl.policy_group import PolicyGroup
from rollout_lib.rl.policy_state import (  # noqa: F401  (re-exported: the API of a run's policy)
    STEP_STATE_KIND,
    FrozenPolicy,
    pending_steps,
    policy_inputs,
    rebuild_policy,
    record_step_state,
    snapshot_of_state,
    snapshot_state,
)
from rollout_lib.trainer.base import TrainingInputs
from rollout_lib.trainer.causal import CausalLmTrainer, RecordedBatches
from rollout_lib.trainer.resident import ResidentTrainer


class InProcess:
    """k = 0, one process: the resident trainer is the policy every stage reads."""

    def initial(self, inputs: TrainingInputs, resident: ResidentTrainer) -> str:
        """Step 0 snapshotted (the base model, a fresh optimizer), and kept resident for the first sample stage."""
        trainer = CausalLmTrainer.initial(inputs, batches=RecordedBatches(inputs.store))
        resident.put(trainer.checkpoint_id, trainer)
        self._keep(trainer.checkpoint_id, trainer, resident)
        return trainer.checkpoint_id

    def at(self, inputs: TrainingInputs, state_id: str, resident: ResidentTrainer):
        """The policy at `state_id`, not advanced: the resident trainer, or rebuilt and made resident."""
        trainer = resident.get(state_id)
        if trainer is None:
            trainer = rebuild_policy(inputs, state_id)
            resident.put(state_id, trainer)
        return trainer

    def for_sampling(self, inputs: TrainingInputs, state_id: str, resident: ResidentTrainer):
        """What a stage samples (or scores behaviour logprobs) with at `state_id`: something with `.model` and
        `.tokenizer`."""
        return self.at(inputs, state_id, resident)

    def train(self, inputs: TrainingInputs, state_id: str, step: int, micro_batches_id: str,
              resident: ResidentTrainer) -> tuple[str, dict]:
        trainer = resident.pop(state_id) or rebuild_policy(inputs, state_id)
        trainer.batches.record(step, micro_batches_id)
        metrics = trainer.train_step(step)
        new_state = record_step_state(inputs, state_id, step, micro_batches_id)
        self._keep(new_state, trainer, resident)
        resident.put(new_state, trainer)
        return new_state, metrics

    def snapshot(self, inputs: TrainingInputs, state_id: str, resident: ResidentTrainer, metrics: dict) -> str:
        indexed = snapshot_of_state(inputs.store, state_id, inputs.config.settings.checkpoint_interval)
        if indexed is not None and resident.get(state_id) is None:
            return indexed  # nothing resident to tell about it: a rebuild finds it in the index
        return snapshot_state(inputs, self.at(inputs, state_id, resident), state_id, metrics)

    def _keep(self, state_id: str, trainer: CausalLmTrainer, resident: ResidentTrainer) -> None:
        """Nothing: no stage reads a state the trainer has moved past."""


class InProcessFrozen(InProcess):
    """k > 0, one process: stages read frozen copies, made before the trainer moves on."""

    def for_sampling(self, inputs: TrainingInputs, state_id: str, resident: ResidentTrainer):
        frozen = resident.frozen(state_id)
        if frozen is None:  # a rerun: rebuilt from the store without touching the resident trainer, which the
            # training thread may be updating
            frozen = resident.keep_frozen(state_id, FrozenPolicy.copy_of(state_id, rebuild_policy(inputs, state_id)))
        return frozen

    def _keep(self, state_id: str, trainer: CausalLmTrainer, resident: ResidentTrainer) -> None:
        resident.keep_frozen(state_id, FrozenPolicy.copy_of(state_id, trainer))


class InPolicyGroup:
    """nproc x nnodes > 1: the trainer lives in the run's PolicyGroup; this process holds frozen copies only."""

    def group(self, inputs: TrainingInputs, resident: ResidentTrainer) -> PolicyGroup:
        """The run's data-parallel processes, kept (and closed) by the flow's resident."""
        return resident.resource("policy_group", lambda: PolicyGroup(inputs))

    def initial(self, inputs: TrainingInputs, resident: ResidentTrainer) -> str:
        trainer = CausalLmTrainer.initial(inputs, batches=RecordedBatches(inputs.store))
        # the group opens it from the store; sampling reads a frozen copy
        resident.keep_frozen(trainer.checkpoint_id, FrozenPolicy.copy_of(trainer.checkpoint_id, trainer))
        return trainer.checkpoint_id

    def at(self, inputs: TrainingInputs, state_id: str, resident: ResidentTrainer):
        return self.for_sampling(inputs, state_id, resident)

    def for_sampling(self, inputs: TrainingInputs, state_id: str, resident: ResidentTrainer):
        frozen = resident.frozen(state_id)
        if frozen is None:  # a rerun: the group exports the state (rebuilding it from the store if it must)
            group = self.group(inputs, resident)
            frozen = resident.keep_frozen(state_id, group.frozen_copy(state_id, group.export(state_id)))
        return frozen

    def train(self, inputs: TrainingInputs, state_id: str, step: int, micro_batches_id: str,
              resident: ResidentTrainer) -> tuple[str, dict]:
        group = self.group(inputs, resident)
        new_state, metrics, weights = group.train(state_id, step, micro_batches_id)
        resident.keep_frozen(new_state, group.frozen_copy(new_state, weights))
        return new_state, metrics

    def snapshot(self, inputs: TrainingInputs, state_id: str, resident: ResidentTrainer, metrics: dict) -> str:
        return self.group(inputs, resident).snapshot(state_id, metrics)


def policy_mode(inputs: TrainingInputs) -> InProcess | InPolicyGroup:
    """The run's mode, from its settings: data-parallel processes, else in process (with frozen copies if k > 0)."""
    if hardware_settings(inputs.settings).world_size > 1:
        return InPolicyGroup()
    return InProcessFrozen() if inputs.config.settings.max_off_policy_steps else InProcess()


# --- the run's policy, whatever its mode (what tasks/rl.py calls) ------------------------------------------------


def initial_policy(inputs: TrainingInputs, resident: ResidentTrainer) -> str:
    """Step 0 snapshotted (the base model, a fresh optimizer); its checkpoint id."""
    return policy_mode(inputs).initial(inputs, resident)


def policy_at(inputs: TrainingInputs, state_id: str, resident: ResidentTrainer):
    """The policy at `state_id`, not advanced (something with `.model` and `.tokenizer`)."""
    return policy_mode(inputs).at(inputs, state_id, resident)


def sampling_policy(inputs: TrainingInputs, state_id: str, resident: ResidentTrainer):
    """The policy a stage samples (or scores behaviour logprobs) with at `state_id`."""
    return policy_mode(inputs).for_sampling(inputs, state_id, resident)


def train_policy_step(inputs: TrainingInputs, state_id: str, step: int, micro_batches_id: str,
                      resident: ResidentTrainer) -> tuple[str, dict]:
    """Train step `step` of the policy at `state_id` on `micro_batches_id`: (the new state's id, a step record;
    the step's metrics)."""
    return policy_mode(inputs).train(inputs, state_id, step, micro_batches_id, resident)


def snapshot_policy(inputs: TrainingInputs, state_id: str, resident: ResidentTrainer, metrics: dict) -> str:
    """The checkpoint of the policy at `state_id`: the one indexed already, else written now (its manifest keeps
    `metrics`, the step's) and indexed."""
    return policy_mode(inputs).snapshot(inputs, state_id, resident, metrics)
