"""Each optimizer step as it completes, for whoever watches a run: the metrics file, the terminal's progress bar.

Trainers and the RL flow `publish(step, metrics)` after every step (inside a segment too, so a step is seen when
it is done, not when its segment's task returns); listeners `subscribe` for the length of a run. Process-wide:
a flow's tasks run in its own process, so a listener the flow (or the CLI that runs it) installs sees every step.
A step replayed after a resume is published again: listeners keep the last value of a step.

A listener that raises is logged and dropped from nothing: watching a run must never fail it.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

log = logging.getLogger(__name__)

Listener = Callable[[int, dict], None]  # (step, that step's metrics)

_listeners: list[Listener] = []
_lock = threading.Lock()


def publish(step: int, metrics: dict) -> None:
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        try:
            listener(step, metrics)
        except Exception:  # noqa: BLE001 - a watcher's failure is not the run's
            log.warning("step listener %r failed at step %d", listener, step, exc_info=True)


@contextmanager
def subscribed(listener: Listener) -> Iterator[Listener]:
    """`with subscribed(fn):` fn sees every step published meanwhile."""
    with _lock:
        _listeners.append(listener)
    try:
        yield listener
    finally:
        with _lock:
            _listeners.remove(listener)
