"""One rank of a data-parallel training segment (trainer.data_parallel), as torchrun starts it:

    torchrun --standalone --nproc_per_node N -m rollout_lib.trainer.segment_worker SPEC

SPEC: a pickled data_parallel.SegmentSpec (on another node: `--receive-spec BACKEND`, the spec sent over the group).
Every rank opens the trainer at the segment's start checkpoint from the store (the same weights and optimizer state
everywhere; sharded, rank 0 streams the optimizer state to the others: CheckpointedTrainer.open_sharded) and trains
the segment's steps on its share of each step; rank 0 writes the snapshot, and the reporting rank (the first on the
flow's node) prints each step's metrics (data_parallel.STEP_MARKER) and writes the result file ({"checkpoint",
"history"}) where the flow reads it. On CUDA, rank i computes on the GPU of its local rank (nccl); on CPU, gloo.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from rollout_lib.trainer.data_parallel import (HOLD_AT_STEP_ENV, KILL_RANK_ENV, RECEIVE_SPEC, STEP_MARKER,
                                               DataParallelRank, group_backend)
from rollout_lib.hardware import hardware_settings
from rollout_lib.trainer.segment import TrainStepError


def join_group(argv: list[str] | None) -> tuple[object, DataParallelRank]:
    """(the spec this rank was started with, this rank's place in the process group), the group joined (gloo on
    CPU; on CUDA, nccl with this rank on its local rank's GPU). The flow's node names the pickled spec file on the
    command line; another node's ranks (`RECEIVE_SPEC BACKEND`) receive it from the flow's node over the group,
    whose first rank there reports to the flow (DataParallelRank.reporter)."""
    arguments = argv if argv is not None else sys.argv[1:]
    spec = None
    if arguments[0] == RECEIVE_SPEC:
        cuda = arguments[1] == "nccl"
    else:
        (spec_path,) = arguments
        with open(spec_path, "rb") as spec_file:  # written by the flow for its own children
            spec = pickle.load(spec_file)
        cuda = group_backend(spec.inputs) == "nccl"
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)  # "cuda" (no index) in the settings now means this rank's GPU
    dist.init_process_group("nccl" if cuda else "gloo")
    holders = [None] * world_size
    dist.all_gather_object(holders, spec is not None)
    reporter = holders.index(True)
    if not all(holders):  # other nodes: the spec travels as torch's collectives move any object (a pickle)
        received = [spec]
        dist.broadcast_object_list(received, src=reporter)
        spec = received[0]
    return spec, DataParallelRank(rank, world_size, device, reporter)


@record
def main(argv: list[str] | None = None) -> None:
    spec, data_parallel = join_group(argv)
    rank = data_parallel.rank
    try:
        sharded = hardware_settings(spec.inputs.settings).sharding == "fsdp"
        if sharded:
            trainer = spec.trainer_class.open_sharded(spec.inputs, spec.checkpoint_id, data_parallel, **spec.options)
        else:
            trainer = spec.trainer_class.from_checkpoint(spec.inputs, spec.checkpoint_id, **spec.options)
            trainer.data_parallel = data_parallel
        kill_at = kill_step(rank)
        history = []
        for step in range(spec.first, spec.last + 1):
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            hold_at_step(step)
            try:
                metrics = trainer.train_step(step)
            except Exception as exc:
                raise TrainStepError(f"train step {step} (rank {rank}): {type(exc).__name__}: {exc}") from exc
            history.append(metrics)
            if data_parallel.reports:
                print(STEP_MARKER + json.dumps({"step": step, "metrics": metrics}), flush=True)
        checkpoint = [trainer.snapshot(history[-1], history) if sharded or rank == 0 else None]  # sharded: all gather
        dist.broadcast_object_list(checkpoint, src=0)  # rank 0 wrote it; the reporter may be another rank
        if data_parallel.reports:
            with open(spec.result_path + ".partial", "w") as out:
                json.dump({"checkpoint": checkpoint[0], "history": history}, out)
            os.replace(spec.result_path + ".partial", spec.result_path)
    finally:
        dist.destroy_process_group()


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
