"""Data-parallel RL training: the policy's trainer lives in N torchrun processes for the whole run.

RL trains one optimizer step per RL step, and the next step samples from its result, so a process per step (what
train-sft and train-rm once did per segment) would pay torchrun's start and a rebuild of the
trainer every step. Here the ranks start once, on the first train step, and stay:

    flow process                                  torchrun --standalone --nproc_per_node N
    (samples, scores, evaluates with a frozen       -m rollout_lib.rl.policy_rank SPEC
     copy of each state; writes nothing it          rank r: the trainer (weights + optimizer state) at the
     did not compute)                                 current state; trains its share of each step's micro-
           |  one JSON line per command, to every     batches (trainer.data_parallel: counts and gradients
           |  rank (a socket each);                   summed over the ranks); rank 0 writes the new state
           |  rank 0's reply carries the result       (a pending-step record or a snapshot) to the store, the
           v                                          reporting rank the weights file the flow loads its
                                                      frozen copy from

The group itself (torchrun's start, the secret handshake on the flow's socket, the command channel, the other
nodes' parts with hardware.nnodes > 1, which rank failed) is trainer/rank_group.py's `RankGroup`, shared with SFT's
and RM's segment group (trainer/segment_group.py). The store is the only thing the nodes share.

Commands: `train` (step n from a parent state: the ranks rebuild that state from the store first if they are
elsewhere, replaying its steps data-parallel, so the bits match the first time), `snapshot` (rank 0 checkpoints a
state), `export` (the weights of a state the flow has no copy of: after a crash, a rerun) and `stop`. The flow
process holds no trainer, only frozen copies (rl/policy_state.py `FrozenPolicy`) built from the exported files, bit
for bit what the ranks trained.

A rank that fails (an exception, SIGKILL) makes torchrun stop the others; the command then raises
DataParallelError naming the step and the rank, the group is gone, and the next command (a rerun's) starts a new
one, which rebuilds the state it is asked for from the store.
"""

from __future__ import annotations

import copy
import itertools
import os
from collections.abc import Callable

from safetensors.torch import load_file

from rollout_lib.rl.policy_state import FrozenPolicy
from rollout_lib.trainer.base import TrainingInputs
from rollout_lib.trainer.causal import CausalLmTrainer
from rollout_lib.checkpoint import load_model_weights
from rollout_lib.trainer.node_parts import NodeLauncher
from rollout_lib.trainer.rank_group import GroupKind, RankGroup
from rollout_lib.determinism import GLOBAL_RNG

POLICY_RANKS = GroupKind(module="rollout_lib.rl.policy_rank", label="data-parallel policy training",
                         name="policy group")
# What a failed command's error says a rerun does.
RERUN = "the steps before it are in the store, so a rerun trains from the last of them"


class PolicyGroup:
    """The N processes training the policy (started on first use), and the flow's side of their commands."""

    def __init__(self, inputs: TrainingInputs, announce: NodeLauncher | Callable | None = None):
        self.inputs = inputs
        self.ranks = RankGroup(inputs, POLICY_RANKS, announce=announce)
        self._skeleton = None  # a model to copy frozen copies from (the trainer's build, weights replaced)
        self._exports = itertools.count(1)  # next() is atomic: two threads never get one file name

    # --- the commands -----------------------------------------------------------------------------------------

    def train(self, parent: str, step: int, micro_batches_id: str) -> tuple[str, dict, str]:
        """Step `step` from state `parent`. Returns (the new state's id, the step's metrics, the weights file of
        the new state, for `frozen_copy`)."""
        path = self._export_path()
        reply = self._command(f"train step {step}", {
            "op": "train", "parent": parent, "step": step, "micro_batches": micro_batches_id, "export": path})
        return reply["state"], reply["metrics"], path

    def snapshot(self, state_id: str, metrics: dict) -> str:
        """The checkpoint of `state_id` (rank 0 writes it, or finds it indexed; every rank adopts it)."""
        return self._command(f"snapshot of state {state_id}", {"op": "snapshot", "state": state_id,
                                                                "metrics": metrics})["checkpoint"]

    def export(self, state_id: str) -> str:
        """The weights file of `state_id` (the ranks rebuild it from the store when they are elsewhere)."""
        path = self._export_path()
        self._command(f"export of state {state_id}", {"op": "export", "state": state_id, "export": path})
        return path

    def frozen_copy(self, state_id: str, weights_path: str):
        """A FrozenPolicy of `state_id` from its exported weights file (deleted once loaded)."""
        if self._skeleton is None:
            with GLOBAL_RNG:  # build seeds the RNG: never while another thread trains or samples
                model, tokenizer, _ = CausalLmTrainer.build(self.inputs)
            self._skeleton = FrozenPolicy(state_id, model.eval().requires_grad_(False), tokenizer)
        model = copy.deepcopy(self._skeleton.model)
        try:
            load_model_weights(model, load_file(weights_path, device=str(next(model.parameters()).device)))
        finally:
            os.unlink(weights_path)
        return FrozenPolicy(state_id, model, self._skeleton.tokenizer)

    def close(self) -> None:
        self.ranks.close()

    def _export_path(self) -> str:
        return os.path.join(self.ranks.workdir, f"weights-{next(self._exports)}.safetensors")

    def _command(self, what: str, command: dict) -> dict:
        return self.ranks.command(what, command, RERUN)
