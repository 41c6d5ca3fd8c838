"""Training in segments: a run's optimizer steps cut at its snapshots, each segment a plain torch loop.

A segment starts from a checkpoint, runs its steps in order and ends with a snapshot, so the orchestrator pays
once per segment, not once per step, and a run interrupted inside a segment reruns only that segment from the
checkpoint it started at (replaying it reaches the same weights: training is deterministic on CPU).

Every snapshot is also indexed by (chain, step) in the store (`chains/<identity>-<data>/step-N` refs, the chain
being the training identity and the data it trains on). A segment whose last step is already indexed returns that
checkpoint without training: a run whose snapshot interval changed reuses the steps an earlier run trained.
The index is a cache, not a root: `rollout gc` may drop entries whose objects it deletes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import blake3

from rollout_lib import step_events
from rollout_lib.store import CHAIN_INDEX_REFS, ObjectStore, canonical_json
from rollout_lib.checkpoint import read_manifest

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


@dataclass(frozen=True)
class SnapshotSchedule:
    """When a run writes a checkpoint: after every `interval`-th step and after its last (`total`; None for a chain
    read back, whose last step is not known). The one statement of it: the segments of SFT and RM, the RL steps,
    the plan's `snapshots_at` and a rebuild's search for the newest snapshot (rl/policy_state.py) read it here."""

    interval: int
    total: int | None = None

    def takes(self, step: int) -> bool:
        return step % self.interval == 0 or step == self.total

    def steps(self) -> list[int]:
        return [*range(self.interval, self.total, self.interval), self.total]

    def segments(self) -> list[Segment]:
        """The steps cut at the snapshots: a segment ends at each."""
        ends = self.steps()
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
        step_events.publish(step, metrics)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step %d: %s", step, " ".join(f"{name} {value:.4g}" for name, value in metrics.items()
                                                       if isinstance(value, float)))
    return trainer.snapshot(history[-1], history), history


def chain_ref(identity: str, data_ids: dict[str, str], step: int) -> str:
    """The index entry of a chain's checkpoint at `step`."""
    data = blake3.blake3(canonical_json(data_ids)).hexdigest()
    return f"{CHAIN_INDEX_REFS}{identity[:32]}-{data[:32]}/step-{step:09d}"


def history_since(store: ObjectStore, checkpoint_id: str, first: int) -> list[dict]:
    """The per-step metrics of steps `first`.. up to the checkpoint's step, from its manifest and its parents'
    (timings are not kept in the store, so a reused checkpoint's curve has none)."""
    parts: list[list[dict]] = []
    while checkpoint_id is not None:
        manifest = read_manifest(store, checkpoint_id)
        if manifest["step"] < first:
            break
        parts.append(store.get_json(manifest["history"]) if "history" in manifest else [manifest["metrics"]])
        checkpoint_id = manifest["parent"]
    return [m for part in reversed(parts) for m in part if m.get("step", first) >= first]


def run_segment(store: ObjectStore, identity: str, data_ids: dict[str, str], segment: Segment,
                open_trainer: Callable[[], object],
                train_elsewhere: Callable[[Segment], tuple[str, list[dict]]] | None = None,
                ) -> tuple[str, list[dict], object | None]:
    """The checkpoint at the segment's last step and the segment's per-step metrics: from the chain index when
    an earlier run already trained it, else trained now (`open_trainer()` gives the trainer at the segment's start;
    `train_elsewhere(segment)`, when given, trains it in other processes instead: data parallelism) and indexed.
    Returns (checkpoint id, metrics, the trainer if one was used here, now at the segment's end)."""
    ref = chain_ref(identity, data_ids, segment.last)
    known = store.get_ref(ref)
    if known is not None and store.has(known):
        logger.info("steps %d-%d: checkpoint %s was already trained by an earlier run; reused", segment.first,
                    segment.last, known)
        return known, history_since(store, known, segment.first), None
    if train_elsewhere is not None:
        checkpoint, history = train_elsewhere(segment)
        store.set_ref(ref, checkpoint)
        return checkpoint, history, None
    trainer = open_trainer()
    checkpoint, history = train_segment(trainer, segment)
    store.set_ref(ref, checkpoint)
    return checkpoint, history, trainer
