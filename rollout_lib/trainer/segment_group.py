"""SFT's and RM's data-parallel training: one group of ranks for the whole run, a command per segment (issue 44).

A data-parallel run (hardware.nproc > 1 or nnodes > 1) used to start a torchrun per segment, each rank importing
torch and transformers and rebuilding the trainer from the store, and on several nodes a rendezvous per segment.
Now the run's first segment starts a `SegmentGroup` (trainer/rank_group.py; ranks: trainer/segment_worker.py),
kept in the flow's resident (trainer/resident.py `resource`) and stopped with it when the flow ends, failed or not.
Each segment is one command, `{"op": "train", "checkpoint", "first", "last"}`: the ranks keep the trainer in memory
between segments and rebuild it from the store only when asked for a checkpoint they do not hold (a rerun, a
segment after cached ones, after a failure), so the checkpoints are the ones a torchrun per segment wrote, byte for
byte. The reporting rank sends each finished step as an event, published (step_events) as it arrives.

A rank that dies fails the segment naming its steps and the rank; the group is gone, and the next command starts a
new one (a rerun trains the segment again from its start checkpoint in the store).
"""

from __future__ import annotations

from collections.abc import Callable

from rollout_lib import step_events
from rollout_lib.hardware import hardware_settings
from rollout_lib.trainer.node_parts import NodeLauncher
from rollout_lib.trainer.rank_group import GroupKind, RankGroup

SEGMENT_RANKS = GroupKind(module="rollout_lib.trainer.segment_worker", label="data-parallel segment",
                          name="training group")
RESOURCE = "segment_group"  # its name in the flow's resident


class SegmentGroup:
    """The run's data-parallel ranks of `trainer_class` (started at the first segment) and its segments."""

    def __init__(self, trainer_class: type, inputs, options: dict | None = None,
                 announce: NodeLauncher | Callable | None = None, nproc: int | None = None):
        self.ranks = RankGroup(inputs, SEGMENT_RANKS, {"trainer_class": trainer_class, "options": options or {}},
                               announce, nproc=nproc)

    @property
    def starts(self) -> int:
        """How many times this group started torchrun (once per run, unless a rank failed)."""
        return self.ranks.starts

    def train(self, checkpoint_id: str, first: int, last: int) -> tuple[str, list[dict]]:
        """Steps first..last from `checkpoint_id`, then a snapshot: (its checkpoint id, per-step metrics)."""
        rerun = f"the segment's start checkpoint is in the store, so a rerun trains steps {first}-{last} again from it"
        reply = self.ranks.command(
            f"train steps {first}-{last}", {"op": "train", "checkpoint": checkpoint_id, "first": first, "last": last},
            rerun, on_event=lambda event: step_events.publish(event["step"], event["metrics"]))
        return reply["checkpoint"], reply["history"]

    def close(self) -> None:
        self.ranks.close()


def run_segment_in_processes(trainer_class: type, inputs, checkpoint_id: str, first: int, last: int, nproc: int,
                             announce: NodeLauncher | Callable | None = None, **options) -> tuple[str, list[dict]]:
    """One segment in a group of its own (`nproc` ranks per node), stopped after it: (checkpoint id, metrics)."""
    group = SegmentGroup(trainer_class, inputs, options, announce, nproc=nproc)
    try:
        return group.train(checkpoint_id, first, last)
    finally:
        group.close()


def data_parallel_segment(trainer_class: type, inputs, checkpoint_id: str, resident, **options):
    """For `segment.run_segment(train_elsewhere=...)`: None when the entry point's hardware says one process, else
    a function training a segment in the run's SegmentGroup from `checkpoint_id` (the group kept by `resident`,
    the flow's, and closed with it). A resident trainer at that checkpoint is dropped (the ranks hold their own)."""
    if hardware_settings(inputs.settings).world_size == 1:
        return None

    def train(segment) -> tuple[str, list[dict]]:
        resident.pop(checkpoint_id)
        group = resident.resource(RESOURCE, lambda: SegmentGroup(trainer_class, inputs, options))
        return group.train(checkpoint_id, segment.first, segment.last)

    return train
