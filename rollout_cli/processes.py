"""The processes the CLI starts and stops: Prefect servers, workers and the flow runs a worker executes.

Each is addressed by a recorded PID and checked before it is signalled, since a recorded PID may by now belong to
an unrelated process. Servers and workers are started detached, each leading a process group of its own; the
group helpers live in rollout_lib.processes (vLLM servers use them too).
"""

from __future__ import annotations

import psutil

from rollout_lib.processes import cmdline_contains
from rollout_lib.processes import kill_process_group, stop_process_group  # noqa: F401 (the CLI's, re-exported)


def is_prefect_process(pid: int) -> bool:
    """Alive (not a zombie) and still a Prefect process."""
    return cmdline_contains(pid, "prefect")


def flow_run_processes(worker_pid: int) -> dict[int, str | None]:
    """A worker's child processes (one per flow run it executes) -> the id of the flow run each executes."""
    try:
        children = psutil.Process(worker_pid).children()
    except psutil.Error:
        return {}
    return {child.pid: _flow_run_id(child) for child in children}


def executes_flow_run(pid: int, flow_run_id: str) -> bool:
    """Whether process `pid` is alive and executes this flow run."""
    try:
        return _flow_run_id(psutil.Process(pid)) == flow_run_id
    except psutil.Error:
        return False


def _flow_run_id(process: psutil.Process) -> str | None:
    """The worker names the flow run in the environment of the process it starts for it."""
    try:
        return process.environ().get("PREFECT__FLOW_RUN_ID")
    except psutil.Error:
        return None
