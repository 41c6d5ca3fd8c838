"""Processes rollout starts detached and stops later by a recorded PID: Prefect servers and workers (rollout_cli),
vLLM servers (rollout_lib.serving.engine).

Each is started as the leader of its own process group (`start_new_session=True`), so stopping the group stops its
children too. A recorded PID is checked before it is signalled, since by now it may belong to an unrelated process.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import psutil


def cmdline_contains(pid: int, word: str) -> bool:
    """Alive (not a zombie) and `word` (case-insensitive) is part of its command line."""
    word = word.lower()
    try:
        return any(word in part.lower() for part in psutil.Process(pid).cmdline())
    except psutil.Error:  # gone, a zombie, or another user's process: not one of ours
        return False


def group_members(pgid: int) -> list[psutil.Process]:
    """The live processes of process group `pgid` (its leader may be gone while children remain)."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process)
        except (OSError, psutil.Error):
            continue
    return members


def stop_process_group(pid: int, grace_s: float = 15.0) -> None:
    """SIGTERM the process group `pid` leads (a server's children with it); SIGKILL what is left after
    `grace_s`."""
    stop_process_groups([pid], grace_s)


def stop_process_groups(pids: list[int], grace_s: float = 15.0) -> None:
    """`stop_process_group` for several groups at once: all get SIGTERM, then one shared grace period."""
    signalled = []
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGTERM)
            signalled.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace_s
    for pid in signalled:
        _wait_until_gone(pid, max(0.0, deadline - time.monotonic()))
    for pid in signalled:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
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


def free_port(preferred: int | None = None) -> int:
    """`preferred` if it is free on 127.0.0.1, else any free port."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", preferred or 0))
        except OSError:
            sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports (all held open together while chosen, so none is picked twice)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT does not count
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
