"""The sync reward worker process: runs reward functions by index for its parent (`pool.SyncWorkerPool`).

Started as `python -c` with the parent's sys.path, not through multiprocessing: spawn and forkserver re-run
the parent's `__main__` in every child (a CLI that imports Prefect costs seconds per worker), and a killed
worker should cost one cheap restart. Imports stay light for the same reason.

Protocol over one socket: the parent sends the pickled function list; the worker answers ("ready", pid) or
("startup_error", "Type: message"), then answers each (function_index, RewardInput) with ("started", None) as soon
as it has it, then ("ok", value) or ("err", "Type: message"). An EOF on the socket means shut down.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from multiprocessing.connection import Connection


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _exit_when_orphaned() -> None:
    # If the parent dies hard (SIGKILL, OOM), a worker stuck in a hung function would live forever; being
    # re-parented is the portable sign.
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def main(fd: int) -> None:
    threading.Thread(target=_exit_when_orphaned, daemon=True).start()
    conn = Connection(fd)
    try:
        functions = pickle.loads(conn.recv_bytes())  # imports the functions' modules, outside any timeout
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the calls loudly
        conn.send(("startup_error", describe(exc)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            index, item = conn.recv()
        except EOFError:  # the parent closed the socket: shutdown
            return
        conn.send(("started", None))  # lets the parent tell "died before the call" (safe to retry) from "during"
        try:
            reply = ("ok", functions[index](item))
        except BaseException as exc:  # noqa: BLE001 - SystemExit from user code must not end the worker
            reply = ("err", describe(exc))
        try:
            conn.send(reply)  # pickles fully before writing, so a failure here leaves the socket clean
        except Exception as exc:  # noqa: BLE001
            conn.send(("err", f"TypeError: reward value could not be sent back: {describe(exc)}"))
