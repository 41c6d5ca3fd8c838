"""A log line per optimizer step, as many as the server should store: each step while steps are slow (a real model),
at most one line per `min_interval_s` while they are fast (a tiny model at hundreds of steps a second), where a line
per step would cost the orchestrator more than the step (issue 18). Every step is in the metrics file regardless
(docs/runs.md); ROLLOUT_LOG_LEVEL=DEBUG adds the segment loop's own line per step.

The line: `step 12/100: loss 0.6931, accuracy 0.500, 1.8 steps/s` (the entry point's key metrics, then the
throughput since the previous line: tokens/s when the steps report tokens). The flows' line per segment (from one
snapshot to the next) quotes the segment's means: `segment_means`."""

from __future__ import annotations

import logging
import math
import time

log = logging.getLogger("rollout_lib.steps")

# The metrics a line shows, when a step has them, in this order.
KEY_METRICS = ("loss", "accuracy", "reward_mean", "mean_margin")
TOKEN_COUNTS = ("tokens", "tokens/ce")


class StepLog:
    def __init__(self, total_steps: int | None, min_interval_s: float = 10.0, clock=time.monotonic):
        self.total_steps = total_steps
        self.min_interval_s = min_interval_s
        self._clock = clock  # a test's own clock, never the process-wide time.monotonic other threads read
        self._last_time: float | None = None
        self._steps = 0
        self._tokens = 0

    def __call__(self, step: int, metrics: dict) -> None:
        now = self._clock()
        self._steps += 1
        self._tokens += next((int(metrics[name]) for name in TOKEN_COUNTS
                              if isinstance(metrics.get(name), (int, float))), 0)
        if self._last_time is None:  # the first step: its time includes loading, no rate yet
            self._last_time, self._steps, self._tokens = now, 0, 0
            log.info("%s", self.line(step, metrics, None))
            return
        last = step == self.total_steps
        if not last and now - self._last_time < self.min_interval_s:
            return
        elapsed = max(now - self._last_time, 1e-9)
        rate = f"{self._tokens / elapsed:.0f} tokens/s" if self._tokens else f"{self._steps / elapsed:.2f} steps/s"
        log.info("%s", self.line(step, metrics, rate))
        self._last_time, self._steps, self._tokens = now, 0, 0

    def line(self, step: int, metrics: dict, rate: str | None) -> str:
        shown = [f"{name} {metrics[name]:.4g}" for name in KEY_METRICS if isinstance(metrics.get(name), float)]
        total = f"/{self.total_steps}" if self.total_steps else ""
        return f"step {step}{total}: " + ", ".join(shown + ([rate] if rate else []))


def segment_means(metrics: list[dict], names: tuple[str, ...]) -> dict[str, float]:
    """The mean of each of ``names`` over a segment's steps (NaN for a metric no step reports as a finite number).
    A segment's log line quotes these: its last batch alone makes a noisy metric look as if training regressed."""
    means = {}
    for name in names:
        values = [float(step[name]) for step in metrics if isinstance(step.get(name), (int, float))
                  and not isinstance(step.get(name), bool) and math.isfinite(step[name])]
        means[name] = math.fsum(values) / len(values) if values else math.nan
    return means
