"""Pieces every flow shares: loading settings inside a run, result storage, artifacts."""

from __future__ import annotations

import base64
import json
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import blake3
from prefect import Task, get_run_logger
from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.filesystems import RemoteFileSystem

from flows import node_launch  # noqa: F401  (registers hardware.node_pool's launcher with the library)
from flows.api_watch import watch_worker_flow_run
from rollout_lib import step_events
from rollout_lib.config.loading import apply_overrides, read_toml
from rollout_lib.identity.claims import claim_run_name
from rollout_lib.identity.training import training_identity
from rollout_lib.plan_checks import load_config
from rollout_lib.runlog.eval_tables import record_eval_tables
from rollout_lib.runlog.recorder import RunRecorder, eval_metrics
from rollout_lib.runlog.run_settings import record_run_settings
from rollout_lib.runlog.step_log import StepLog
from rollout_lib.errors import ConfigError
from rollout_lib.store import RESULTS_DIR
from rollout_lib.trainer.segment import Segment, SnapshotSchedule
from tasks.common import open_store

# rollout_lib logs through the standard library (it never imports Prefect); PREFECT_LOGGING_EXTRA_LOGGERS=rollout_lib
# (set by the CLI and the deployments) routes these records into the flow run's logs. INFO by default: a line per
# segment, not per step (each line is a row in the server's database); ROLLOUT_LOG_LEVEL=DEBUG adds one per step.
logging.getLogger("rollout_lib").setLevel(os.environ.get("ROLLOUT_LOG_LEVEL", "INFO").upper())


def load_run_config(config_cls, config_path: str, overrides: list[str] | dict[str, Any] | None,
                    max_steps: int | None, max_steps_key: str):
    watch_worker_flow_run()  # a deployment run ends in one line when its server goes away (flows/api_watch.py)
    overrides = dict(_as_pairs(overrides))
    if max_steps is not None:
        overrides[max_steps_key] = max_steps
    return load_config(config_cls, config_path, overrides)


@dataclass
class TrainingRun:
    """A training flow's run as `start_run` opened it: its settings, its tasks (results in the run's store) and the
    progress and curves artifacts its steps update. `finish` is what every training flow does last."""

    flow_name: str
    cfg: Any
    tasks: "RunTasks"
    progress: "Progress"
    curves: "CurvesArtifact"

    def finish(self, checkpoint: str, history: list[dict], columns: tuple[str, ...], summary: str,
               result: dict) -> dict:
        """After the run's resources are closed: its `latest` ref, the metrics table, the final curves, the summary
        artifact and line, and the flow's result (`checkpoint` and `steps`, then `result`), published."""
        cfg, name = self.cfg, self.cfg.run.name
        open_store(cfg).set_ref(f"runs/{name}/latest", checkpoint)
        metrics_table(cfg, self.flow_name, history, columns)
        self.curves.update(final=True)
        create_markdown_artifact(summary, key=artifact_key(name, "summary"), description=f"{self.flow_name} summary")
        get_run_logger().info("final checkpoint %s", checkpoint)
        return publish_result(name, {"checkpoint": checkpoint, "steps": cfg.settings.budget.max_steps, **result})


def start_run(flow_name: str, config_cls, config_path: str, overrides: list[str] | dict[str, Any] | None,
              max_steps: int | None, max_steps_key: str) -> TrainingRun:
    """What every training flow does first: load its settings, claim the run name for their training identity (a
    run name holds one training, never two), and label the flow run so the UI finds it: tags for the run name,
    the flow and a short identity, and the resolved settings as the `<run>-settings` table artifact and in the store
    (runlog/run_settings.py)."""
    cfg = load_run_config(config_cls, config_path, overrides, max_steps, max_steps_key)
    node_launch.check_agents(cfg)  # hardware.node_pool: every other node has its agent
    identity = claim_run_name(cfg)
    record_run_settings(open_store(cfg), cfg.run.name, flow_name, identity, cfg.model_dump(mode="json"))
    tag_flow_run(cfg.run.name, identity)
    create_table_artifact(settings_rows(cfg, identity), key=artifact_key(cfg.run.name, "settings"),
                          description=f"{cfg.run.name}: resolved settings")
    return TrainingRun(flow_name, cfg, RunTasks(cfg), Progress(artifact_key(cfg.run.name, "progress"),
                       cfg.settings.budget.max_steps, f"{flow_name} {cfg.run.name}: steps done"),
                       CurvesArtifact(cfg, flow_name))


def publish_result(run_name: str, result: dict) -> dict:
    """The flow's result as the `<run>-result` artifact (JSON in a fenced block, read back by rollout_cli/follow.py):
    what `rollout train` prints on stdout, readable from the API, so `rollout follow` ends a deployment's run with
    the same summary. Returns `result`."""
    context = FlowRunContext.get()
    flow_name = context.flow.name if context is not None and context.flow is not None else "flow"
    text = f"# {flow_name} `{run_name}`: result\n\n```json\n{json.dumps(result, indent=1)}\n```"
    create_markdown_artifact(text, key=artifact_key(run_name, "result"), description=f"{flow_name} result (JSON)")
    return result


def tag_flow_run(run_name: str, identity: str | None = None) -> None:
    """Add the run's name, the flow's name and a short training identity to the flow run's tags (a deployment's
    own tags stay): the UI filters runs by tag."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    tags = {run_name, context.flow.name, *context.flow_run.tags}
    if identity is not None:
        tags.add(f"identity:{identity[:12]}")
    with get_client(sync_client=True) as client:
        client.update_flow_run(context.flow_run.id, tags=sorted(tags))


def settings_rows(cfg, identity: str) -> list[dict[str, str]]:
    """The run's settings as resolved (defaults filled in, overrides applied), one row per key path, as W&B shows a
    run's config; never credentials (`run.storage_options`)."""
    rows = [{"setting": "training identity", "value": identity}]

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else key, item)
        elif isinstance(value, list) and any(isinstance(item, dict) for item in value):
            for index, item in enumerate(value):
                walk(f"{prefix}[{index}]", item)
        else:
            rows.append({"setting": prefix, "value": value if isinstance(value, str) else json.dumps(value)})

    dumped = cfg.model_dump(mode="json")
    dumped.get("run", {}).pop("storage_options", None)
    walk("", dumped)
    return rows


def flow_run_name() -> str:
    """A flow run's name: its run's name (`run.name` of the config and overrides it was started with) and the first
    hex digits of its flow run id, e.g. `rm-default-4cf0`, so runs are found by name in the UI. Read from the
    parameters without validating them: a config that does not load still gets a run (named after the flow) that
    fails with the config's own error."""
    from prefect.runtime import flow_run

    suffix = str(flow_run.id)[:4]
    try:
        parameters = flow_run.parameters
        raw = apply_overrides(read_toml(parameters["config"]), dict(_as_pairs(parameters.get("overrides"))))
        name = raw.get("run", {}).get("name", "default")
    except Exception:  # noqa: BLE001 - the flow reports a bad config; its name must not fail first
        name = flow_run.flow_name
    return f"{name}-{suffix}"


def _as_pairs(overrides):
    if not overrides:
        return []
    if isinstance(overrides, dict):
        return list(overrides.items())
    from rollout_lib.config.loading import parse_override

    return [(".".join(path), value) for path, value in map(parse_override, overrides)]


class RunTasks:
    """The run's tasks with their results stored in the run's store, under `<store>/prefect-results` (a local store's
    directory or an s3:// store's bucket), so wiping a store also wipes the cache entries that point into it:
    `tasks = RunTasks(cfg); tasks(load_pairs_task)(cfg, "train")`."""

    def __init__(self, config):
        self.result_storage = task_result_storage(config.run.store, config.run.storage_options)
        self._bound: dict[str, Task] = {}

    def __call__(self, task: Task) -> Task:
        if task.name not in self._bound:  # with_options copies the task: once per task, not once per call
            self._bound[task.name] = task.with_options(result_storage=self.result_storage)
        return self._bound[task.name]


def task_result_storage(store: str, storage_options: dict[str, Any]) -> Path | RemoteFileSystem:
    """`<store>/prefect-results`: a path for a local store; for an fsspec URL, a RemoteFileSystem block (Prefect
    takes only saved blocks), one per store, saved again at each run so that it carries the run's storage_options
    as its fsspec settings. Credentials among them are therefore kept in the Prefect server's database, as plain
    block fields; cache keys never see them (they hash the settings without run.storage_options)."""
    location = f"{store.rstrip('/')}/{RESULTS_DIR}"
    if "://" not in store:
        return Path(location)
    block = RemoteFileSystem(basepath=location, settings=dict(storage_options))
    # Block names allow lowercase letters, digits and dashes: one name per store URL.
    block.save(f"rollout-results-{blake3.blake3(store.encode()).hexdigest()[:16]}", overwrite=True)
    return block


@contextmanager
def fan_out_runner(settings) -> Iterator[Any]:
    """The run's task runner for per-sample fan-out (`run.task_runner`: config.common.TaskRunnerSettings), started
    for the block: a prefect-dask DaskTaskRunner (a LocalCluster of this machine, or the scheduler at `address`)
    or a prefect-ray RayTaskRunner; None for "thread" (the flow's own tasks do that work in its process). Tasks
    submitted to it run in other processes, maybe other machines: their parameters travel pickled, and they store
    their results in the run's result storage (RunTasks), which each worker must reach (docs/hardware.md)."""
    if settings.type == "thread":
        yield None
        return
    if settings.type == "dask":
        from prefect_dask import DaskTaskRunner

        if settings.address is not None:
            runner = DaskTaskRunner(address=settings.address)
        else:
            cluster = {"threads_per_worker": settings.threads_per_worker, "dashboard_address": None}
            if settings.n_workers is not None:
                cluster["n_workers"] = settings.n_workers
            runner = DaskTaskRunner(cluster_kwargs=cluster)
    else:
        try:
            from prefect_ray import RayTaskRunner
        except ImportError:
            raise ConfigError([("run.task_runner.type", "\"ray\" needs prefect-ray: pip install -e '.[ray]'")]) \
                from None
        runner = RayTaskRunner(address=settings.address)
    with runner:
        yield runner


def artifact_key(*parts: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    text = "-".join(parts).lower()
    return "".join(c if c.isalnum() else "-" for c in text).strip("-")


def metrics_table(cfg, flow_name: str, history: list[dict], columns: tuple[str, ...]) -> None:
    """The per-step metrics table artifact, column by column (names once, not once per row) with floats to 6
    significant digits: the server keeps the table twice (the artifact and its event), so it is most of what a
    long run stores there. A metric a step lacks is an empty cell."""
    def cell(value):
        return float(f"{value:.6g}") if isinstance(value, float) else ("" if value is None else value)

    create_table_artifact({name: [cell(m.get(name)) for m in history] for name in columns},
                          key=artifact_key(cfg.run.name, "metrics"), description=f"{flow_name} metrics per step")


def publish_step_samples(cfg, step: int) -> None:
    """RL step `step`'s samples as a version of the table artifact `<run>-samples` (the run's Artifacts tab): at
    most `run.ui_samples` rows, the failed first, then the worst and the best (runlog/samples.py); every sample is
    in the store (`rollout runs samples`). A table nobody could read is not worth a failed run: never fails it."""
    if not cfg.run.ui_samples:
        return
    from rollout_lib.runlog.samples import flat_row, shown_first, step_rows

    try:
        every = step_rows(open_store(cfg), cfg.run.name, step)
        rows = [flat_row(row) for row in shown_first(every, cfg.run.ui_samples)]
    except Exception as exc:  # noqa: BLE001
        logging.getLogger(__name__).warning("samples of step %d of %s not shown: %s", step, cfg.run.name, exc)
        return
    create_table_artifact(rows, key=artifact_key(cfg.run.name, "samples"),
                          description=f"train-rl {cfg.run.name} step {step}: {len(rows)} of its {len(every)} "
                                      f"samples, the failed first, then the worst and the best (every one: `rollout "
                                      f"runs samples {cfg.run.name} --step {step}`)")


class Progress:
    """A progress artifact updated while training (shown live in the UI). An update is an API round trip (~10 ms
    here), so updates come at most every `min_interval_s` seconds, and always at the end."""

    def __init__(self, key: str, total: int, description: str, min_interval_s: float = 5.0):
        self.total = total
        self.min_interval_s = min_interval_s
        self.artifact_id = create_progress_artifact(0.0, key=key, description=description)
        self._last_update = time.monotonic()

    def update(self, done: int) -> None:
        now = time.monotonic()
        if done < self.total and now - self._last_update < self.min_interval_s:
            return
        self._last_update = now
        update_progress_artifact(self.artifact_id, progress=100.0 * done / self.total)


class CurvesArtifact:
    """The run's curves (rollout_lib/runlog/plot.py, from its metrics file) as an image in a markdown artifact,
    `<run>-curves`, shown by the UI on the flow run's Artifacts tab. Updated at each snapshot, so a run is watched
    as it trains, and always at the end. Never fails the run.

    The server keeps every version, twice (the artifact and its event): ~80 KB of base64 each. Snapshots of a small
    model can come every second, so an update waits `min_interval_s` (30 s) after the last one, or 5% of the time
    from the first update to the last when that is longer: a watched run updates every 30 s for its first 10
    minutes, and a 10-hour run stores ~100 versions (~16 MB), not 1200. The first waits 30 s from the run's start:
    a drawing costs ~0.5 CPU-s, and a run shorter than that (a tiny config, a test) draws once, at its end."""

    def __init__(self, cfg, flow_name: str, min_interval_s: float = 30.0, interval_fraction: float = 0.05):
        self.cfg = cfg
        self.flow_name = flow_name
        self.key = artifact_key(cfg.run.name, "curves")
        self.min_interval_s = min_interval_s
        self.interval_fraction = interval_fraction
        self._started = time.monotonic()
        self._first_update: float | None = None
        self._last_update: float | None = None

    def due(self, now: float) -> bool:
        if self._last_update is None:
            return now - self._started >= self.min_interval_s
        wait = max(self.min_interval_s, self.interval_fraction * (self._last_update - self._first_update))
        return now - self._last_update >= wait

    def update(self, final: bool = False) -> None:
        now = time.monotonic()
        if not final and not self.due(now):
            return
        self._last_update = now
        if self._first_update is None:
            self._first_update = now
        from rollout_lib.runlog.metrics_file import read_metrics
        from rollout_lib.runlog.plot import plot_curves

        try:
            history = read_metrics(open_store(self.cfg), self.cfg.run.name)
            steps = history[-1]["step"] if history else 0
            png = plot_curves(history, f"{self.flow_name} {self.cfg.run.name}: step {steps}")
        except Exception as exc:  # noqa: BLE001 - a picture is not worth a failed run
            logging.getLogger(__name__).warning("curves of %s not drawn: %s", self.cfg.run.name, exc)
            return
        create_markdown_artifact(
            f"# {self.flow_name} `{self.cfg.run.name}`: curves\n\n"
            f"![curves of {self.cfg.run.name}](data:image/png;base64,{base64.b64encode(png).decode()})\n\n"
            f"Steps 1-{steps}{' and the evaluation before training (step 0)' if history[0]['step'] == 0 else ''}. "
            f"The same image: `rollout runs plot {self.cfg.run.name}`.",
            key=self.key, description=f"{self.flow_name} curves")


@contextmanager
def recorded_run(cfg, total: int, log_steps: bool = True, samples: bool = False) -> Iterator[RunRecorder]:
    """The run's per-step metrics kept in its store as each step completes (and TensorBoard's event files when
    `run.tensorboard`, and the experiment trackers of `run.trackers`), and a log line per step as often as
    runlog/step_log.py allows (`log_steps`: RL's flow logs its heavier steps itself), for the length of the block:
    docs/runs.md. `samples`: the steps store samples (RL), which trackers with tables get. The flow calls
    `recorder.finish(checkpoint, flow_run_page())` before the block ends."""
    store = open_store(cfg)
    trackers = []
    if any(tracker != "tensorboard" for tracker in cfg.run.trackers):
        from rollout_lib.runlog.trackers.build import open_trackers

        identity = training_identity(cfg)
        trackers = open_trackers(cfg.run, store, {row["setting"]: row["value"] for row in settings_rows(cfg, identity)})
    with RunRecorder(store, cfg.run.name, total_steps=total, tensorboard=cfg.run.writes_tensorboard,
                     trackers=trackers, tracker_samples=cfg.run.tracker_samples if samples else 0) as recorder, \
            step_events.subscribed(recorder.record), \
            step_events.subscribed(StepLog(total) if log_steps else lambda step, metrics: None):
        yield recorder


def flow_run_page() -> str | None:
    """The flow run's page in the Prefect UI (None outside a flow run), for the trackers' summaries: the link the
    CLI's summary prints (`flow run: ...`, rollout_cli/progress.py), the UI being served where the API is."""
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_API_URL

    try:
        api_url = PREFECT_API_URL.value()
        if flow_run.id is None or not api_url:
            return None
        return f"{api_url.rstrip('/').removesuffix('/api')}/runs/flow-run/{flow_run.id}"
    except Exception:  # noqa: BLE001 - a link is not worth a failed run
        return None


def train_in_segments(run: TrainingRun, evaluate_task: Task, segment_task: Task, data_ids: tuple[str, ...],
                      initial: str, *, resident, recorder: RunRecorder, held_out: tuple[str, str] | None,
                      describe: Callable[[dict], str], on_segment: Callable[[Segment, str, list[dict]], None]):
    """SFT's and RM's training: the held-out evaluation of `initial` (step 0 of the metrics file), steps
    1..max_steps as one task per segment (`segment_task(cfg, *data_ids, checkpoint, first, last, resident)`, from
    one snapshot to the next; `on_segment(segment, its checkpoint, its step metrics)` after each), then the
    evaluation of the last checkpoint (on the last step's line). `held_out`: (the held-out set's tokenized id, its
    loaded id) or None; `describe(metrics)`: an evaluation in its log line. A segment that trained published its
    steps as they completed; one that did not (cached, or trained by an earlier run) gives them to `recorder` here.
    Returns (the final checkpoint, every step's metrics, the evaluations before and after, the training seconds)."""
    settings = run.cfg.settings

    def evaluate(step: int, checkpoint: str, when: str) -> dict | None:
        """The evaluate task at `step` (label `step-<step>`), its per-example rows recorded where `rollout runs
        samples --eval` reads them (runlog/eval_tables.py; with the held-out data as loaded, for their text; a
        result without rows records null): its metrics alone, as the metrics file and the run's result have them."""
        if held_out is None:
            return None
        result = run.tasks(evaluate_task)(run.cfg, checkpoint, held_out[0], f"step-{step}", resident)
        record_eval_tables(open_store(run.cfg), run.cfg.run.name, step, run.cfg.algorithm.kind, result.get("rows"),
                           held_out[1])
        metrics = {name: value for name, value in result.items() if name != "rows"}
        get_run_logger().info("held-out %s training: %s", when, describe(metrics))
        return metrics

    before = evaluate(0, initial, "before")
    if before:
        recorder.annotate(0, eval_metrics(before))  # step 0 of the metrics file: the evaluation alone
    started, history, checkpoint = time.perf_counter(), [], initial
    for segment in SnapshotSchedule(settings.checkpoint_interval, settings.budget.max_steps).segments():
        result = run.tasks(segment_task)(run.cfg, *data_ids, checkpoint, segment.first, segment.last, resident)
        checkpoint = result["checkpoint"]
        history.extend(result["metrics"])
        recorder.backfill(result["metrics"])
        run.progress.update(segment.last)
        on_segment(segment, checkpoint, result["metrics"])
        run.curves.update()
    train_seconds = time.perf_counter() - started
    after = evaluate(settings.budget.max_steps, checkpoint, "after")
    recorder.annotate(settings.budget.max_steps, eval_metrics(after))  # held-out results on the last step's line
    recorder.finish(checkpoint, flow_run_page())  # the trackers' summary
    return checkpoint, history, before, after, train_seconds
