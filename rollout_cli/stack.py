"""The local stack deployments run on: a Prefect server, the `rollout-process` work pool, the deployments of
`prefect.yaml`, and one process worker (`rollout stack start|stop|status|env`, docs/deployments.md).

`start` uses the server named by PREFECT_API_URL when that variable is set and the server answers (not started
here, so never stopped here), else the project-local server of `local_server` (started if needed). It creates the
work pool if missing, runs `prefect deploy --all`, starts a worker detached in its own session, and records what
it started in `.rollout/stack.json`; `stop` ends exactly those processes, by their recorded PIDs, and is
idempotent. Talking to the server goes through Prefect's client; deploying and the worker are the `prefect`
commands a user would run.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from rollout_cli import local_server
from rollout_cli.local_server import is_healthy, state_dir
from rollout_cli.processes import (executes_flow_run, flow_run_processes, is_prefect_process, kill_process_group,
                                   stop_process_group)
from rollout_lib.paths import PROJECT_ROOT

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import WorkPoolFilter
    from prefect.client.schemas.objects import FlowRun
    from prefect.client.schemas.responses import DeploymentResponse

WORK_POOL = "rollout-process"
DEFAULT_PORT = 4200  # the port Prefect users expect; any free port when it is taken
WORKER_READY_S = 60.0
PENDING_GRACE_S = 120.0  # a Pending run without a process may be one a worker is starting right now
ACTIVE_STATES = ("RUNNING", "PENDING", "CANCELLING")  # the server believes a process executes the run

# Every run the stack's worker starts inherits this environment (plus the deployment's job variables).
WORKER_ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PYTHONUNBUFFERED": "1",
}


class StackError(RuntimeError):
    """The stack could not be started or inspected; the message says what to look at."""


def record_path() -> Path:
    return state_dir() / "stack.json"


def read_record() -> dict | None:
    try:
        return json.loads(record_path().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _write_record(record: dict) -> None:
    record_path().parent.mkdir(parents=True, exist_ok=True)
    partial = record_path().with_suffix(".json.tmp")
    partial.write_text(json.dumps(record, indent=2))
    partial.replace(record_path())


@contextmanager
def prefect_client(api_url: str) -> Iterator[SyncPrefectClient]:
    """Prefect's client for the server at `api_url`, whatever this process's Prefect settings name."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        yield client


# --- start ----------------------------------------------------------------------------------------------------


def start(port: int | None = None, schedules: bool = True, log=print) -> dict:
    """Bring the stack up; on a running stack, re-deploy and keep the rest. Returns the stack's record."""
    previous = read_record() or {}
    server = _choose_server(port, log)
    env = prefect_env(server["api_url"], server["prefect_home"])
    logs = state_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    record = {"api_url": server["api_url"], "ui_url": server["ui_url"], "prefect_home": server["prefect_home"],
              "server": {"pid": server.get("pid"), "owned": server["owned"]}, "worker": None, "work_pool": WORK_POOL,
              "project_root": str(PROJECT_ROOT), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with prefect_client(server["api_url"]) as client:
        _ensure_work_pool(client, log)
        if server["owned"]:  # a shared server's runs may be executed on other machines
            for name in crash_orphaned_runs(client):
                log(f"flow run {name!r} was left running with no process (stack stopped or machine restarted): "
                    "marked Crashed; rerun it to resume from cache")
        deploy(env, logs / "deploy.log")
        log(f"deployed {', '.join(deployment_names(client))} to work pool {WORK_POOL!r}")
        if not schedules:
            pause_schedules(client)
        log(schedules_line(client))
        record["worker"] = _keep_or_start_worker(previous, record, env, logs / "worker.log", client, log)
    _write_record(record)
    return record


def _choose_server(port: int | None, log) -> dict:
    """PREFECT_API_URL's server if set and answering (not ours to stop), else the project-local one."""
    external = os.environ.get("PREFECT_API_URL")
    local = local_server.read_record()
    if external and not (local and local["api_url"] == external):
        if is_healthy(external):
            log(f"using the Prefect server at PREFECT_API_URL={external} (not started here, never stopped here)")
            home = os.environ.get("PREFECT_HOME") or str(local_server.prefect_home())
            return {"api_url": external, "ui_url": external.removesuffix("/api"), "prefect_home": home,
                    "owned": False}
        log(f"PREFECT_API_URL={external} does not answer; ignoring it and using the project-local server")
    if local and is_healthy(local["api_url"]):
        log(f"Prefect server already running at {local['ui_url']} (pid {local['pid']})")
    else:
        local = local_server.start_server(port=port or local_server.free_port(DEFAULT_PORT))
        log(f"Prefect server started at {local['ui_url']} (pid {local['pid']}, PREFECT_HOME={local['prefect_home']})")
    return {**local, "owned": True}


def prefect_env(api_url: str, prefect_home: str) -> dict[str, str]:
    """The environment of `prefect` commands and the worker: pointed at this server, nothing from ~/.prefect."""
    env = {**WORKER_ENV_DEFAULTS, **os.environ, "PREFECT_API_URL": api_url, "PREFECT_HOME": prefect_home}
    env.pop("PREFECT_PROFILE", None)
    return env


def _prefect_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefect", *args]


def _ensure_work_pool(client: SyncPrefectClient, log) -> None:
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    try:
        client.read_work_pool(WORK_POOL)
    except ObjectNotFound:
        # The template `prefect work-pool create --type process` would use.
        client.create_work_pool(WorkPoolCreate(name=WORK_POOL, type="process",
                                               base_job_template=ProcessWorker.get_default_base_job_template()))
        log(f"work pool {WORK_POOL!r} (process) created")


def deploy(env: dict, log_path: Path) -> None:
    """`prefect --no-prompt deploy --all` from the project root, stdin from /dev/null (never a prompt): every
    deployment of prefect.yaml, updated in place."""
    with log_path.open("w") as out:
        done = subprocess.run(_prefect_command("--no-prompt", "deploy", "--all"), env=env, cwd=PROJECT_ROOT,
                              stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise StackError(f"`prefect deploy --all` failed (exit {done.returncode}); see {log_path}:\n"
                         f"{_tail(log_path.read_text())}")


def pause_schedules(client: SyncPrefectClient) -> None:
    """Pause every schedule of the pool's deployments (the server deletes the runs they had already created)."""
    for deployment in _pool_deployments(client):
        for schedule in deployment.schedules:
            client.update_deployment_schedule(deployment.id, schedule.id, active=False)


def _keep_or_start_worker(previous: dict, record: dict, env: dict, log_path: Path, client: SyncPrefectClient,
                          log) -> dict:
    worker = previous.get("worker")
    if worker and is_prefect_process(worker["pid"]):
        if previous.get("api_url") == record["api_url"]:
            log(f"worker already running (pid {worker['pid']})")
            return worker
        stop_process_group(worker["pid"], grace_s=5)  # it polls a server this stack no longer uses
        log(f"stopped the previous worker (pid {worker['pid']}) of {previous.get('api_url')}")

    name = f"rollout-worker-{secrets.token_hex(3)}"
    with log_path.open("ab") as out:
        process = subprocess.Popen(
            _prefect_command("worker", "start", "--pool", WORK_POOL, "--type", "process", "--name", name),
            env=env, cwd=PROJECT_ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,  # it outlives this command
        )
    worker = {"pid": process.pid, "name": name, "log": str(log_path)}
    _write_record({**record, "worker": worker})  # before the wait: `stop` finds it even if this command dies now
    deadline = time.monotonic() + WORKER_READY_S
    while not worker_online(client, name):
        if process.poll() is not None:
            raise StackError(f"worker exited with code {process.returncode}; see {log_path}:\n"
                             f"{_tail(log_path.read_text(errors='replace'))}")
        if time.monotonic() > deadline:
            stop_process_group(process.pid)
            raise StackError(f"worker did not come online within {WORKER_READY_S:.0f}s; see {log_path}")
        time.sleep(0.5)
    log(f"worker {name} started (pid {process.pid}), polling work pool {WORK_POOL!r}")
    return worker


def worker_online(client: SyncPrefectClient, name: str) -> bool:
    from prefect.client.schemas.objects import WorkerStatus

    return any(worker.name == name and worker.status == WorkerStatus.ONLINE
               for worker in client.read_workers_for_work_pool(WORK_POOL))


def crash_orphaned_runs(client: SyncPrefectClient) -> list[str]:
    """Mark Crashed the pool's runs that the server believes active but no process executes; return their names.

    Such a run holds its deployment's concurrency slot; the server keeps slot leases in memory, so after a server
    restart nothing ever frees it, and with `collision_strategy: ENQUEUE` every later run of the deployment
    (nightly ones included) would wait forever. The worker records each run's process as the run's
    `infrastructure_pid`; the run is orphaned when that process is gone or now executes something else."""
    crashed = []
    for flow_run in _active_runs(client):
        pid = (flow_run.infrastructure_pid or "").rpartition(":")[2]  # "pid" (Prefect 2 wrote "host:pid")
        if pid.isdigit() and executes_flow_run(int(pid), str(flow_run.id)):
            continue
        pending_s = (datetime.now(timezone.utc) - flow_run.state.timestamp).total_seconds()
        if flow_run.state.type == "PENDING" and pending_s < PENDING_GRACE_S:
            continue
        mark_crashed(client, flow_run.id, "no process was executing this run when the stack started")
        crashed.append(flow_run.name)
    return crashed


def mark_crashed(client: SyncPrefectClient, flow_run_id, message: str) -> None:
    """Set a run Crashed unless it has ended meanwhile (the worker may have reported its process's death)."""
    from prefect.states import Crashed

    if client.read_flow_run(flow_run_id).state.type in ACTIVE_STATES:
        client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)


def _active_runs(client: SyncPrefectClient) -> list[FlowRun]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType

    active = FlowRunFilterState(type=FlowRunFilterStateType(any_=list(ACTIVE_STATES)))
    return client.read_flow_runs(flow_run_filter=FlowRunFilter(state=active), work_pool_filter=_on_pool())


def _pool_deployments(client: SyncPrefectClient) -> list[DeploymentResponse]:
    return client.read_deployments(work_pool_filter=_on_pool())


def _on_pool() -> WorkPoolFilter:
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName

    return WorkPoolFilter(name=WorkPoolFilterName(any_=[WORK_POOL]))


def _named_deployments(client: SyncPrefectClient) -> list[tuple[str, DeploymentResponse]]:
    """(`flow/deployment`, the deployment) of every deployment on the pool, by name."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterId

    deployments = _pool_deployments(client)
    flow_ids = [deployment.flow_id for deployment in deployments]
    flows = {flow.id: flow.name for flow in client.read_flows(flow_filter=FlowFilter(id=FlowFilterId(any_=flow_ids)))}
    return sorted(((f"{flows.get(d.flow_id, '?')}/{d.name}", d) for d in deployments), key=lambda pair: pair[0])


def deployment_names(client: SyncPrefectClient) -> list[str]:
    """`flow/deployment` of every deployment on the pool."""
    return [name for name, _ in _named_deployments(client)]


def active_schedules(client: SyncPrefectClient) -> list[str]:
    """Every active schedule of the pool's deployments, as `flow/deployment: cron ... (timezone)`."""
    found = []
    for name, deployment in _named_deployments(client):
        for schedule in deployment.schedules:
            if schedule.active:
                when = getattr(schedule.schedule, "cron", None) or str(schedule.schedule)
                found.append(f"{name}: cron {when!r} ({getattr(schedule.schedule, 'timezone', None) or 'UTC'})")
    return found


def schedules_line(client: SyncPrefectClient) -> str:
    """What `stack start` says of schedules: which run by themselves, and how to pause them."""
    active = active_schedules(client)
    if not active:
        return "no schedule is active: runs start only when asked for"
    return (f"scheduled: {'; '.join(active)}. Pause: rollout stack start --no-schedule (or in the UI, the "
            "deployment's Schedules toggle)")


# --- stop / status / env --------------------------------------------------------------------------------------


def stop(log=print) -> dict:
    """Stop the worker with the flow runs it executes, then the project-local server, by recorded PIDs. A server
    named by PREFECT_API_URL is left alone. Safe to run twice."""
    record = read_record() or {}
    stopped = {"worker": False, "server": False}
    worker = record.get("worker") or {}
    if worker.get("pid") and is_prefect_process(worker["pid"]):
        runs = _stop_worker(worker["pid"], record["api_url"])
        stopped["worker"] = True
        log(f"worker stopped (pid {worker['pid']})" + (f", with {len(runs)} running flow run(s)" if runs else ""))
    record_path().unlink(missing_ok=True)
    # The stack's own server, or one `rollout train` started without a stack: both are the project-local server.
    server = local_server.stop_server()
    if server is not None:
        stopped["server"] = True
        log(f"Prefect server stopped (pid {server['pid']})")
    if not any(stopped.values()):
        log("nothing running; nothing to stop")
    return stopped


def _stop_worker(worker_pid: int, api_url: str) -> dict[int, str | None]:
    """Stop a worker and the flow run processes it started (children in sessions of their own); return those."""
    # The flow runs are killed outright and marked Crashed while the server is still up: under SIGTERM, Prefect
    # 3.8.8's engine reports a misleading Failed ("Task run is not set") or nothing at all. A rerun resumes from
    # cache.
    runs = flow_run_processes(worker_pid)
    for pid in runs:
        kill_process_group(pid)
    if any(runs.values()) and is_healthy(api_url):
        with prefect_client(api_url) as client:
            for flow_run_id in filter(None, runs.values()):
                mark_crashed(client, flow_run_id, "the flow run process was killed by `rollout stack stop`")
    # The worker turns SIGTERM into a graceful shutdown that can hang; SIGKILL follows after a grace.
    stop_process_group(worker_pid, grace_s=5)
    return runs


def status() -> dict:
    """What runs and answers, as JSON-ready data; `running` when the server answers and the worker is alive."""
    record = read_record()
    if record is None:  # no stack; a run of `rollout train` may still have started the home's server
        server = local_server.read_record()
        return {"running": False, "home": str(state_dir()),
                "server": None if server is None else {"pid": server["pid"], "ui_url": server["ui_url"],
                                                       "healthy": is_healthy(server["api_url"])}}
    worker = record.get("worker") or {}
    server = record.get("server") or {}
    healthy = is_healthy(record["api_url"])
    alive = bool(worker.get("pid")) and is_prefect_process(worker["pid"])
    report = {"running": healthy and alive, "home": str(state_dir()), "ui_url": record["ui_url"],
              "api_url": record["api_url"],
              "server": {"pid": server.get("pid"), "owned": server.get("owned"), "healthy": healthy},
              "worker": {**worker, "alive": alive, "online": False}, "work_pool": record.get("work_pool")}
    if healthy:
        with prefect_client(record["api_url"]) as client:
            report["worker"]["online"] = bool(worker.get("name")) and worker_online(client, worker["name"])
            report["deployments"] = deployment_names(client)
    return report


def shell_env() -> str:
    """`eval "$(rollout stack env)"` points the `prefect` CLI of this shell at the stack's server."""
    record = read_record()
    if record is None:
        raise StackError("no stack is running; start it with `rollout stack start`")
    return f"export PREFECT_API_URL={record['api_url']}\nexport PREFECT_HOME={record['prefect_home']}\n"


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
