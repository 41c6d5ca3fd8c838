"""What `rollout train` shows in the terminal: one live progress bar per run (rlhf: one per stage) fed by
rollout_lib/step_events, and a short summary when the flow is done. Both go to stderr: stdout keeps the JSON result.

When stderr is not a terminal (a pipe, CI, the tests) rich draws no live bar: the bars are printed once, as they
ended, and the summary as plain lines.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from contextlib import ExitStack, contextmanager, redirect_stdout
from typing import Self

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)

from rollout_lib import step_events

RLHF_STAGES = ("sft", "rm", "rl")
STAGE_OF_FLOW = {"train-sft": "sft", "train-rm": "rm", "train-rl": "rl"}  # the flows' names (flows/train_*.py)
TOKEN_METRICS = ("tokens", "tokens/ce")  # RL's tokens per step; SFT's tokens under the loss


def step_text(stage: str, metrics: dict) -> str:
    """The bar's metric: what the stage is judged by, as it trains."""
    parts = []
    if stage == "rl" and "reward_mean" in metrics:
        parts.append(f"reward {metrics['reward_mean']:.3f}")
    if "loss" in metrics:
        parts.append(f"loss {metrics['loss']:.4f}")
    if stage == "rm" and "accuracy" in metrics:
        parts.append(f"acc {metrics['accuracy']:.2f}")
    return " ".join(parts)


class StageBar:
    """One run's bar and what it has seen: its first and last step's metrics, and the throughput since its first
    step (the first step's time holds the model load, so the rate counts from it, not from the start)."""

    def __init__(self, progress: Progress, stage: str, total: int):
        self.progress, self.stage, self.total = progress, stage, total
        self.task: TaskID = progress.add_task(stage, total=total, metric="", rate="")
        self.first: dict | None = None
        self.last: dict | None = None
        self.last_step = 0
        self._first_at = 0.0
        self._first_step = 0
        self._tokens = 0.0

    def update(self, step: int, metrics: dict) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first, self._first_at, self._first_step = metrics, now, step
        else:
            self._tokens += next((float(metrics[name]) for name in TOKEN_METRICS if name in metrics), 0.0)
        self.last, self.last_step = metrics, step
        elapsed = now - self._first_at
        rate = ""
        if elapsed > 0 and step > self._first_step:
            rate = (f"{self._tokens / elapsed:,.0f} tok/s" if self._tokens
                    else f"{(step - self._first_step) / elapsed:.2f} steps/s")
        self.progress.update(self.task, completed=step, metric=step_text(self.stage, metrics), rate=rate)


class TrainingProgress:
    """`with TrainingProgress(entry_point, config):` around the flow call shows its steps as they complete.

    rlhf's three stages run as subflows in this process, one after the other: a step belongs to the stage whose
    flow publishes it (Prefect's flow run context), else, outside a flow, to the next stage once step numbers
    start again."""

    def __init__(self, entry_point: str, config, console: Console | None = None):
        self.entry_point = entry_point
        self.console = console or Console(stderr=True)
        self.progress = Progress(TextColumn("{task.description:>4}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[metric]}"), TextColumn("{task.fields[rate]}"),
                                 TimeRemainingColumn(), console=self.console, redirect_stdout=False)
        if entry_point == "rlhf":
            self.totals = {stage: config.stage_config(stage).settings.budget.max_steps for stage in RLHF_STAGES}
        else:
            self.totals = {entry_point: config.settings.budget.max_steps}
        self.bars: dict[str, StageBar] = {}
        self._stage_index = 0
        self._exit = ExitStack()

    def __enter__(self) -> Self:
        self._exit.enter_context(self.progress)
        self._exit.enter_context(_logs_above(self.console))
        self._exit.enter_context(step_events.subscribed(self.on_step))
        return self

    def __exit__(self, *exc_info) -> None:
        self._exit.__exit__(*exc_info)

    def on_step(self, step: int, metrics: dict) -> None:
        """A step_events listener."""
        stage = self._stage(step)
        if stage not in self.bars:
            self.bars[stage] = StageBar(self.progress, stage, self.totals[stage])
        self.bars[stage].update(step, metrics)

    def _stage(self, step: int) -> str:
        stages = list(self.totals)
        if len(stages) == 1:
            return stages[0]
        stage = _running_flow_stage()
        if stage in self.totals:
            self._stage_index = stages.index(stage)
        else:
            current = self.bars.get(stages[self._stage_index])
            if current is not None and step <= current.last_step and self._stage_index + 1 < len(stages):
                self._stage_index += 1
        return stages[self._stage_index]

    def observed(self) -> dict[str, tuple[dict, dict]]:
        """Stage -> (first, last) step metrics this process saw (a step restored from cache is not seen)."""
        return {stage: (bar.first, bar.last) for stage, bar in self.bars.items() if bar.first is not None}


def _running_flow_stage() -> str | None:
    try:
        from prefect.context import FlowRunContext
    except ImportError:
        return None
    context = FlowRunContext.get()
    return STAGE_OF_FLOW.get(context.flow.name) if context is not None and context.flow is not None else None


class _logs_above:
    """Prefect's console log handlers print through `console` meanwhile, so log lines scroll above a live bar
    instead of breaking it (they write to the real stderr, which rich's own redirect does not catch)."""

    def __init__(self, console: Console):
        self.console = console
        self.swapped: list[tuple[logging.Handler, Console]] = []

    def __enter__(self) -> None:
        if not self.console.is_terminal:
            return
        for handler in _console_handlers():
            self.swapped.append((handler, handler.console))
            handler.console = self.console

    def __exit__(self, *exc_info) -> None:
        for handler, console in self.swapped:
            handler.console = console


@contextmanager
def stdout_to_stderr():
    """What the run prints meanwhile (a user's reward function, a library, a process it starts) goes to stderr, so
    that stdout holds the JSON result alone: `json.load` reads it."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)  # file descriptor 1 too: child processes inherit it, not sys.stdout
    try:
        with redirect_stdout(sys.stderr):
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


class tracebacks_hidden:
    """Prefect's console handlers print log records without their tracebacks meanwhile: a failing task logs its
    traceback and the flow run logs it again, pages that the CLI's one-line error replaces (`--verbose` keeps
    them). The API handler formats the record itself, so the flow run's logs in the UI keep every traceback."""

    def __init__(self):
        self.swapped: list[tuple[logging.Handler, logging.Formatter | None]] = []

    def __enter__(self) -> None:
        for handler in _console_handlers():
            self.swapped.append((handler, handler.formatter))
            handler.setFormatter(_WithoutTraceback(handler.formatter))

    def __exit__(self, *exc_info) -> None:
        for handler, formatter in self.swapped:
            handler.setFormatter(formatter)


class _WithoutTraceback(logging.Formatter):
    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info or record.exc_text or record.stack_info:
            # A copy: the same record goes on to other handlers (the API's), which keep the traceback.
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None, "stack_info": None})
        return self.inner.format(record)


# Lines the terminal leaves out (the flow run's logs in the UI keep them): Prefect's routine lifecycle records (a run
# began, where to view it, a task finished as expected, a worker's submission and pull steps) and the flow's
# closing checkpoint line, which the summary at the end says once. Warnings and errors always show.
_ROUTINE = re.compile(
    r"(Beginning flow run |View at |Finished in state (Completed|Cached)\(|Worker '.*' submitting flow run|"
    r"Aborted submission of flow run|Flow run '.*' submitted to infrastructure|Running \d+ deployment pull step|"
    r"Executing deployment step|Deployment step '.*' completed|All deployment steps completed|"
    r"Opening process|Process .* exited cleanly|final checkpoint [0-9a-f]{64}$)")


def is_routine(level: int, message: str) -> bool:
    return level < logging.WARNING and _ROUTINE.match(message) is not None


class _NotRoutine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not is_routine(record.levelno, record.getMessage())


class routine_lines_hidden:
    """Prefect's console handlers leave routine lines out meanwhile (`is_routine`); `--verbose` keeps them."""

    def __init__(self):
        self.filter = _NotRoutine()
        self.handlers: list[logging.Handler] = []

    def __enter__(self) -> None:
        self.handlers = _console_handlers()
        for handler in self.handlers:
            handler.addFilter(self.filter)

    def __exit__(self, *exc_info) -> None:
        for handler in self.handlers:
            handler.removeFilter(self.filter)


def _console_handlers() -> list[logging.Handler]:
    """Prefect's console handlers (they print through a rich Console), on whichever loggers hold them."""
    loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    handlers = {handler for logger in loggers for handler in logger.handlers}
    return [handler for handler in handlers if isinstance(getattr(handler, "console", None), Console)]


def summary_lines(entry_point: str, result: dict, flow_run_url: str | None,
                  observed: dict[str, tuple[dict, dict]] | None = None) -> list[str]:
    """The run in a few lines: its headline metric before -> after, its final checkpoint, its Prefect UI page.

    `observed`: TrainingProgress.observed(), for a train metric's first step when the result holds only the last."""
    observed = observed or {}
    lines = []
    if entry_point == "rm":
        lines += _held_out_or_train(result, observed.get("rm"), "accuracy", "{:.3f}")
    elif entry_point == "sft":
        lines += _held_out_or_train(result, observed.get("sft"), "loss", "{:.4f}")
    elif entry_point == "rlhf":
        for stage in ("sft", "rm"):
            seen = observed.get(stage)
            record = result.get("stages", {}).get(stage, {})
            if record.get("eval_after"):
                metric = "accuracy" if stage == "rm" else "loss"
                lines.append(f"{stage}: held-out {metric} after {record['eval_after'][metric]:.3f}")
            elif seen:
                metric = "accuracy" if stage == "rm" else "loss"
                lines += _before_after(f"{stage}: train {metric} (first -> last step)", seen[0], seen[1], metric,
                                       "{:.3f}" if stage == "rm" else "{:.4f}")
    if entry_point in ("rl", "rlhf"):
        prefix = "rl: " if entry_point == "rlhf" else ""
        curve = result.get("reward_curve") or []
        if curve:
            lines.append(f"{prefix}mean reward (first -> last step): {curve[0]:.3f} -> {curve[-1]:.3f}")
        for name, points in sorted((result.get("eval_curves") or {}).items()):
            if points:
                lines.append(f"{prefix}held-out {name} (step {points[0][0]} -> {points[-1][0]}): "
                             f"{points[0][1]:.3f} -> {points[-1][1]:.3f}")
    lines.append(f"final checkpoint: {result['checkpoint']}")
    if flow_run_url:
        lines.append(f"flow run: {flow_run_url}")
    return lines


def _held_out_or_train(result: dict, seen: tuple[dict, dict] | None, metric: str, form: str) -> list[str]:
    before, after = result.get("eval_before"), result.get("eval_after")
    if before and after:
        return _before_after("held-out " + metric, before, after, metric, form)
    last = result.get("last_metrics") or (seen[1] if seen else None)
    first = seen[0] if seen else None
    return _before_after(f"train {metric} (first -> last step)", first, last, metric, form)


def _before_after(label: str, before: dict | None, after: dict | None, metric: str, form: str) -> list[str]:
    if not after or metric not in after:
        return []
    if before and metric in before:
        return [f"{label}: {form.format(before[metric])} -> {form.format(after[metric])}"]
    return [f"{label}: last {form.format(after[metric])}"]


def flow_run_url(api_url: str, flow_run_id: str) -> str:
    """The flow run's page in the Prefect UI, which is served where the API is, without `/api`."""
    return f"{api_url.rstrip('/').removesuffix('/api')}/runs/flow-run/{flow_run_id}"


def print_summary(entry_point: str, result: dict, flow_run_url: str | None,
                  observed: dict[str, tuple[dict, dict]] | None = None, console: Console | None = None) -> None:
    console = console or Console(stderr=True)
    for line in summary_lines(entry_point, result, flow_run_url, observed):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
