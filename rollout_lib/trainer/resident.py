"""The trainer a flow keeps in memory between its tasks, so the next task does not reload it from the store.

A flow creates one `ResidentTrainer`, hands it to its training tasks and closes it when the run ends. It holds at
most one trainer, under the id of the state that trainer is at (a checkpoint id, or an RL pending-step record).
A task that finds no trainer at the state it starts from (a new process after a crash, a rerun) rebuilds it from
the store; the results are the same, only slower.

With off-policy RL steps (`max_off_policy_steps` > 0) a step samples from a state the trainer has already moved
past, while the trainer trains on the next one in another thread: the resident also keeps a few **frozen copies**
of recent states' models (`keep_frozen`, `frozen`), made by the training thread before the trainer moves on, so
the sampling thread never reads weights that are being updated. Frozen copies are guarded by a lock; the trainer
slot is only ever used by the flow's training thread.

It also holds **resources** a trainer needs across tasks and closes them with itself (`resource`): data-parallel
RL's group of training processes (rl/policy_group.py), whose trainer lives outside this process.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Generic, TypeVar

TrainerT = TypeVar("TrainerT")


class ResidentTrainer(Generic[TrainerT]):
    def __init__(self, frozen_capacity: int = 4) -> None:
        self._state_id: str | None = None
        self._trainer: TrainerT | None = None
        self._frozen: OrderedDict[str, Any] = OrderedDict()  # state id -> frozen copy, oldest first
        self._frozen_capacity = frozen_capacity
        self._resources: dict[str, Any] = {}  # name -> something with close()
        self._lock = threading.Lock()

    def get(self, state_id: str) -> TrainerT | None:
        """The trainer if it is at `state_id`, left in place (e.g. to evaluate or sample from it)."""
        return self._trainer if state_id == self._state_id else None

    def pop(self, state_id: str) -> TrainerT | None:
        """The trainer if it is at `state_id`, removed: a step that fails midway never leaves a half-updated
        trainer behind for the next attempt."""
        trainer = self.get(state_id)
        self._state_id = self._trainer = None
        return trainer

    def put(self, state_id: str, trainer: TrainerT) -> None:
        self._state_id, self._trainer = state_id, trainer

    def keep_frozen(self, state_id: str, copy: Any) -> Any:
        """Keep `copy` (a frozen copy of the policy at `state_id`) for the stages that sample from that state;
        the oldest copies beyond the capacity are dropped. Returns the copy kept (an earlier one of the same
        state, if another thread kept one first)."""
        with self._lock:
            kept = self._frozen.setdefault(state_id, copy)
            self._frozen.move_to_end(state_id)
            while len(self._frozen) > self._frozen_capacity:
                self._frozen.popitem(last=False)
            return kept

    def frozen(self, state_id: str) -> Any | None:
        with self._lock:
            return self._frozen.get(state_id)

    def resource(self, name: str, make: Callable[[], Any]) -> Any:
        """The resource kept under `name`, made by `make()` on first use; closed by `close`."""
        with self._lock:
            if name not in self._resources:
                self._resources[name] = make()
            return self._resources[name]

    def close(self) -> None:
        self._state_id = self._trainer = None
        with self._lock:
            self._frozen.clear()
            resources, self._resources = list(self._resources.values()), {}
        for resource in resources:
            resource.close()

    def __enter__(self) -> "ResidentTrainer[TrainerT]":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
