"""A tracker's thread (rollout_lib/runlog/trackers/thread.py) stays out of the training loop's way: it wakes once
a flush interval, not at each step the loop hands it (a thread woken every step takes the GIL from the loop every
step), yet the run's end reaches the tracker at once and nothing handed over is lost."""

from __future__ import annotations

import time

from rollout_lib.runlog.trackers.thread import TrackerThread


class Recording:
    name = "recording"

    def __init__(self):
        self.steps: list[int] = []
        self.calls = 0
        self.finished = False

    def open(self, settings):
        return None

    def metrics(self, steps):
        self.calls += 1
        self.steps.extend(step for step, _ in steps)

    def table(self, step, columns, rows):
        pass

    def finish(self, summary, curves_png):
        self.finished = True

    def run_failed(self, error):
        pass

    def close(self):
        pass


def voluntary_switches(thread_id: int) -> int:
    with open(f"/proc/self/task/{thread_id}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))


def test_the_thread_wakes_once_an_interval_not_once_a_step_and_the_end_arrives_at_once():
    backend = Recording()
    tracker = TrackerThread(backend, {}, flush_interval_s=0.5)
    time.sleep(0.1)  # opened
    before = voluntary_switches(tracker._thread.native_id)
    steps = 200
    for step in range(1, steps + 1):  # 200 steps of 5 ms: 1 s, two intervals
        time.sleep(0.005)
        tracker.metrics(step, {"loss": 1.0 / step})
    wakeups = voluntary_switches(tracker._thread.native_id) - before
    assert wakeups <= 10, wakeups  # woken per step, it was 200 or more
    started = time.monotonic()
    tracker.finish({}, lambda: None)
    tracker.close()
    assert time.monotonic() - started < 0.4  # the end does not wait for the next interval
    assert backend.steps == list(range(1, steps + 1)) and backend.finished
    assert backend.calls <= 5  # batched: one request an interval, not one a step
