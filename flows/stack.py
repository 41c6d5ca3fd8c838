"""The local stack the deployments run on: a Prefect server, the `rollout-process` work pool, the deployments of
`prefect.yaml`, and one process worker. `rollout stack start|stop|status|env`.

`start` reuses the project-local server of flows/local_server.py (started if needed, under `.rollout/prefect`
with its own PREFECT_HOME and SQLite database), or the server named by PREFECT_API_URL when that variable is set
and the server answers. It creates the work pool if missing, runs `prefect --no-prompt deploy --all` from the
project root (stdin from /dev/null: never a prompt), starts a worker detached in its own session, and records
what it started in `.rollout/stack.json`. `stop` ends exactly those processes, by their recorded PIDs (whole
process groups), and is idempotent. A server that the stack did not start (PREFECT_API_URL) is never stopped.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from flows import local_server
from flows.local_server import is_healthy, pid_alive, state_dir, stop_process_group

PROJECT_ROOT = Path(__file__).resolve().parent.parent
WORK_POOL = "rollout-process"
DEFAULT_PORT = 4200  # the port Prefect users expect; any free port when it is taken
WORKER_READY_S = 60.0

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
    tmp = record_path().with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(record_path())


# --- start ----------------------------------------------------------------------------------------------------


def start(port: int | None = None, schedules: bool = True, log=print) -> dict:
    """Bring the stack up (idempotent: a running stack is re-deployed and kept); return its record."""
    record = read_record() or {}
    server = _server(port, log)
    env = prefect_env(server["api_url"], server["prefect_home"])
    logs = state_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    ensure_work_pool(env, log)
    if server["owned"]:
        for name in crash_orphaned_runs(server["api_url"]):
            log(f"flow run {name!r} was left running with no process (stack stopped or machine restarted): "
                "marked Crashed; rerun it to resume from cache")
    deploy(env, logs / "deploy.log", log)
    if not schedules:
        set_schedules_active(server["api_url"], False)
        log("schedules paused (runs start only when asked for)")

    new_record = {
        "api_url": server["api_url"],
        "ui_url": server["ui_url"],
        "prefect_home": server["prefect_home"],
        "server": {"pid": server.get("pid"), "owned": server["owned"]},
        "worker": None,
        "work_pool": WORK_POOL,
        "project_root": str(PROJECT_ROOT),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    worker = record.get("worker")
    if worker and _is_prefect_process(worker["pid"]) and record.get("api_url") != server["api_url"]:
        stop_process_group(worker["pid"], timeout_s=5)  # it polls a server this stack no longer uses
        log(f"stopped the previous worker (pid {worker['pid']}) of {record.get('api_url')}")
    if worker and _is_prefect_process(worker["pid"]):
        log(f"worker already running (pid {worker['pid']})")
        new_record["worker"] = worker
    else:
        # Recorded as soon as it exists, so that `stop` finds it even if this command dies while waiting.
        def remember(started: dict) -> None:
            new_record["worker"] = started
            _write_record(new_record)

        worker = start_worker(env, logs / "worker.log", on_started=remember)
        log(f"worker {worker['name']} started (pid {worker['pid']}), polling work pool {WORK_POOL!r}")
        new_record["worker"] = worker
    _write_record(new_record)
    return new_record


def _server(port: int | None, log) -> dict:
    """The server to use: PREFECT_API_URL if set and answering (not ours to stop), else the project-local one."""
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
        local = local_server.start_server(port=port or _default_port())
        log(f"Prefect server started at {local['ui_url']} (pid {local['pid']}, PREFECT_HOME={local['prefect_home']})")
    return {**local, "owned": True}


def _default_port() -> int | None:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", DEFAULT_PORT))
        except OSError:
            return None  # taken: any free port
    return DEFAULT_PORT


def prefect_env(api_url: str, prefect_home: str) -> dict[str, str]:
    """The environment for `prefect` commands and the worker: pointed at this server, nothing from ~/.prefect."""
    env = {**WORKER_ENV_DEFAULTS, **os.environ, "PREFECT_API_URL": api_url, "PREFECT_HOME": prefect_home}
    env.pop("PREFECT_PROFILE", None)
    return env


def _prefect(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefect", *args]


def ensure_work_pool(env: dict, log=print) -> None:
    inspect = subprocess.run(_prefect("work-pool", "inspect", WORK_POOL), env=env, cwd=PROJECT_ROOT,
                             stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if inspect.returncode == 0:
        return
    create = subprocess.run(_prefect("work-pool", "create", WORK_POOL, "--type", "process"), env=env,
                            cwd=PROJECT_ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if create.returncode != 0:
        raise StackError(f"could not create work pool {WORK_POOL!r}:\n{_tail(create.stdout + create.stderr)}")
    log(f"work pool {WORK_POOL!r} (process) created")


def deploy(env: dict, log_path: Path, log=print) -> None:
    """`prefect --no-prompt deploy --all` from the project root: every deployment in prefect.yaml, updated in place."""
    with log_path.open("w") as out:
        done = subprocess.run(_prefect("--no-prompt", "deploy", "--all"), env=env, cwd=PROJECT_ROOT,
                              stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    text = log_path.read_text()
    if done.returncode != 0:
        raise StackError(f"`prefect deploy --all` failed (exit {done.returncode}); see {log_path}:\n{_tail(text)}")
    names = [line.split("'")[1] for line in text.splitlines() if "Deployment '" in line and "'" in line]
    log(f"deployed {', '.join(names) or 'prefect.yaml'} to work pool {WORK_POOL!r}")


def start_worker(env: dict, log_path: Path, wait_s: float = WORKER_READY_S,
                 on_started: Callable[[dict], None] | None = None) -> dict:
    """A process worker, detached in its own session (it outlives this command); waits until it is online."""
    name = f"rollout-worker-{secrets.token_hex(3)}"
    with log_path.open("ab") as out:
        process = subprocess.Popen(
            _prefect("worker", "start", "--pool", WORK_POOL, "--type", "process", "--name", name),
            env=env, cwd=PROJECT_ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    worker = {"pid": process.pid, "name": name, "log": str(log_path)}
    if on_started is not None:
        on_started(worker)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise StackError(f"worker exited with code {process.returncode}; see {log_path}:\n"
                             f"{_tail(log_path.read_text(errors='replace'))}")
        if worker_online(env["PREFECT_API_URL"], name):
            return worker
        time.sleep(0.5)
    stop_process_group(process.pid)
    raise StackError(f"worker did not come online within {wait_s:.0f}s; see {log_path}")


def worker_online(api_url: str, name: str) -> bool:
    workers = _post(api_url, f"/work_pools/{WORK_POOL}/workers/filter", {}) or []
    return any(w["name"] == name and w.get("status") == "ONLINE" for w in workers)


def set_schedules_active(api_url: str, active: bool) -> None:
    """Pause (or resume) every schedule of every deployment on the work pool. Pausing also deletes the runs the
    schedules had already created (deploying creates the next ones at once)."""
    deployments = _post(api_url, "/deployments/filter", {"work_pools": {"name": {"any_": [WORK_POOL]}}}) or []
    for deployment in deployments:
        for schedule in deployment.get("schedules", []):
            _request(api_url, f"/deployments/{deployment['id']}/schedules/{schedule['id']}", {"active": active},
                     method="PATCH")
    if not active and deployments:
        scheduled = _post(api_url, "/flow_runs/filter", {"flow_runs": {
            "deployment_id": {"any_": [d["id"] for d in deployments]}, "state": {"type": {"any_": ["SCHEDULED"]}}}})
        for flow_run in scheduled or []:
            if flow_run.get("auto_scheduled"):
                _request(api_url, f"/flow_runs/{flow_run['id']}", None, method="DELETE")


def crash_orphaned_runs(api_url: str, pending_grace_s: float = 120.0) -> list[str]:
    """Mark Crashed the runs of this pool that the server thinks are running but no process executes.

    Such a run holds its deployment's concurrency slot; the server keeps slot leases in memory, so after a server
    restart nothing ever frees it, and with `collision_strategy: ENQUEUE` every later run of the deployment
    (nightly ones included) would wait forever. Linux only (/proc); elsewhere nothing is touched."""
    if not Path("/proc/self/environ").exists():
        return []
    live = {run_id for pid in _all_pids() if (run_id := _flow_run_id(pid))}
    flow_runs = _post(api_url, "/flow_runs/filter", {
        "flow_runs": {"state": {"type": {"any_": ["RUNNING", "PENDING", "CANCELLING"]}}},
        "work_pools": {"name": {"any_": [WORK_POOL]}},
    }) or []
    crashed = []
    for flow_run in flow_runs:
        if flow_run["id"] in live:
            continue
        if flow_run["state"]["type"] == "PENDING" and _age_s(flow_run["state"]["timestamp"]) < pending_grace_s:
            continue  # a worker may be starting its process right now
        _mark_crashed(api_url, flow_run["id"], "no process was executing this run when the stack started")
        crashed.append(flow_run["name"])
    return crashed


# --- stop / status --------------------------------------------------------------------------------------------


def stop(log=print) -> dict:
    """Stop the worker, then the server if the stack owns it, by recorded PIDs. Safe to run twice."""
    record = read_record()
    stopped = {"worker": False, "server": False}
    if record is not None:
        worker = record.get("worker") or {}
        if worker.get("pid") and _is_prefect_process(worker["pid"]):
            # Flow runs are the worker's children, in sessions of their own. They are killed outright and their
            # runs marked Crashed while the server is still up: under SIGTERM, Prefect 3.8.8's engine reports a
            # misleading Failed ("Task run is not set") or nothing at all. A rerun resumes from cache.
            runs = {pid: _flow_run_id(pid) for pid in _children(worker["pid"])}
            for pid in runs:
                _kill_group(pid)
            for flow_run_id in filter(None, runs.values()):
                _mark_crashed(record["api_url"], flow_run_id, "the flow run process was killed by `rollout stack stop`")
            # The worker turns SIGTERM into a graceful shutdown that can hang; SIGKILL follows after a grace.
            stop_process_group(worker["pid"], timeout_s=5)
            stopped["worker"] = True
            log(f"worker stopped (pid {worker['pid']})" + (f", with {len(runs)} running flow run(s)" if runs else ""))
        server = record.get("server") or {}
        if server.get("owned") and server.get("pid") and _is_prefect_process(server["pid"]):
            stop_process_group(server["pid"])
            stopped["server"] = True
            log(f"Prefect server stopped (pid {server['pid']})")
        record_path().unlink(missing_ok=True)
    # The project-local server may also have been started by `rollout train` alone, without a stack.
    local = local_server.read_record()
    if local is not None and _is_prefect_process(local["pid"]):
        stop_process_group(local["pid"])
        stopped["server"] = True
        log(f"Prefect server stopped (pid {local['pid']})")
    local_server.record_path().unlink(missing_ok=True)
    if not any(stopped.values()):
        log("nothing running; nothing to stop")
    return stopped


def status() -> dict:
    record = read_record()
    if record is None:
        return {"running": False}
    worker = record.get("worker") or {}
    server = record.get("server") or {}
    healthy = is_healthy(record["api_url"])
    report = {
        "running": healthy and bool(worker.get("pid")) and _is_prefect_process(worker["pid"]),
        "ui_url": record["ui_url"],
        "api_url": record["api_url"],
        "server": {"pid": server.get("pid"), "owned": server.get("owned"), "healthy": healthy},
        "worker": {**worker, "alive": bool(worker.get("pid")) and _is_prefect_process(worker["pid"]),
                   "online": healthy and bool(worker.get("name")) and worker_online(record["api_url"], worker["name"])},
        "work_pool": record.get("work_pool"),
    }
    if healthy:
        deployments = _post(record["api_url"], "/deployments/filter",
                            {"work_pools": {"name": {"any_": [WORK_POOL]}}}) or []
        flows = {f["id"]: f["name"] for f in _post(record["api_url"], "/flows/filter", {}) or []}
        report["deployments"] = sorted(f"{flows.get(d['flow_id'], '?')}/{d['name']}" for d in deployments)
    return report


def shell_env() -> str:
    """`eval "$(rollout stack env)"` points the `prefect` CLI of this shell at the stack's server."""
    record = read_record()
    if record is None:
        raise StackError("no stack is running; start it with `rollout stack start`")
    return f"export PREFECT_API_URL={record['api_url']}\nexport PREFECT_HOME={record['prefect_home']}\n"


def flow_run_url(ui_url: str, flow_run_id: str) -> str:
    return f"{ui_url}/runs/flow-run/{flow_run_id}"


# --- helpers --------------------------------------------------------------------------------------------------


def _is_prefect_process(pid: int) -> bool:
    """Alive and still a Prefect process: a recycled PID that now belongs to something else is never signalled."""
    if not pid_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return Path("/proc/self").exists() is False  # no procfs (macOS): trust the PID
    except PermissionError:
        return False
    return b"prefect" in cmdline


def _children(pid: int) -> list[int]:
    """PIDs whose parent is `pid` (Linux /proc; empty elsewhere)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:  # fields after "(comm)": state, ppid, ...
            children.append(int(stat.parent.name))
    return children


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.1)  # the worker reaps it; until then it is a zombie that pid_alive still sees


def _all_pids() -> list[int]:
    return [int(path.name) for path in Path("/proc").iterdir() if path.name.isdigit()]


def _age_s(timestamp: str) -> float:
    from datetime import datetime, timezone

    return (datetime.now(timezone.utc) - datetime.fromisoformat(timestamp.replace("Z", "+00:00"))).total_seconds()


def _flow_run_id(pid: int) -> str | None:
    """The flow run a worker's child process executes (the worker puts it in the child's environment)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"PREFECT__FLOW_RUN_ID="):
            return entry.split(b"=", 1)[1].decode()
    return None


def _mark_crashed(api_url: str, flow_run_id: str, message: str) -> None:
    try:
        flow_run = _request(api_url, f"/flow_runs/{flow_run_id}", None, method="GET")
        if flow_run and flow_run["state"]["type"] in ("RUNNING", "PENDING", "CANCELLING"):
            _post(api_url, f"/flow_runs/{flow_run_id}/set_state",
                  {"state": {"type": "CRASHED", "name": "Crashed", "message": message}, "force": True})
    except StackError:
        pass  # the server is gone: nothing left to tell


def _request(api_url: str, path: str, body: dict | None, method: str = "POST"):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{api_url}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise StackError(f"{method} {path}: HTTP {exc.code}: {exc.read()[:300]!r}") from None
    except OSError as exc:
        raise StackError(f"{method} {path}: {exc}") from None
    return json.loads(text) if text else None


def _post(api_url: str, path: str, body: dict):
    return _request(api_url, path, body)


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# --- `rollout stack ...` ----------------------------------------------------------------------------------------


def run_cli(args) -> int:
    try:
        if args.action == "start":
            record = start(port=args.port, schedules=not args.no_schedule)
            print(f"\nstack up: UI {record['ui_url']}\n"
                  f"  eval \"$(rollout stack env)\"      # point `prefect` at it\n"
                  f"  prefect deployment run train-rm/default --watch\n"
                  f"  rollout stack stop                # stop worker and server")
        elif args.action == "stop":
            stop()
        elif args.action == "status":
            report = status()
            print(json.dumps(report, indent=2))
            return 0 if report["running"] else 1
        elif args.action == "env":
            print(shell_env(), end="")
    except StackError as exc:
        print(f"rollout: error: {exc}", file=sys.stderr)
        return 2
    return 0
