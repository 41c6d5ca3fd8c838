"""A pool of worker processes for sync reward functions, where a call that overruns its timeout is killed.

Why not threads or `concurrent.futures.ProcessPoolExecutor`: a hung thread cannot be stopped, and killing one
executor worker breaks the whole executor. Here each worker is a plain `multiprocessing.Process` talking over
its own pipe, so a timed-out worker is terminated (SIGTERM, then SIGKILL after a grace period), reaped, and
its slot refilled by a fresh process on next use; the other workers never notice.

Protocol: the worker unpickles the reward functions once at start-up (so importing heavy user modules does
not count against the first call's timeout), reports ("ready", pid), then answers each (function_index,
RewardInput) with ("ok", value) or ("err", "Type: message"). One call per worker at a time.

POSIX only: waiting uses `loop.add_reader` on the pipe and on the process sentinel. Calls from one event loop
at a time (`RewardLoop.score` runs a fresh loop per call, which is fine: the pool rebinds to it).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

# Generous: a cold worker imports torch-sized user modules before it is ready.
STARTUP_TIMEOUT_S = 120.0


class RewardWorkerError(RuntimeError):
    """The worker failed (did not start, crashed mid-call); the message says how."""


class RewardTimeout(TimeoutError):
    """A reward call overran its timeout and was stopped (distinct from a TimeoutError the function raises)."""


class WorkerFunctionError(Exception):
    """The reward function itself raised inside the worker; the message is "Type: message" from there."""


def default_start_method() -> str:
    # forkserver: no fork of a parent that holds threads / CUDA state, and cheaper than spawn to replace
    # killed workers. Both re-import the function's module in the child, which is why functions must be
    # importable (module-level), not closures.
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


# --- the worker process --------------------------------------------------------------------------------------


def _exit_when_orphaned() -> None:
    # If the parent dies hard (SIGKILL, OOM), a worker stuck in a hung function would live forever; the parent
    # pid changing (re-parenting) is the portable signal.
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _worker_main(conn: Connection, functions_blob: bytes) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it shuts us down
    threading.Thread(target=_exit_when_orphaned, daemon=True).start()
    try:
        functions = pickle.loads(functions_blob)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the calls loudly
        conn.send(("startup_error", _describe(exc)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            index, item = conn.recv()
        except EOFError:  # parent closed the pipe: shutdown
            return
        try:
            reply = ("ok", functions[index](item))
        except BaseException as exc:  # noqa: BLE001 - SystemExit from user code must not kill the worker
            reply = ("err", _describe(exc))
        try:
            conn.send(reply)  # pickles fully before writing, so a failure here leaves the pipe clean
        except Exception as exc:  # noqa: BLE001
            conn.send(("err", f"TypeError: reward value could not be sent back: {_describe(exc)}"))


# --- the parent side -----------------------------------------------------------------------------------------


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: Connection
    ready: bool = False


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


class SyncWorkerPool:
    """`size` worker processes, started lazily, each running the given functions by index."""

    def __init__(
        self,
        functions: list[Callable[..., Any]],
        *,
        size: int,
        kill_grace_s: float,
        start_method: str | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"sync worker pool size must be >= 1, got {size}")
        try:
            self._functions_blob = pickle.dumps(functions)
        except Exception as exc:
            raise TypeError(
                "sync reward functions run in worker processes and must be picklable: define them at module "
                "level of an importable module (functools.partial of one is fine), or make them async. "
                f"Pickling failed with {_describe(exc)}"
            ) from exc
        self._context = multiprocessing.get_context(start_method or default_start_method())
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
            worker = await self._ready_worker(slot)
            return await self._call_on(slot, worker, index, item, timeout_s)
        finally:
            idle.put_nowait(slot)

    def pids(self) -> list[int]:
        """Pids of the live workers (started lazily, so empty before the first sync call)."""
        return [w.process.pid for w in self._slots if w is not None and w.process.is_alive()]

    def close(self) -> None:
        """Stop every worker: closing its pipe lets an idle one exit; anything still running is killed."""
        self._closed = True
        workers = [w for w in self._slots if w is not None]
        self._slots = [None] * len(self._slots)
        for worker in workers:
            worker.conn.close()
        deadline = time.monotonic() + self._kill_grace_s
        for worker in workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
        for worker in workers:
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()

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

    async def _ready_worker(self, slot: int) -> _Worker:
        if self._startup_error is not None:
            # One failed start means the functions cannot be imported in a child; retrying per call would
            # only repeat that slowly.
            raise RewardWorkerError(self._startup_error)
        worker = self._slots[slot]
        if worker is not None and worker.process.is_alive():
            return worker
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_worker_main, args=(child_conn, self._functions_blob), daemon=True, name=f"reward-worker-{slot}"
        )
        process.start()
        child_conn.close()  # the child holds its own copy; ours would keep EOF from ever arriving
        worker = _Worker(process, parent_conn)
        self._slots[slot] = worker
        try:
            await asyncio.wait_for(_wait_readable(parent_conn.fileno()), STARTUP_TIMEOUT_S)
            kind, payload = parent_conn.recv()
        except (asyncio.TimeoutError, EOFError, OSError) as exc:
            await self._discard(slot, worker)
            detail = "timed out" if isinstance(exc, asyncio.TimeoutError) else f"exited ({process.exitcode})"
            self._startup_error = f"reward worker failed to start: {detail}"
            raise RewardWorkerError(self._startup_error) from None
        except BaseException:
            self._discard_now(slot, worker)
            raise
        if kind != "ready":
            await self._discard(slot, worker)
            self._startup_error = f"reward worker failed to load the reward functions: {payload}"
            raise RewardWorkerError(self._startup_error)
        worker.ready = True
        return worker

    async def _call_on(self, slot: int, worker: _Worker, index: int, item: Any, timeout_s: float) -> Any:
        try:
            worker.conn.send((index, item))
            await asyncio.wait_for(_wait_readable(worker.conn.fileno()), timeout_s)
            kind, payload = worker.conn.recv()
        except asyncio.TimeoutError:
            await self._discard(slot, worker)  # the only way to stop a sync function: end its process
            raise RewardTimeout from None
        except (EOFError, OSError):
            await self._discard(slot, worker)
            raise RewardWorkerError(f"reward worker died mid-call (exit code {worker.process.exitcode})") from None
        except BaseException:
            # Cancelled mid-call (caller gave up, Ctrl-C): the worker's reply would desync the pipe; end it.
            self._discard_now(slot, worker)
            raise
        if kind == "ok":
            return payload
        raise WorkerFunctionError(payload)

    async def _discard(self, slot: int, worker: _Worker) -> None:
        """Terminate, wait up to the grace period without blocking the loop, then kill; always reap."""
        if self._slots[slot] is worker:
            self._slots[slot] = None
        worker.conn.close()
        process = worker.process
        if process.is_alive():
            process.terminate()
            try:
                await asyncio.wait_for(_wait_readable(process.sentinel), self._kill_grace_s)
            except asyncio.TimeoutError:
                process.kill()
        process.join()  # reap, so the pid is really gone (a zombie still answers os.kill(pid, 0))

    def _discard_now(self, slot: int, worker: _Worker) -> None:
        # Blocking variant for cancellation paths, where awaiting is not an option.
        if self._slots[slot] is worker:
            self._slots[slot] = None
        worker.conn.close()
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join()
