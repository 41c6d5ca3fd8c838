"""`rollout follow [RUN] | --latest`: watch a flow run (a deployment's, a scheduled one, another terminal's) as
`rollout train` shows an in-process one: the flow's own log lines (and its subflows', for rlhf) as they arrive
without Prefect's routine ones, a bar per run with its step, loss or reward, elapsed time and ETA, and at the end
the same plain-text summary `rollout train` prints (from the run's `<run>-result` artifact). Not
`prefect deployment run --watch`, which prints the server's raw state-change events.

RUN is a flow run id, a flow run name (`rm-default-4cf0`) or a run name (`rm-default`: its newest flow run, found
by the tag every run carries). The server: PREFECT_API_URL if set, else the stack or local server of rollout's home
(paths.state_dir). Exits 0 when the run completed, 1 when it failed, crashed or was cancelled, 2 when there is no
such run or no server.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
import uuid
from datetime import datetime

import click

TERMINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
NOT_STARTED = ("SCHEDULED",)  # a nightly run waiting for its time is not what `--latest` means
ENTRY_POINT_OF_FLOW = {"train-rm": "rm", "train-sft": "sft", "train-rl": "rl", "rlhf": "rlhf"}
# The flows' step lines (runlog/step_log.py, flows/rl_steps.py): `step 12/100: loss 0.6931, accuracy 0.5, ...` and
# RL's `step 3: reward 0.412 (std ...), loss 0.0123, ...`.
STEP_LINE = re.compile(r"step (\d+)(?:/(\d+))?: (.*)")
STEP_METRIC = re.compile(r"([a-z_]+) (-?\d+(?:\.\d+)?(?:e[-+]?\d+)?)")


class FollowError(Exception):
    """No server, or no such run: one line, exit 2."""


class Api:
    def __init__(self, api_url: str):
        self.api_url = api_url.rstrip("/")

    def __call__(self, method: str, path: str, body: dict | None = None):
        request = urllib.request.Request(f"{self.api_url}{path}", method=method,
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Content-Type": "application/json"})
        for attempt in range(5):
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return json.loads(response.read() or b"null")
            except urllib.error.HTTPError as exc:
                if exc.code not in (429, 503) or attempt == 4:  # 503: SQLite busy on a loaded machine; retry
                    raise
            time.sleep(1 + attempt)


def find_server() -> str:
    """The API to follow runs on: PREFECT_API_URL, else the stack's or the local server of rollout's home."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    from rollout_cli import local_server, stack

    record = stack.read_record() or local_server.read_record()
    if record is None or not local_server.is_healthy(record["api_url"]):
        raise FollowError(f"no Prefect server is running for {local_server.state_dir()}: start it with "
                          "`rollout stack start` (or set PREFECT_API_URL to the server the run is on)")
    return record["api_url"]


def find_run(api: Api, target: str | None) -> dict:
    """The flow run `target` names (an id, a flow run name, a run name), or the newest started one for None."""
    started = {"state": {"type": {"not_any_": list(NOT_STARTED)}}}
    if target is None:
        runs = api("POST", "/flow_runs/filter", {"flow_runs": {**started, "parent_task_run_id": {"is_null_": True}},
                                                 "sort": "EXPECTED_START_TIME_DESC", "limit": 1}) or []
        if not runs:
            raise FollowError(f"no flow run has started on {api.api_url}")
        return runs[0]
    try:
        return api("GET", f"/flow_runs/{uuid.UUID(target)}")
    except ValueError:
        pass  # not an id: a name
    except urllib.error.HTTPError as exc:
        raise FollowError(f"no flow run {target} at {api.api_url} (HTTP {exc.code})") from None
    for criteria in ({"name": {"any_": [target]}}, {"tags": {"all_": [target]}, **started}):
        runs = api("POST", "/flow_runs/filter", {"flow_runs": criteria, "sort": "EXPECTED_START_TIME_DESC",
                                                 "limit": 1}) or []
        if runs:
            return runs[0]
    raise FollowError(f"no flow run named or tagged {target!r} at {api.api_url} (a run is named and tagged once "
                      "it starts: follow a pending one by its flow run id, or with --latest)")


def flow_run_ids(api: Api, root: str) -> list[str]:
    """The run and its subflows' runs (rlhf's stages), any depth, oldest first."""
    found, frontier = [root], [root]
    while frontier:
        children = api("POST", "/flow_runs/filter", {
            "flow_runs": {"parent_flow_run_id": {"any_": frontier}}, "sort": "EXPECTED_START_TIME_ASC"}) or []
        frontier = [child["id"] for child in children if child["id"] not in found]
        found.extend(frontier)
    return found


def log_line(entry: dict, names: dict[str, str]) -> str:
    stamp = datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).astimezone().strftime("%H:%M:%S")
    level = {10: "DEBUG", 20: "INFO", 30: "WARNING", 40: "ERROR", 50: "CRITICAL"}.get(entry["level"], entry["level"])
    where = names.get(entry.get("task_run_id") or "") or names.get(entry.get("flow_run_id") or "", entry["name"])
    return f"{stamp} {level:<7} {where} | {entry['message']}"


def step_of(message: str) -> tuple[int, int | None, dict[str, float]] | None:
    """(step, total or None, metrics) of a step line; RL's `reward` is the bar's `reward_mean`."""
    match = STEP_LINE.match(message)
    if match is None:
        return None
    metrics = {("reward_mean" if name == "reward" else name): float(value)
               for name, value in STEP_METRIC.findall(match.group(3))}
    return int(match.group(1)), int(match.group(2)) if match.group(2) else None, metrics


def run_result(api: Api, flow_run_id: str) -> dict | None:
    """The flow's result: the JSON block of its `<run>-result` artifact (flows/common.py publish_result)."""
    for artifact in api("POST", "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}},
                                                      "sort": "CREATED_DESC"}) or []:
        if (artifact["key"] or "").endswith("-result"):
            match = re.search(r"```json\n(.*)\n```", artifact["data"] or "", re.S)
            if match:
                return json.loads(match.group(1))
    return None


class RunBars:
    """A bar per flow run (rlhf: the pipeline's stages): its progress artifact's share done, and from its latest
    step line the step, the metric it is judged by, and its rate; elapsed time and ETA."""

    def __init__(self, console):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[step]}"),
                                 TextColumn("{task.fields[metric]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                 console=console, transient=False)
        self.bars: dict[str, int] = {}
        self.seen: dict[str, tuple[str, dict, dict]] = {}  # run id -> (flow, first step's metrics, last step's)

    def _bar(self, run_id: str, name: str) -> int:
        if run_id not in self.bars:
            self.bars[run_id] = self.progress.add_task(name, total=100.0, step="", metric="")
        return self.bars[run_id]

    def on_step(self, run_id: str, name: str, flow: str, step: int, total: int | None, metrics: dict) -> None:
        from rollout_cli.progress import step_text

        first = self.seen.get(run_id, (flow, metrics, metrics))[1]
        self.seen[run_id] = (flow, first, metrics)
        fields = {"step": f"step {step}/{total}" if total else f"step {step}",
                  "metric": step_text(ENTRY_POINT_OF_FLOW.get(flow, ""), metrics)}
        bar = self._bar(run_id, name)
        if total:
            fields["completed"] = max(100.0 * step / total, self.progress.tasks[bar].completed)
        self.progress.update(bar, **fields)

    def observed(self) -> dict[str, tuple[dict, dict]]:
        """Entry point (rlhf: stage) -> the first and last step metrics seen, as TrainingProgress.observed()."""
        return {ENTRY_POINT_OF_FLOW[flow]: (first, last) for flow, first, last in self.seen.values()
                if flow in ENTRY_POINT_OF_FLOW}

    def on_progress(self, run_id: str, name: str, percent: float) -> None:
        bar = self._bar(run_id, name)
        self.progress.update(bar, completed=max(percent, self.progress.tasks[bar].completed))


def _minus_a_minute(timestamp: str) -> str:
    from datetime import timedelta

    return (datetime.fromisoformat(timestamp.replace("Z", "+00:00")) - timedelta(minutes=1)).isoformat()


@click.command("follow")
@click.argument("run", required=False)
@click.option("--latest", is_flag=True, help="the newest flow run that has started")
@click.option("--all-lines", is_flag=True, help="Prefect's routine lines too (task finished, worker submission)")
@click.option("--poll", "poll_s", default=1.0, show_default=True, metavar="SECONDS", help="between API reads")
def follow(run: str | None, latest: bool, all_lines: bool, poll_s: float) -> int:
    """Follow a flow run until it ends: its log lines, a progress bar, then its summary. RUN: a flow run id (from
    `prefect deployment run ...`), a flow run name (rm-default-4cf0) or a run name (rm-default: its newest run)."""
    from rich.console import Console

    from rollout_cli.progress import flow_run_url, is_routine, print_summary

    if (run is None) == (not latest):
        raise click.UsageError("name a run (a flow run id, a flow run name or a run name) or give --latest")
    try:
        api_url = find_server()
        api = Api(api_url)
        root = find_run(api, None if latest else run)
    except FollowError as exc:
        print(f"rollout: error: {exc}", file=sys.stderr)
        return 2
    flow_run_id = root["id"]
    console = Console(stderr=True)
    bars = RunBars(console)
    names: dict[str, str] = {}  # flow and task run ids -> their names
    flows: dict[str, str] = {}  # flow run id -> its flow's name
    flow_names: dict[str, str] = {}  # flow id -> name
    seen_logs: set[str] = set()
    since = root.get("created")
    ended_polls = 0
    with bars.progress:
        while True:
            ids = flow_run_ids(api, flow_run_id)
            runs = {found["id"]: found for found in api("POST", "/flow_runs/filter",
                                                  {"flow_runs": {"id": {"any_": ids}}}) or []}
            names.update({run_id: run["name"] for run_id, run in runs.items()})
            unknown_flows = sorted({run["flow_id"] for run in runs.values()} - set(flow_names))
            if unknown_flows:
                flow_names.update({flow["id"]: flow["name"] for flow in api("POST", "/flows/filter", {
                    "flows": {"id": {"any_": unknown_flows}}}) or []})
            flows.update({run_id: flow_names.get(run["flow_id"], "") for run_id, run in runs.items()})
            # Workers send logs in batches, so a line may reach the server after later ones: read back from a
            # minute before the newest line seen, and print each line once.
            window = {"timestamp": {"after_": _minus_a_minute(since)}} if since else {}
            logs = api("POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": ids}, **window},
                                                "sort": "TIMESTAMP_ASC", "limit": 200}) or []
            unnamed = sorted({entry["task_run_id"] for entry in logs
                              if entry.get("task_run_id") and entry["task_run_id"] not in names})
            if unnamed:  # name a task's lines by the task run (train-steps-1-10), not its flow run
                names.update({task_run["id"]: task_run["name"] for task_run in api(
                    "POST", "/task_runs/filter", {"task_runs": {"id": {"any_": unnamed}}}) or []})
            for entry in logs:
                if entry["id"] in seen_logs:
                    continue
                seen_logs.add(entry["id"])
                since = max(since or entry["timestamp"], entry["timestamp"])
                run_id = entry.get("flow_run_id") or flow_run_id
                step = step_of(entry["message"])
                if step is not None:
                    bars.on_step(run_id, names.get(run_id, ""), flows.get(run_id, ""), *step)
                if all_lines or not is_routine(entry["level"], entry["message"]):
                    bars.progress.console.print(log_line(entry, names), markup=False, highlight=False,
                                                soft_wrap=True)
            for artifact in api("POST", "/artifacts/filter", {"artifacts": {
                    "flow_run_id": {"any_": ids}, "type": {"any_": ["progress"]}}}) or []:
                run_id = artifact["flow_run_id"]
                bars.on_progress(run_id, names.get(run_id, ""), float(artifact["data"] or 0.0))
            state = runs[flow_run_id]["state"]["type"] if flow_run_id in runs else "PENDING"
            if state in TERMINAL:
                ended_polls += 1
                if ended_polls >= 3:  # the worker's last log batch arrives after the final state: wait for it
                    break
            time.sleep(poll_s)
    final = runs[flow_run_id]
    url = flow_run_url(api_url, flow_run_id)
    entry_point = ENTRY_POINT_OF_FLOW.get(flows.get(flow_run_id, ""))
    result = run_result(api, flow_run_id) if final["state"]["type"] == "COMPLETED" else None
    if result is not None and entry_point is not None:
        print_summary(entry_point, result, url, bars.observed(), console=console)
        return 0
    if final["state"]["type"] == "COMPLETED":  # a flow that publishes no result
        console.print(f"{final['name']}: Completed\nflow run: {url}", markup=False, highlight=False, soft_wrap=True)
        return 0
    message = final["state"].get("message") or final["state"]["name"]
    print(f"rollout: error: flow run {final['name']} {final['state']['name'].lower()}: {message} "
          f"(logs and tracebacks: {url})", file=sys.stderr)
    return 1
