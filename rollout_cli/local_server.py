"""The project-local Prefect server: started on demand, recorded by PID, reused, stopped by `rollout stack stop`.

Without PREFECT_API_URL every Prefect process would start a temporary server of its own, which a hard-killed
process leaves running. Instead the CLI uses one long-lived server under `.rollout/prefect` (its own PREFECT_HOME
and SQLite database), started detached and recorded in `.rollout/prefect/server.json`, so a SIGKILLed training
process leaves nothing unmanaged behind.

This module imports no Prefect (`--help` and `--dry-run` stay quick): `use_prefect_api` sets PREFECT_API_URL
before Prefect is first imported, since Prefect reads its settings then, or, where Prefect is imported already,
has them read again (rollout_cli/prefect_settings.py). Its health probe is therefore a plain GET of `/health`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from rollout_cli.prefect_settings import follow_environment
from rollout_cli.processes import is_prefect_process, stop_process_group
from rollout_lib.paths import state_dir
from rollout_lib.processes import free_port

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


def prefect_home() -> Path:
    return state_dir() / "prefect"


def record_path() -> Path:
    return prefect_home() / "server.json"


def is_healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except OSError:
        return False


def read_record() -> dict | None:
    """The recorded server, if its process still runs."""
    try:
        record = json.loads(record_path().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return record if is_prefect_process(record["pid"]) else None


def start_server(port: int | None = None, wait_s: float = 90.0) -> dict:
    """Start `prefect server start` detached (its own session, so it outlives this process), wait until it answers,
    record it."""
    home = prefect_home()
    home.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    env = {**SERVER_ENV, **os.environ, "PREFECT_HOME": str(home)}  # what the user set wins
    env.pop("PREFECT_API_URL", None)
    # The UI's browser code calls the API at this URL; unset, it assumes the default port 4200, and every page of a
    # server on another port shows "Can't connect to Server API".
    env.setdefault("PREFECT_UI_API_URL", f"http://127.0.0.1:{port}/api")
    with (home / "server.log").open("ab") as log:
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
    stop_process_group(process.pid)
    raise RuntimeError(f"prefect server did not become healthy within {wait_s:.0f}s; see {home / 'server.log'}")


def stop_server() -> dict | None:
    """Stop the recorded server; return its record, or None when none was running."""
    record = read_record()
    if record is not None:
        stop_process_group(record["pid"])
    record_path().unlink(missing_ok=True)
    return record


def use_prefect_api() -> str:
    """Point this process at a Prefect API: PREFECT_API_URL if set, else the project-local server."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    record = read_record()
    if not (record and is_healthy(record["api_url"])):
        record = start_server()
    os.environ["PREFECT_API_URL"] = record["api_url"]
    os.environ["PREFECT_HOME"] = record["prefect_home"]
    follow_environment()  # where Prefect is imported already
    return record["api_url"]
