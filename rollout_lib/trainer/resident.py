"""The trainer a flow keeps in memory between its tasks, so the next task does not reload it from the store.

A flow creates one `ResidentTrainer`, hands it to its training tasks and closes it when the run ends. It holds at
most one trainer, under the id of the state that trainer is at (a checkpoint id, or an RL pending-step record).
A task that finds no trainer at the state it starts from (a new process after a crash, a rerun) rebuilds it from
the store; the results are the same, only slower.
"""

from __future__ import annotations

from typing import Generic, TypeVar

TrainerT = TypeVar("TrainerT")


class ResidentTrainer(Generic[TrainerT]):
    def __init__(self) -> None:
        self._state_id: str | None = None
        self._trainer: TrainerT | None = None

    def get(self, state_id: str) -> TrainerT | None:
        """The trainer if it is at `state_id`, left in place (e.g. to evaluate or sample from it)."""
        return self._trainer if state_id == self._state_id else None

    def pop(self, state_id: str) -> TrainerT | None:
        """The trainer if it is at `state_id`, removed: a step that fails midway never leaves a half-updated
        trainer behind for the next attempt."""
        trainer = self.get(state_id)
        self.close()
        return trainer

    def put(self, state_id: str, trainer: TrainerT) -> None:
        self._state_id, self._trainer = state_id, trainer

    def close(self) -> None:
        self._state_id = self._trainer = None

    def __enter__(self) -> "ResidentTrainer[TrainerT]":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
