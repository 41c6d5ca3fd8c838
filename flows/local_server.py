"""A project-local Prefect server that the CLI starts on demand, records by PID, and reuses.

Without PREFECT_API_URL every Prefect process would start its own temporary server, which a hard-killed process
leaves running. Instead the CLI uses one long-lived server under `.rollout/prefect` (its own PREFECT_HOME and
SQLite database), started detached and recorded in `.rollout/prefect/server.json`; `rollout stack stop` stops it
by that PID. A SIGKILLed training process therefore leaves nothing unmanaged behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


# Settings for every Prefect server rollout starts (the project-local one, the stack's, the tests'). The task run
# recorder writes each task-run event in its own INSERT by default; a training step is a task run, and on a 2-core
# machine those per-event writes took ~15 ms of server CPU per step away from training. Batched, task runs reach
# the database (and the UI) at most TASK_RUN_FLUSH_S later.
TASK_RUN_FLUSH_S = 1.0
SERVER_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_UI_ENABLED": "true",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": str(TASK_RUN_FLUSH_S),
}


def state_dir() -> Path:
    return Path(os.environ.get("ROLLOUT_STATE_DIR", ".rollout")).resolve()


def prefect_home() -> Path:
    return state_dir() / "prefect"


def record_path() -> Path:
    return prefect_home() / "server.json"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_healthy(api_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout) as response:
            return response.status == 200
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_record() -> dict | None:
    try:
        record = json.loads(record_path().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return record if pid_alive(record["pid"]) else None


def start_server(wait_s: float = 90.0, port: int | None = None) -> dict:
    """Start `prefect server start` detached (own session, so it outlives this process) and wait for health."""
    home = prefect_home()
    home.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    env = {**SERVER_ENV, **os.environ, "PREFECT_HOME": str(home)}  # what the user set wins
    env.pop("PREFECT_API_URL", None)
    log = (home / "server.log").open("ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
    )
    api_url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prefect server exited with code {process.returncode}; see {home / 'server.log'}")
        if is_healthy(api_url):
            record = {"pid": process.pid, "port": port, "api_url": api_url, "ui_url": f"http://127.0.0.1:{port}",
                      "prefect_home": str(home)}
            record_path().write_text(json.dumps(record, indent=2))
            return record
        time.sleep(0.5)
    os.killpg(process.pid, signal.SIGTERM)
    raise RuntimeError(f"prefect server did not become healthy within {wait_s:.0f}s; see {home / 'server.log'}")


def ensure_server() -> dict:
    record = read_record()
    if record and is_healthy(record["api_url"]):
        return record
    return start_server()


def stop_server() -> bool:
    record = read_record()
    if record is None:
        record_path().unlink(missing_ok=True)
        return False
    stop_process_group(record["pid"])
    record_path().unlink(missing_ok=True)
    return True


def stop_process_group(pid: int, timeout_s: float = 15.0) -> None:
    """SIGTERM the process group (the server's uvicorn children with it), SIGKILL what is left after a grace."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def use_prefect_api() -> str:
    """Point this process at a Prefect API: PREFECT_API_URL if set, else the project-local server."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    record = ensure_server()
    os.environ["PREFECT_API_URL"] = record["api_url"]
    os.environ["PREFECT_HOME"] = record["prefect_home"]
    return record["api_url"]
