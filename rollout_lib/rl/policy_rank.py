"""One rank of data-parallel RL training (rl/policy_group.py), as torchrun starts it:

    torchrun --standalone --nproc_per_node N -m rollout_lib.rl.policy_rank SPEC

SPEC: a pickled policy_group.GroupSpec (on another node: `--receive-spec BACKEND`, the spec sent over the group,
segment_worker.join_group). The rank connects to the flow's socket (on the flow's node), says its rank and presents
the group's secret (`group_secret`), then runs
the flow's commands (one JSON line each, the same to every rank) in lockstep with the others and answers each with
one line: `{"state", "metrics"}` or `{"checkpoint"}` (rank 0's is the one the flow reads), or `{"error"}` before
it exits non-zero, which makes torchrun stop the other ranks. On CUDA, rank i computes on the GPU of its local
rank (nccl); on CPU, gloo.
"""

from __future__ import annotations

import json
import os
import signal
import socket

import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.elastic.multiprocessing.errors import record

from rollout_lib.hardware import hardware_settings
from rollout_lib.rl.policy_group import SECRET_ENV
from rollout_lib.rl.policy_state import adopt_snapshot, rebuild_policy, record_step_state, snapshot_state
from rollout_lib.trainer.data_parallel import DataParallelRank
from rollout_lib.trainer.segment_worker import join_group, kill_step


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


def group_secret(data_parallel: DataParallelRank) -> str:
    """The secret this rank presents to the flow's socket: node 0's torchrun carries it in its environment
    (SECRET_ENV), the reporting rank (on node 0) sends it to every other rank over the group, so other nodes'
    commands need not carry it. Every rank calls this (a collective)."""
    own = os.environ.pop(SECRET_ENV, None)  # out of the environment: no child process inherits it
    held = [own if data_parallel.reports else None]
    dist.broadcast_object_list(held, src=data_parallel.reporter)
    return held[0]


@record
def main(argv: list[str] | None = None) -> None:
    spec, data_parallel = join_group(argv)
    secret = group_secret(data_parallel)
    channel = socket.create_connection((spec.host, spec.port)).makefile("rw", encoding="utf-8")
    try:
        channel.write(json.dumps({"rank": data_parallel.rank, "secret": secret}) + "\n")
        channel.flush()
        policy = PolicyRank(spec.inputs, data_parallel)
        for line in channel:
            command = json.loads(line)
            try:
                if command["op"] == "stop":
                    break
                if command["op"] == "train":
                    reply = policy.train(command)
                elif command["op"] == "snapshot":
                    reply = policy.snapshot(command)
                else:  # "export"
                    policy.at(command["state"])
                    policy.export(command["export"])
                    reply = {"state": command["state"]}
            except Exception as exc:
                where = f"step {command['step']}: " if "step" in command else ""
                channel.write(json.dumps({"error": f"{where}{type(exc).__name__}: {exc}"}) + "\n")
                channel.flush()
                raise
            channel.write(json.dumps(reply) + "\n")
            channel.flush()
    finally:
        channel.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
