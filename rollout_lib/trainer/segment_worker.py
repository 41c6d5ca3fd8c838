"""One rank of a data-parallel training segment (trainer.data_parallel), as torchrun starts it:

    torchrun --standalone --nproc_per_node N -m rollout_lib.trainer.segment_worker SPEC

SPEC: a pickled data_parallel.SegmentSpec. Every rank opens the trainer at the segment's start checkpoint from the
store (the same weights and optimizer state everywhere), trains the segment's steps on its share of each step,
and rank 0 prints each step's metrics (data_parallel.STEP_MARKER), writes the snapshot and the result file
({"checkpoint", "history"}). On CUDA, rank i computes on the GPU of its local rank (nccl); on CPU, gloo.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from rollout_lib.trainer.data_parallel import KILL_RANK_ENV, STEP_MARKER, DataParallel
from rollout_lib.hardware import hardware_of_config, hardware_settings
from rollout_lib.trainer.segment import TrainStepError


def join_group(argv: list[str] | None) -> tuple[object, DataParallel]:
    """(the spec this rank was started with: the pickled file torchrun's command line names, this rank's place in
    the process group), the group joined (gloo on CPU; on CUDA, nccl with this rank on its local rank's GPU)."""
    (spec_path,) = argv if argv is not None else sys.argv[1:]
    with open(spec_path, "rb") as spec_file:
        spec = pickle.load(spec_file)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = hardware_of_config(spec.inputs.config).device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)  # "cuda" (no index) in the settings now means this rank's GPU
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return spec, DataParallel(rank, world_size, device)


@record
def main(argv: list[str] | None = None) -> None:
    spec, data_parallel = join_group(argv)
    rank = data_parallel.rank
    try:
        trainer = spec.trainer_class.from_checkpoint(spec.inputs, spec.checkpoint_id, **spec.options)
        trainer.data_parallel = data_parallel
        sharded = hardware_settings(spec.inputs.settings).sharding == "fsdp"
        if sharded:
            trainer.shard()
        kill_at = kill_step(rank)
        history = []
        for step in range(spec.first, spec.last + 1):
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                metrics = trainer.train_step(step)
            except Exception as exc:
                raise TrainStepError(f"train step {step} (rank {rank}): {type(exc).__name__}: {exc}") from exc
            history.append(metrics)
            if rank == 0:
                print(STEP_MARKER + json.dumps({"step": step, "metrics": metrics}), flush=True)
        checkpoint = trainer.snapshot(history[-1], history) if sharded or rank == 0 else None  # sharded: all gather
        if rank == 0:
            with open(spec.result_path + ".partial", "w") as out:
                json.dump({"checkpoint": checkpoint, "history": history}, out)
            os.replace(spec.result_path + ".partial", spec.result_path)
    finally:
        dist.destroy_process_group()


def kill_step(rank: int) -> int | None:
    """The step this rank SIGKILLs itself at (the test hook data_parallel.KILL_RANK_ENV = "RANK:STEP")."""
    target = os.environ.get(KILL_RANK_ENV)
    if not target:
        return None
    kill_rank, _, step = target.partition(":")
    return int(step) if int(kill_rank) == rank else None


if __name__ == "__main__":
    main()
