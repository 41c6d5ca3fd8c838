"""Training state that lives in the process between per-step tasks, recoverable from the store.

A training step consumes a state id and produces one. A state id is either a checkpoint (weights and
optimizer state in the store) or a small "pending" record: (last checkpoint, step). Snapshots are written every
`checkpoint_interval` steps; in between, the live trainer stays in memory. When a step finds no live trainer for
its input state (a new process after a crash or a rerun), it loads the pending record's checkpoint and replays
the steps since, which is at most the work since the last snapshot.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, Protocol

from rollout_lib.store import ObjectStore

PENDING_KIND = "rollout.pending_state/v1"
logger = logging.getLogger(__name__)


class Trainer(Protocol):
    step: int
    checkpoint_id: str | None

    def train_step(self, step: int) -> dict: ...

    def snapshot(self, metrics: dict) -> str: ...


# One live trainer per process is enough: a flow advances a single chain of states.
_LIVE: OrderedDict[str, Trainer] = OrderedDict()


def advance(store: ObjectStore, state_id: str, step: int, *, open_checkpoint: Callable[[str], Trainer],
            identity: dict) -> tuple[str, dict]:
    """Run training step `step` on state `state_id`; return (pending state id, metrics).

    `identity` (settings hash, data ids) goes into the pending record so ids never collide across runs."""
    trainer = _take(store, state_id, open_checkpoint)
    metrics = trainer.train_step(step)
    pending_id = store.put_json({"kind": PENDING_KIND, "base": trainer.checkpoint_id, "step": step, **identity})
    _keep(pending_id, trainer)
    return pending_id, metrics


def snapshot(store: ObjectStore, state_id: str, metrics: dict, *,
             open_checkpoint: Callable[[str], Trainer]) -> str:
    """Write the state's weights and optimizer state to the store; return the checkpoint id."""
    trainer = _take(store, state_id, open_checkpoint)
    checkpoint_id = trainer.snapshot(metrics)
    _keep(checkpoint_id, trainer)
    return checkpoint_id


def hold(store: ObjectStore, state_id: str, open_checkpoint: Callable[[str], Trainer]) -> Trainer:
    """The trainer at `state_id` without advancing it (e.g. to sample from the policy): the live one, or one
    materialised from the store and kept live, so the step that follows does not materialise it again."""
    trainer = _LIVE.get(state_id)
    if trainer is None:
        trainer = materialise(store, state_id, open_checkpoint)
        _keep(state_id, trainer)
    return trainer


def adopt(state_id: str, trainer: Trainer) -> None:
    """Keep a trainer that is already at `state_id` (e.g. just built and snapshotted) for the next step."""
    _keep(state_id, trainer)


def _take(store: ObjectStore, state_id: str, open_checkpoint: Callable[[str], Trainer]) -> Trainer:
    # Popped: a step that fails midway never leaves a half-updated trainer behind for the next attempt.
    trainer = _LIVE.pop(state_id, None)
    return trainer if trainer is not None else materialise(store, state_id, open_checkpoint)


def _keep(state_id: str, trainer: Trainer) -> None:
    _LIVE.clear()
    _LIVE[state_id] = trainer


def materialise(store: ObjectStore, state_id: str, open_checkpoint: Callable[[str], Trainer]) -> Trainer:
    record = store.get_json(state_id)
    if record.get("kind") == PENDING_KIND:
        trainer = open_checkpoint(record["base"])
        logger.info("no live state in this process: replaying steps %d..%d from checkpoint %s",
                    trainer.step + 1, record["step"], record["base"])
        for replay_step in range(trainer.step + 1, record["step"] + 1):
            trainer.train_step(replay_step)
        return trainer
    return open_checkpoint(state_id)


def live_trainer(state_id: str) -> Trainer | None:
    return _LIVE.get(state_id)


def forget_live() -> None:
    _LIVE.clear()
