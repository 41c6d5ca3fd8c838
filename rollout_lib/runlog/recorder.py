"""What a run records of its steps while it trains: the metrics file, TensorBoard when `run.tensorboard` is on, and
the experiment trackers of `run.trackers` (runlog/trackers/: each on a thread of its own, never in the loop's way).

A flow opens one `RunRecorder` for the run and subscribes `recorder.record` to step_events, so every step lands as
it completes; steps the run reuses without training them (a cached or already-trained segment publishes nothing)
reach it through `backfill`, and held-out evaluation through `annotate`. Recording never fails a run: an error
is logged and the run goes on (the checkpoints, not this history, are what a run is for).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from rollout_lib.runlog.metrics_file import MetricsFile
from rollout_lib.runlog.tensorboard import TensorBoardLog, require_tensorboard, tensorboard_dir
from rollout_lib.store import ObjectStore

if TYPE_CHECKING:
    from rollout_lib.runlog.trackers.thread import TrackerThread

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
    """``RunRecorder(store, run_name, total_steps=..., tensorboard=..., trackers=...)``; a context manager that closes
    what it opened. ``tensorboard``: True for the run's default directory (runlog.tensorboard), or a directory.
    ``trackers``: started tracker threads (runlog/trackers/build.py), closed with the recorder; each RL step's
    samples go to them too, at most ``tracker_samples`` rows a step (0: a run without samples, RM and SFT)."""

    def __init__(self, store: ObjectStore, run_name: str, *, total_steps: int | None = None,
                 tensorboard: bool | str | Path = False, trackers: Sequence["TrackerThread"] = (),
                 tracker_samples: int = 0):
        self.run_name = run_name
        self.store = store
        self.trackers = list(trackers)
        self.tracker_samples = tracker_samples
        self._finished = False  # `finish` said how the run ended; an error leaving the block says otherwise
        # The training loop's own time spent handing steps to the trackers (bench/bench_trackers.py reads it from
        # the closing debug line): with the tracker threads' CPU, what the trackers cost the loop at most.
        self.tracking_seconds, self.tracked_steps = 0.0, 0
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

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is not None and not self._finished:
            self._run_failed(f"{exc_type.__name__}: {exc}")
        self.close()

    @_never_fails
    def _run_failed(self, error: str) -> None:
        for tracker in self.trackers:
            tracker.run_failed(error)

    @_never_fails
    def record(self, step: int, metrics: dict) -> None:
        """A step_events listener: training has (re)done ``step``."""
        if self.metrics is not None:
            self.metrics.record(step, metrics)
        if self.tensorboard is not None:
            self.tensorboard.write(step, metrics)
        self._track(step, metrics)

    def _track(self, step: int, metrics: dict) -> None:
        if not self.trackers:
            return
        began = time.perf_counter()
        from rollout_lib.runlog.trackers.sample_table import step_sample_table

        for tracker in self.trackers:
            tracker.metrics(step, metrics)
            if self.tracker_samples:  # a look for a step's tables costs ~0.4 ms: only for runs that store them
                tracker.samples(step, lambda: step_sample_table(self.store, self.run_name, step,
                                                                self.tracker_samples))
        self.tracking_seconds += time.perf_counter() - began
        self.tracked_steps += 1

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
        for metrics in history:  # each tracker logs the steps it lacks (trackers/thread.py)
            self._track(metrics["step"], metrics)

    @_never_fails
    def annotate(self, step: int, extra: dict) -> None:
        """Add ``extra`` to ``step``'s record: the held-out evaluation of the checkpoint at that step."""
        if not extra:
            return
        if self.metrics is not None:
            self.metrics.annotate(step, extra)
        if self.tensorboard is not None:
            self.tensorboard.annotate(step, extra)
        for tracker in self.trackers:
            tracker.metrics(step, extra, extra=True)

    @_never_fails
    def finish(self, checkpoint: str, flow_run_url: str | None = None) -> None:
        """The run's end, for the trackers: its final checkpoint, its flow run's page and its curves (drawn once,
        from the metrics file, on the first tracker thread that asks)."""
        self._finished = True
        summary = {"final_checkpoint": checkpoint, **({"flow_run": flow_run_url} if flow_run_url else {})}
        curves = _Once(lambda: _curves_png(self.store, self.run_name))
        for tracker in self.trackers:
            tracker.finish(summary, curves)

    @_never_fails
    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        for tracker in self.trackers:
            tracker.close()
        if self.trackers:
            log.debug("run %r: %.6f s on the training loop handing %d steps to the trackers", self.run_name,
                      self.tracking_seconds, self.tracked_steps)


class _Once:
    """A value computed on the first call, from whichever thread makes it."""

    def __init__(self, compute):
        self._compute = compute
        self._lock = threading.Lock()
        self._done = False
        self._value = None

    def __call__(self):
        with self._lock:
            if not self._done:
                self._value, self._done = self._compute(), True
            return self._value


def _curves_png(store: ObjectStore, run_name: str) -> bytes | None:
    from rollout_lib.runlog.metrics_file import read_metrics
    from rollout_lib.runlog.plot import plot_curves

    history = read_metrics(store, run_name)
    return plot_curves(history, f"{run_name}: step {history[-1]['step']}") if history else None


def eval_metrics(evaluation: dict | None) -> dict:
    """A held-out evaluation's numbers as ``eval/<name>`` metrics ({} without one)."""
    return {f"eval/{name}": value for name, value in (evaluation or {}).items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}
