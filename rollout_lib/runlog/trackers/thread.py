"""One tracker driven from a thread of its own: the training loop hands it work and goes on.

Metrics are sent in batches, at most one a `flush_interval_s` (1 s) and before anything else (a table, the run's
end); the thread wakes only that often (an item handed over is appended to a deque: no wakeup, no lock), since a
request or a wakeup per step takes CPU and the GIL from the training loop (measured: docs/runs.md). Only the run's
end (`finish`, `run_failed`, `close`) wakes it at once. The queue is bounded: what does not fit is dropped, with one
warning.
The first error a backend raises (its server down, a full disk, a package that breaks at run time) is one warning
too, and the tracker is off for the rest of the run: a dead server costs its timeout once, not once per step. A
rerun fills in what a tracker missed, since a backend says which steps it already holds (`Backend.open`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Protocol

log = logging.getLogger(__name__)


class Backend(Protocol):
    """What a tracker does with a run; called on the tracker's thread only, in this order: open, then any of
    metrics / table, then finish, then close."""

    name: str

    def open(self, settings: dict[str, str]) -> int | None:
        """Start or reuse the tracker's run of this rollout run, with the run's resolved settings (as its params or
        config); the last step it already holds (None: none)."""

    def metrics(self, steps: list[tuple[int, dict[str, float]]]) -> None:
        """Steps' metrics, in order: (step, {name: value}); a step may come twice (more metrics of it)."""

    def table(self, step: int, columns: list[str], rows: list[list]) -> None: ...

    def finish(self, summary: dict[str, str], curves_png: bytes | None) -> None: ...

    def run_failed(self, error: str) -> None:
        """The run ended in an error instead of `finish`: marked so where the tracker has a run status."""

    def close(self) -> None: ...


_CLOSE = object()


class TrackerThread:
    """``TrackerThread(backend, settings)``: `metrics`, `samples`, `finish` return at once; `close` waits at most
    `close_timeout_s` for the tracker to catch up (a tracker still busy then is left behind, with a warning)."""

    def __init__(self, backend: Backend, settings: dict[str, str], *, queue_size: int = 1000,
                 close_timeout_s: float = 60.0, flush_interval_s: float = 1.0):
        self.backend = backend
        self._settings = settings
        self.close_timeout_s = close_timeout_s
        self.flush_interval_s = flush_interval_s
        self._pending: list[tuple[int, dict[str, float]]] = []  # metrics not sent yet
        self.held_before: int | None = None  # the last step the tracker held when this run opened it
        self.sent: set[int] = set()  # steps this process logged: a held-out evaluation may join them
        self.tabled: set[int] = set()  # steps whose sample table this process logged (a step may come twice)
        self.failed = False
        self.cpu_seconds: float | None = None  # the tracker thread's CPU time while steps came, once it ended
        self._cpu_at_open = 0.0
        self._cpu_at_finish: float | None = None
        self._dropped = False
        self.queue_size = queue_size
        self._items: deque = deque()  # appended by the training loop, taken by the thread (both atomic)
        self._wake = threading.Event()  # set for what must not wait for the next interval (the run's end)
        self._thread = threading.Thread(target=self._work, name=f"tracker-{backend.name}", daemon=True)
        self._thread.start()

    # The training loop's side: never blocks, never raises.
    def metrics(self, step: int, metrics: dict, *, extra: bool = False) -> None:
        """A step's metrics, logged where the tracker lacks the step. ``extra``: more metrics of a step (a held-out
        evaluation), logged also where this process logged the step already."""
        self._put(lambda: self._metrics(step, metrics, extra))

    def samples(self, step: int, read_table: Callable[[], tuple[list[str], list[list]] | None]) -> None:
        """A step's sample table, read on the tracker's thread (`read_table` reads the store) where the step is new
        to the tracker."""
        self._put(lambda: self._table(step, read_table))

    def finish(self, summary: dict[str, str], curves_png: Callable[[], bytes | None]) -> None:
        self._put(lambda: self._finish(summary, curves_png), now=True)

    def run_failed(self, error: str) -> None:
        self._put(lambda: self.backend.run_failed(error), now=True)

    def close(self) -> None:
        self._items.append(_CLOSE)  # past the bound: the end always gets through
        self._wake.set()
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            log.warning("tracker %s: still busy after %.0f s at the end of the run; left behind (it may miss the "
                        "last steps: a rerun fills them in)", self.backend.name, self.close_timeout_s)

    def _put(self, work: Callable[[], None], now: bool = False) -> None:
        if self.failed:
            return
        if len(self._items) >= self.queue_size:
            if not self._dropped:
                self._dropped = True
                log.warning("tracker %s: falling behind the run (%d items queued); dropping what does not fit "
                            "(a rerun fills in the missing steps)", self.backend.name, self.queue_size)
            return
        self._items.append(work)
        if now:
            self._wake.set()

    # The tracker's thread.
    def _work(self) -> None:
        opened = self._call(self._open)
        closing = False
        while not closing:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()  # an item set after this wakes the next wait at once
            while self._items and not closing:
                work = self._items.popleft()
                closing = work is _CLOSE
                if not closing and opened and not self.failed:
                    self._call(work)
            if opened and not self.failed and self._pending:
                self._call(self._flush)
        if opened:
            try:
                self.backend.close()
            except Exception:  # noqa: BLE001 - closing a broken tracker is best effort
                log.debug("tracker %s: close failed", self.backend.name, exc_info=True)
        # What the tracker cost the run's process while it trained (after opening, before the run's end: the
        # curves and uploads), whatever the machine's load: bench/bench_trackers.py reads it.
        self.cpu_seconds = (self._cpu_at_finish or time.thread_time()) - self._cpu_at_open
        log.debug("tracker %s: %.4f s of CPU on its thread while steps came, %d steps sent", self.backend.name,
                  self.cpu_seconds, len(self.sent))

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending:
            self.backend.metrics(pending)

    def _open(self) -> None:
        try:
            self.held_before = self.backend.open(self._settings)
        finally:
            self._cpu_at_open = time.thread_time()

    def _metrics(self, step: int, metrics: dict, extra: bool) -> None:
        numbers = numeric(metrics)
        if step in self.sent:
            if extra and numbers:
                self._pending.append((step, numbers))
            return  # else a step given twice (trained, then its segment's history): logged once
        if self.held_before is not None and step <= self.held_before:
            return  # the tracker has it from an earlier attempt (a resumed run replays it, the same values)
        self.sent.add(step)
        if numbers:
            self._pending.append((step, numbers))

    def _table(self, step: int, read_table) -> None:
        if step not in self.sent or step in self.tabled:
            return  # already in the tracker, or never logged there
        self.tabled.add(step)
        table = read_table()
        if table is not None and table[1]:
            self._flush()  # W&B takes steps in order: the step's metrics first
            self.backend.table(step, *table)

    def _finish(self, summary: dict[str, str], curves_png) -> None:
        self._cpu_at_finish = time.thread_time()
        self._flush()
        self.backend.finish(summary, curves_png())

    def _call(self, work: Callable[[], None]) -> bool:
        try:
            work()
            return True
        except Exception as exc:  # noqa: BLE001 - a tracker's failure is not the run's
            self.failed = True
            log.warning("tracker %s failed, the run goes on without it: %s: %s", self.backend.name,
                        type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "")
            log.debug("tracker %s failure", self.backend.name, exc_info=True)
            return False


def numeric(metrics: dict) -> dict[str, float]:
    """The metrics a tracker plots: numbers, not flags, not the step or the record's wall time."""
    return {name: float(value) for name, value in metrics.items()
            if name not in ("step", "wall_time") and isinstance(value, (int, float)) and not isinstance(value, bool)}
