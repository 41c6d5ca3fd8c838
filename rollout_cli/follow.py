"""`rollout follow FLOW_RUN_ID`: watch a deployment's flow run as `rollout train` shows an in-process one. The
flow's own log lines (and its subflows', for rlhf) as they arrive, a progress bar from the run's progress artifact,
and at the end its summary artifacts (headline metric before -> after, final checkpoint), where the curves are and
the run's UI page. Not `prefect deployment run --watch`, which prints the server's raw state-change events.

Reads the Prefect REST API at PREFECT_API_URL (`eval "$(rollout stack env)"` for the project's stack); exits 0
when the run completed, 1 when it failed, crashed or was cancelled, 2 when there is no such run.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime

import click

TERMINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


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


def _minus_a_minute(timestamp: str) -> str:
    from datetime import timedelta

    return (datetime.fromisoformat(timestamp.replace("Z", "+00:00")) - timedelta(minutes=1)).isoformat()


@click.command("follow")
@click.argument("flow_run_id")
@click.option("--poll", "poll_s", default=1.0, show_default=True, metavar="SECONDS", help="between API reads")
def follow(flow_run_id: str, poll_s: float) -> int:
    """Follow flow run FLOW_RUN_ID (e.g. from `prefect deployment run ...`) until it ends: its log lines, a
    progress bar, then its summary."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    api_url = os.environ.get("PREFECT_API_URL")
    if not api_url:
        raise click.UsageError('PREFECT_API_URL is not set: eval "$(rollout stack env)" first')
    api = Api(api_url)
    try:
        root = api("GET", f"/flow_runs/{flow_run_id}")
    except urllib.error.HTTPError as exc:
        print(f"rollout: error: no flow run {flow_run_id} at {api_url} (HTTP {exc.code})", file=sys.stderr)
        return 2
    console = Console(stderr=True)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                        TimeRemainingColumn(), console=console, transient=False)
    bars: dict[str, int] = {}
    names: dict[str, str] = {}  # flow and task run ids -> their names
    seen_logs: set[str] = set()
    since = root.get("created")
    ended_polls = 0
    with progress:
        while True:
            ids = flow_run_ids(api, flow_run_id)
            runs = {run["id"]: run for run in api("POST", "/flow_runs/filter",
                                                  {"flow_runs": {"id": {"any_": ids}}}) or []}
            names.update({run_id: run["name"] for run_id, run in runs.items()})
            # Workers send logs in batches, so a line may reach the server after later ones: read back from a
            # minute before the newest line seen, and print each line once.
            window = {"timestamp": {"after_": _minus_a_minute(since)}} if since else {}
            logs = api("POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": ids}, **window},
                                                "sort": "TIMESTAMP_ASC", "limit": 200}) or []
            unnamed = sorted({entry["task_run_id"] for entry in logs
                              if entry.get("task_run_id") and entry["task_run_id"] not in names})
            if unnamed:  # name a task's lines by the task run (train-segment-steps-1-10), not its flow run
                names.update({task_run["id"]: task_run["name"] for task_run in api(
                    "POST", "/task_runs/filter", {"task_runs": {"id": {"any_": unnamed}}}) or []})
            for entry in logs:
                if entry["id"] not in seen_logs:
                    seen_logs.add(entry["id"])
                    progress.console.print(log_line(entry, names), markup=False, highlight=False, soft_wrap=True)
                    since = max(since or entry["timestamp"], entry["timestamp"])
            for artifact in api("POST", "/artifacts/filter", {"artifacts": {
                    "flow_run_id": {"any_": ids}, "type": {"any_": ["progress"]}}}) or []:
                key = artifact["key"] or artifact["id"]
                if key not in bars:
                    bars[key] = progress.add_task(artifact.get("description") or key, total=100.0)
                progress.update(bars[key], completed=float(artifact["data"] or 0.0))
            state = runs[flow_run_id]["state"]["type"] if flow_run_id in runs else "PENDING"
            if state in TERMINAL and not any(entry["id"] not in seen_logs for entry in logs):
                ended_polls += 1
                if ended_polls >= 3:  # the worker's last log batch arrives after the final state: wait for it
                    break
            time.sleep(poll_s)
    final = runs[flow_run_id]["state"]
    artifacts = api("POST", "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": ids}},
                                                  "sort": "CREATED_DESC"}) or []
    for artifact in reversed(artifacts):  # oldest first: rlhf's stage summaries, then its own
        if (artifact["key"] or "").endswith("-summary"):
            console.print(artifact["data"], markup=False, highlight=False, soft_wrap=True)
        elif (artifact["key"] or "").endswith("-curves"):
            console.print(f"curves: artifact {artifact['key']} (`rollout runs plot` writes the PNG)", markup=False,
                          soft_wrap=True)
    message = f": {final['message']}" if final["type"] != "COMPLETED" and final.get("message") else ""
    console.print(f"{root['name']}: {final['name']}{message}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"flow run: {api_url.rstrip('/').removesuffix('/api')}/runs/flow-run/{flow_run_id}", markup=False,
                  soft_wrap=True)
    return 0 if final["type"] == "COMPLETED" else 1
