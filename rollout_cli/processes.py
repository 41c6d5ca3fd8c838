"""The processes the CLI starts and stops: Prefect servers, workers and the flow runs a worker executes.

Each is addressed by a recorded PID and checked before it is signalled, since a recorded PID may by now belong to
an unrelated process. Servers and workers are started detached, each leading a process group of its own.
"""

from __future__ import annotations

import os
import signal

import psutil


def is_prefect_process(pid: int) -> bool:
    """Alive (not a zombie) and still a Prefect process."""
    try:
        return any("prefect" in part for part in psutil.Process(pid).cmdline())
    except psutil.Error:  # gone, a zombie, or another user's process: not one of ours
        return False


def stop_process_group(pid: int, grace_s: float = 15.0) -> None:
    """SIGTERM the process group `pid` leads (a server's uvicorn children with it); SIGKILL what is left after
    `grace_s`."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    _wait_until_gone(pid, grace_s)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_process_group(pid: int, wait_s: float = 10.0) -> None:
    """SIGKILL the process group `pid` leads, then wait until its parent has reaped it."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    _wait_until_gone(pid, wait_s)


def _wait_until_gone(pid: int, timeout_s: float) -> None:
    try:
        psutil.Process(pid).wait(timeout_s)
    except (psutil.NoSuchProcess, psutil.TimeoutExpired):
        pass


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
