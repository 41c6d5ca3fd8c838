"""One rank of SFT's or RM's data-parallel training (trainer/segment_group.py), as torchrun starts it once per run:

    torchrun --standalone --nproc_per_node N -m rollout_lib.trainer.segment_worker SPEC

SPEC: a pickled rank_group.GroupSpec whose `extra` names the trainer class and its options (on another node:
`--receive-spec BACKEND`, the spec sent over the group). The rank joins the group and the flow's socket
(rank_group.serve), then trains each segment it is sent, `{"op": "train", "checkpoint", "first", "last"}`, on its
share of each step. It keeps the trainer between segments; asked for a checkpoint it does not hold, it opens the
trainer there from the store (the same weights and optimizer state everywhere; sharded, rank 0 streams the
optimizer state to the others: CheckpointedTrainer.open_sharded). Rank 0 writes the snapshot; the reporting rank
(the first on the flow's node) sends each step's metrics as an event and answers `{"checkpoint", "history"}`.
On CUDA, rank i computes on the GPU of its local rank (nccl); on CPU, gloo.
"""

from __future__ import annotations

import os
import signal
import time

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from rollout_lib.hardware import hardware_settings
from rollout_lib.trainer.data_parallel import HOLD_AT_STEP_ENV, KILL_RANK_ENV, DataParallelRank
from rollout_lib.trainer.rank_group import Channel, GroupSpec, end_rank, serve
from rollout_lib.trainer.segment import TrainStepError


class SegmentRank:
    """This rank's trainer and the checkpoint it is at; every rank holds the same weights and optimizer state."""

    def __init__(self, spec: GroupSpec, data_parallel: DataParallelRank, channel: Channel):
        self.inputs = spec.inputs
        self.trainer_class = spec.extra["trainer_class"]
        self.options = spec.extra["options"]
        self.data_parallel = data_parallel
        self.channel = channel
        self.sharded = hardware_settings(self.inputs.settings).sharding == "fsdp"
        self.trainer = None
        self.checkpoint_id: str | None = None
        self.kill_at = kill_step(data_parallel.rank)

    def at(self, checkpoint_id: str):
        """The trainer at `checkpoint_id`: the one held, or opened from the store."""
        if checkpoint_id != self.checkpoint_id:
            self.trainer = self.checkpoint_id = None  # a failed open leaves nothing half-built behind
            if self.sharded:
                self.trainer = self.trainer_class.open_sharded(self.inputs, checkpoint_id, self.data_parallel,
                                                               **self.options)
            else:
                self.trainer = self.trainer_class.from_checkpoint(self.inputs, checkpoint_id, **self.options)
                self.trainer.data_parallel = self.data_parallel
            self.checkpoint_id = checkpoint_id
        return self.trainer

    def __call__(self, command: dict) -> dict:
        trainer = self.at(command["checkpoint"])
        self.trainer = self.checkpoint_id = None  # until the segment's snapshot is written
        rank = self.data_parallel.rank
        history = []
        for step in range(command["first"], command["last"] + 1):
            if step == self.kill_at:  # test hook (data_parallel.KILL_RANK_ENV): this rank dies as the step starts
                os.kill(os.getpid(), signal.SIGKILL)
            hold_at_step(step)
            try:
                metrics = trainer.train_step(step)
            except Exception as exc:
                raise TrainStepError(f"train step {step} (rank {rank}): {type(exc).__name__}: {exc}") from exc
            history.append(metrics)
            if self.data_parallel.reports:
                self.channel.event({"step": step, "metrics": metrics})
        checkpoint = [trainer.snapshot(history[-1], history) if self.sharded or rank == 0 else None]  # sharded: all
        dist.broadcast_object_list(checkpoint, src=0)  # rank 0 wrote it; the reporter may be another rank
        # every rank now descends from that snapshot, as a trainer opened there would
        trainer.checkpoint_id, trainer.snapshot_step = checkpoint[0], trainer.step
        self.trainer, self.checkpoint_id = trainer, checkpoint[0]
        return {"checkpoint": checkpoint[0], "history": history}


@record
def main(argv: list[str] | None = None) -> None:
    serve(argv, SegmentRank)


def hold_at_step(step: int) -> None:
    """The test hook data_parallel.HOLD_AT_STEP_ENV = "STEP:PATH": at that step, write PATH and wait to be killed."""
    target = os.environ.get(HOLD_AT_STEP_ENV)
    if target and int(target.partition(":")[0]) == step:
        open(target.partition(":")[2], "a").close()
        while True:
            time.sleep(1)


def kill_step(rank: int) -> int | None:
    """The step this rank SIGKILLs itself at (the test hook data_parallel.KILL_RANK_ENV = "RANK:STEP")."""
    target = os.environ.get(KILL_RANK_ENV)
    if not target:
        return None
    kill_rank, _, step = target.partition(":")
    return int(step) if int(kill_rank) == rank else None


if __name__ == "__main__":
    main()
    end_rank()
