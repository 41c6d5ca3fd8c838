"""One rank of data-parallel RL training (rl/policy_group.py), as torchrun starts it:

    torchrun --standalone --nproc_per_node N -m rollout_lib.rl.policy_rank SPEC

SPEC: a pickled rank_group.GroupSpec (on another node: `--receive-spec BACKEND`, the spec sent over the group).
The rank joins the group and the flow's socket (rank_group.serve), then runs the flow's commands (one JSON line
each, the same to every rank) in lockstep with the others and answers each with one line: `{"state", "metrics"}`
or `{"checkpoint"}` (the reporting rank's is the one the flow reads), or `{"error"}` before it exits non-zero,
which makes torchrun stop the other ranks. On CUDA, rank i computes on the GPU of its local
rank (nccl); on CPU, gloo.
"""

from __future__ import annotations

import os
import signal

import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.elastic.multiprocessing.errors import record

from rollout_lib.hardware import hardware_settings
from rollout_lib.rl.policy_state import adopt_snapshot, rebuild_policy, record_step_state, snapshot_state
from rollout_lib.trainer.data_parallel import DataParallelRank
from rollout_lib.trainer.rank_group import end_rank, serve
from rollout_lib.trainer.segment_worker import kill_step


class PolicyRank:
    """This rank's trainer and the state it is at; every rank holds the same weights and optimizer state."""

    def __init__(self, inputs, data_parallel: DataParallelRank):
        self.inputs = inputs
        self.data_parallel = data_parallel
        self.sharded = hardware_settings(inputs.settings).sharding == "fsdp"  # trainer/sharding.py
        self.trainer = None
        self.state_id: str | None = None
        self.kill_at = kill_step(data_parallel.rank)

    def at(self, state_id: str):
        """The trainer at `state_id`: the one held, or rebuilt from the store (its pending steps replayed on every
        rank together, data-parallel, so the replay reaches the bits the first run did)."""
        if state_id != self.state_id:
            self.trainer = self.state_id = None  # a failed rebuild leaves nothing half-built behind
            self.trainer = rebuild_policy(self.inputs, state_id, data_parallel=self.data_parallel,
                                          shard=self.sharded)
            self.state_id = state_id
        return self.trainer

    def train(self, command: dict) -> dict:
        step = command["step"]
        trainer = self.at(command["parent"])
        self.trainer = self.state_id = None  # until the step has finished
        if step == self.kill_at:  # test hook (data_parallel.KILL_RANK_ENV): this rank dies as the step starts
            os.kill(os.getpid(), signal.SIGKILL)
        trainer.batches.record(step, command["micro_batches"])
        metrics = trainer.train_step(step)
        new_state = [None]
        if self.data_parallel.rank == 0:  # one writer
            new_state = [record_step_state(self.inputs, command["parent"], step, command["micro_batches"])]
        dist.broadcast_object_list(new_state, src=0)
        self.trainer, self.state_id = trainer, new_state[0]
        self.export(command["export"])
        return {"state": self.state_id, "metrics": metrics}

    def snapshot(self, command: dict) -> dict:
        """Rank 0 checkpoints the state (or finds it indexed; sharded, every rank takes part in writing it); every
        rank adopts that checkpoint."""
        trainer = self.at(command["state"])
        checkpoint = [None]
        if self.sharded or self.data_parallel.rank == 0:  # sharded: every rank takes part in writing it
            written = snapshot_state(self.inputs, trainer, command["state"], command["metrics"])
            if self.data_parallel.rank == 0:
                checkpoint = [written]
        dist.broadcast_object_list(checkpoint, src=0)
        adopt_snapshot(trainer, checkpoint[0])
        return {"checkpoint": checkpoint[0]}

    def export(self, path: str) -> None:
        """The reporting rank (on the flow's node) writes the weights of the state held (safetensors, tied duplicates
        left out; sharded: gathered whole to it first, every rank taking part)."""
        weights = self.trainer.weights_for_export(self.data_parallel.reporter)
        if self.data_parallel.reports:
            save_file(weights, path + ".partial", {"format": "pt"})
            os.replace(path + ".partial", path)
        dist.barrier()


    def __call__(self, command: dict) -> dict:
        if command["op"] == "train":
            return self.train(command)
        if command["op"] == "snapshot":
            return self.snapshot(command)
        self.at(command["state"])  # "export"
        self.export(command["export"])
        return {"state": command["state"]}


@record
def main(argv: list[str] | None = None) -> None:
    serve(argv, lambda spec, data_parallel, channel: PolicyRank(spec.inputs, data_parallel))


if __name__ == "__main__":
    main()
    end_rank()
