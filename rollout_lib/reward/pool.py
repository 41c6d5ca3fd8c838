"""A pool of worker processes for sync reward functions, where a call that overruns its timeout is killed.

Each worker (`worker.py`) is its own process, in its own process group, talking over its own socket. A
timed-out worker's group gets SIGTERM, then SIGKILL after `kill_grace_s` (so subprocesses the reward function
started die too); it is reaped, and its slot gets a fresh process on next use. The other workers never notice.
Each worker acknowledges a call before running it, so a worker that died while idle (the OOM killer, say) but
still looked alive is told apart from one that died in the function: the first kind of call is given to a
fresh worker once, the second is a missing reward.

Why not ProcessPoolExecutor or pebble (no per-call kill of a process group): docs/rewards.md, "The contract".

Workers start lazily, one call at a time each. Sync functions are pickled once here (a non-picklable one is
refused at construction) and unpickled by reference in the worker, so they must be importable there: defined
at module level of a module on sys.path, not in `__main__` or a closure.

POSIX only (process groups, `loop.add_reader` on sockets). Calls from one event loop at a time
(`RewardLoop.score` runs a fresh loop per call, which is fine: the pool rebinds to it).
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

from rollout_lib.reward import worker as worker_module

# Generous: a cold worker may import torch-sized user modules before it is ready.
STARTUP_TIMEOUT_S = 120.0

# Named through the module object (not only in a string), so the worker's source is in the code version of
# whatever imports the pool (identity/code.py follows imports).
_BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[2]); "
    f"from {worker_module.__name__} import main; main(int(sys.argv[1]))"
)


class RewardTimeout(TimeoutError):
    """A reward call overran its timeout and was stopped (distinct from a TimeoutError the function raises)."""


class RewardWorkerError(RuntimeError):
    """The worker failed (did not start, died mid-call); the message says how."""


class _DiedBeforeTheCall(Exception):
    """The worker's socket closed before it acknowledged the call: the function never ran."""


class WorkerFunctionError(Exception):
    """The reward function itself raised inside the worker; the message is "Type: message" from there."""


@dataclass
class _Worker:
    process: subprocess.Popen
    conn: Connection


async def _wait_readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def on_readable() -> None:
        if not future.done():
            future.set_result(None)

    loop.add_reader(fd, on_readable)
    try:
        await future
    finally:
        loop.remove_reader(fd)


def _importable_paths() -> list[str]:
    # The worker imports what the parent can: same sys.path, including the script dir and cwd entries.
    return [os.path.abspath(p) if p else os.getcwd() for p in sys.path if isinstance(p, str)]


def _exited(process: subprocess.Popen) -> bool:
    """Whether the worker has exited, without reaping it: its zombie keeps its pid, which is its group id, from
    being reused, so `_signal_group` can still reach what it left in its group (a child ignoring SIGTERM)."""
    if process.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped elsewhere: poll() records that, so its pid is never signalled again
        return process.poll() is not None


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    if process.returncode is None:  # not reaped, so its pid (= its group id) cannot have been reused
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass


class SyncWorkerPool:
    """`size` worker processes running `functions[index](item)`."""

    def __init__(self, functions: list[Callable[..., Any]], *, size: int, kill_grace_s: float) -> None:
        if size < 1:
            raise ValueError(f"sync worker pool size must be >= 1, got {size}")
        try:
            self._functions_blob = pickle.dumps(functions)
        except Exception as exc:
            raise TypeError(
                "sync reward functions run in worker processes and must be picklable: define them at module "
                "level of an importable module (functools.partial of one is fine), or make them async. "
                f"Pickling failed with {type(exc).__name__}: {exc}"
            ) from exc
        self._kill_grace_s = kill_grace_s
        self._slots: list[_Worker | None] = [None] * size
        self._idle: asyncio.Queue[int] | None = None
        self._idle_loop: asyncio.AbstractEventLoop | None = None
        self._startup_error: str | None = None
        self._closed = False

    # -- public -----------------------------------------------------------------------------------------------

    async def call(self, index: int, item: Any, timeout_s: float) -> Any:
        """functions[index](item) in a worker. Raises RewardTimeout (the worker was killed), RewardWorkerError
        (the worker failed), or WorkerFunctionError (the function raised)."""
        if self._closed:
            raise RewardWorkerError("sync worker pool is closed")
        idle = self._idle_queue()
        slot = await idle.get()
        try:
            for _ in range(2):
                try:
                    return await self._call_on(slot, await self._live_worker(slot), index, item, timeout_s)
                except _DiedBeforeTheCall:
                    # Killed while idle (the OOM killer, say) but not reapable yet, so it looked alive: the call
                    # never began, so it is safe to give it to a fresh worker, once.
                    continue
            raise RewardWorkerError("reward worker died before the call, twice in a row")
        finally:
            idle.put_nowait(slot)

    def pids(self) -> list[int]:
        """Pids of the live workers (none before the first sync call)."""
        return [w.process.pid for w in self._slots if w is not None and not _exited(w.process)]

    def close(self) -> None:
        """Stop every worker: closing its socket lets an idle one exit; then its group is killed (whatever is
        still running there) and it is reaped. Idempotent."""
        self._closed = True
        workers = [(slot, w) for slot, w in enumerate(self._slots) if w is not None]
        for _, worker in workers:
            worker.conn.close()
        deadline = time.monotonic() + self._kill_grace_s
        for slot, worker in workers:
            while not _exited(worker.process) and time.monotonic() < deadline:
                time.sleep(0.01)
            self._discard_now(slot, worker)

    # -- internals --------------------------------------------------------------------------------------------

    def _idle_queue(self) -> asyncio.Queue[int]:
        # asyncio queues belong to one loop; `RewardLoop.score` makes a new loop per call, so rebind.
        loop = asyncio.get_running_loop()
        if self._idle_loop is not loop:
            self._idle = asyncio.Queue()
            for slot in range(len(self._slots)):
                self._idle.put_nowait(slot)
            self._idle_loop = loop
        assert self._idle is not None
        return self._idle

    async def _live_worker(self, slot: int) -> _Worker:
        worker = self._slots[slot]
        if worker is None or _exited(worker.process):  # never started, or died while idle
            if worker is not None:
                self._discard_now(slot, worker)
            worker = await self._start(slot)
        return worker

    async def _start(self, slot: int) -> _Worker:
        if self._startup_error is not None:
            # One failed start means the functions cannot be loaded in a child; retrying per call would only
            # repeat that slowly.
            raise RewardWorkerError(self._startup_error)
        ours, theirs = socket.socketpair()
        with theirs:
            process = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(theirs.fileno()), json.dumps(_importable_paths())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: killable as a unit, deaf to the terminal's Ctrl-C
            )
        worker = _Worker(process, Connection(ours.detach()))
        self._slots[slot] = worker
        try:
            worker.conn.send_bytes(self._functions_blob)
            await asyncio.wait_for(_wait_readable(worker.conn.fileno()), STARTUP_TIMEOUT_S)
            kind, payload = worker.conn.recv()
        except (asyncio.TimeoutError, EOFError, OSError) as exc:
            await self._discard(slot, worker)
            how = "timed out" if isinstance(exc, asyncio.TimeoutError) else f"exited ({worker.process.returncode})"
            self._startup_error = f"reward worker failed to start: {how}; see its stderr"
            raise RewardWorkerError(self._startup_error) from None
        except BaseException:
            self._discard_now(slot, worker)
            raise
        if kind != "ready":
            await self._discard(slot, worker)
            self._startup_error = f"reward worker could not load the reward functions: {payload}"
            raise RewardWorkerError(self._startup_error)
        return worker

    async def _call_on(self, slot: int, worker: _Worker, index: int, item: Any, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        started = False
        try:
            worker.conn.send((index, item))
            while True:
                await asyncio.wait_for(_wait_readable(worker.conn.fileno()), max(0.0, deadline - time.monotonic()))
                kind, payload = worker.conn.recv()
                if kind != "started":
                    break
                started = True
        except asyncio.TimeoutError:
            await self._discard(slot, worker)  # the only way to stop a sync function: end its process
            raise RewardTimeout from None
        except (EOFError, OSError):
            await self._discard(slot, worker)
            if not started:
                raise _DiedBeforeTheCall from None
            raise RewardWorkerError(f"reward worker died mid-call (exit code {worker.process.returncode})") from None
        except BaseException:
            # Cancelled mid-call (the caller gave up, Ctrl-C): the late reply would desync the socket; end it.
            self._discard_now(slot, worker)
            raise
        if kind == "ok":
            return payload
        raise WorkerFunctionError(payload)

    async def _discard(self, slot: int, worker: _Worker) -> None:
        """SIGTERM the group, give it the grace period without blocking the loop, then `_discard_now`."""
        _signal_group(worker.process, signal.SIGTERM)
        try:
            deadline = time.monotonic() + self._kill_grace_s
            while not _exited(worker.process) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:  # also when cancelled during the grace period
            self._discard_now(slot, worker)

    def _discard_now(self, slot: int, worker: _Worker) -> None:
        """SIGKILL the group and reap (a zombie still answers os.kill(pid, 0)); blocking, so cancellation paths,
        where awaiting is not an option, use it directly."""
        if self._slots[slot] is worker:
            self._slots[slot] = None
        worker.conn.close()
        _signal_group(worker.process, signal.SIGKILL)
        worker.process.wait()
