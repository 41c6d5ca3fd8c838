"""What a run records of its steps while it trains: the metrics file, and TensorBoard when `run.tensorboard` is on.

A flow opens one `RunRecorder` for the run and subscribes `recorder.record` to step_events, so every step lands as
it completes; steps the run reuses without training them (a cached or already-trained segment publishes nothing)
reach it through `backfill`, and held-out evaluation through `annotate`. Recording never fails a run: an error
is logged and the run goes on (the checkpoints, not this history, are what a run is for).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Iterable

from rollout_lib.runlog.metrics_file import MetricsFile
from rollout_lib.runlog.tensorboard import TensorBoardLog, require_tensorboard, tensorboard_dir
from rollout_lib.store import ObjectStore

log = logging.getLogger(__name__)


def _never_fails(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception:  # noqa: BLE001 - a record's failure is not the run's
            log.warning("run %r: recording metrics (%s) failed", self.run_name, method.__name__, exc_info=True)
            return None

    return wrapper


class RunRecorder:
    """``RunRecorder(store, run_name, total_steps=..., tensorboard=...)``; a context manager that closes what it
    opened. ``tensorboard``: True for the run's default directory (runlog.tensorboard), or a directory."""

    def __init__(self, store: ObjectStore, run_name: str, *, total_steps: int | None = None,
                 tensorboard: bool | str | Path = False):
        self.run_name = run_name
        if tensorboard:
            require_tensorboard()  # asked for and missing: the run fails now, before it trains
        self.metrics = self._open_metrics(store, run_name, total_steps)
        self.tensorboard = None
        if tensorboard:
            directory = tensorboard_dir(store, run_name) if tensorboard is True else Path(tensorboard)
            self.tensorboard = TensorBoardLog(directory)

    @_never_fails
    def _open_metrics(self, store: ObjectStore, run_name: str, total_steps: int | None) -> MetricsFile:
        return MetricsFile(store, run_name, total_steps)

    def __enter__(self) -> "RunRecorder":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @_never_fails
    def record(self, step: int, metrics: dict) -> None:
        """A step_events listener: training has (re)done ``step``."""
        if self.metrics is not None:
            self.metrics.record(step, metrics)
        if self.tensorboard is not None:
            self.tensorboard.write(step, metrics)

    @_never_fails
    def backfill(self, history: Iterable[dict]) -> None:
        """Steps the run reused without training them: recorded where missing. TensorBoard gets those the metrics
        file lacked, or all of them when its directory held no events yet (TensorBoard turned on for a run that
        already had steps)."""
        history = list(history)
        added = self.metrics.backfill(history) if self.metrics is not None else history
        if self.tensorboard is not None:
            for metrics in history if not self.tensorboard.had_events else added:
                if metrics["step"] not in self.tensorboard.written:
                    self.tensorboard.write(metrics["step"], metrics)

    @_never_fails
    def annotate(self, step: int, extra: dict) -> None:
        """Add ``extra`` to ``step``'s record: the held-out evaluation of the checkpoint at that step."""
        if not extra:
            return
        if self.metrics is not None:
            self.metrics.annotate(step, extra)
        if self.tensorboard is not None:
            self.tensorboard.annotate(step, extra)

    @_never_fails
    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


def eval_metrics(evaluation: dict | None) -> dict:
    """A held-out evaluation's numbers as ``eval/<name>`` metrics ({} without one)."""
    return {f"eval/{name}": value for name, value in (evaluation or {}).items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}
