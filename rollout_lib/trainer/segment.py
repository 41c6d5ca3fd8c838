"""Training in segments: a run's optimizer steps cut at its snapshots, each segment a plain torch loop.

A segment starts from a checkpoint, runs its steps in order and ends with a snapshot, so the orchestrator pays
once per segment, not once per step, and a run interrupted inside a segment reruns only that segment from the
checkpoint it started at (replaying it reaches the same weights: training is deterministic on CPU).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

# One line per step at DEBUG: off by default (a flow logs once per segment); ROLLOUT_LOG_LEVEL=DEBUG turns it on.
logger = logging.getLogger(__name__)


class TrainStepError(RuntimeError):
    """A step inside a segment failed; the message names the step, and the original error is the cause."""


@dataclass(frozen=True)
class Segment:
    first: int  # first step, 1-based
    last: int  # last step, inclusive; the segment's snapshot is taken after it

    @property
    def steps(self) -> range:
        return range(self.first, self.last + 1)


def plan_segments(total_steps: int, checkpoint_interval: int) -> list[Segment]:
    """Segments ending at every multiple of `checkpoint_interval` and at the last step."""
    ends = [*range(checkpoint_interval, total_steps, checkpoint_interval), total_steps]
    return [Segment(first, last) for first, last in zip([1, *(end + 1 for end in ends[:-1])], ends)]


def train_segment(trainer, segment: Segment) -> tuple[str, list[dict]]:
    """Run the segment's steps on `trainer` (which must be at step `segment.first - 1`), then snapshot.

    Returns (the snapshot's checkpoint id, each step's metrics). A failing step raises TrainStepError naming it;
    the trainer is then at an unknown step and must not be reused."""
    if trainer.step != segment.first - 1:
        raise RuntimeError(f"the trainer is at step {trainer.step}; segment {segment.first}-{segment.last} "
                           f"starts after step {segment.first - 1}")
    history = []
    for step in segment.steps:
        try:
            metrics = trainer.train_step(step)
        except Exception as exc:
            raise TrainStepError(f"train step {step}: {type(exc).__name__}: {exc}") from exc
        history.append(metrics)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step %d: %s", step, " ".join(f"{name} {value:.4g}" for name, value in metrics.items()
                                                       if isinstance(value, float)))
    return trainer.snapshot(history[-1]), history
