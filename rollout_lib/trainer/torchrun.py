"""torchrun (`python -m torch.distributed.run`, same arguments) whose ranks of rollout's own rank modules are forked
from a launcher that imported their heavy dependencies once (issue 39); ended without the interpreter's teardown once
its group has succeeded.

Every data-parallel group (trainer/rank_group.py) and every other node's part (trainer/node_parts.py) runs its ranks
as `python -m rollout_lib.trainer.torchrun ... -m MODULE ARGS`, MODULE one of node_parts.PART_MODULES. Plain torchrun
starts each rank as a fresh `python -u -m MODULE ARGS`, and each paid ~4.3 CPU-s importing torch and transformers'
modeling code (docs/hardware.md, "Ranks forked from their launcher"). Here the launcher parses the arguments as
torchrun does (`parse_args`, `config_from_args`), imports MODULE and PRELOADED, and hands torch's own elastic agent
(`elastic_launch`) a callable entrypoint, `MODULE.main(ARGS)` (ARGS as torchrun would have passed them), with
`LaunchConfig.start_method = "fork"`: the agent's rendezvous, per-rank environment (RANK, LOCAL_RANK, ...,
TORCHELASTIC_ERROR_FILE), error files (`record`), redirects/tee/log specs, its monitoring of the ranks, its SIGTERM
of the others once one fails, and its ChildFailedError summary naming the rank, its exit code or exception and its
error file are torch's, as with plain torchrun. A rank is a process of its own in a session of its own (as torch's
subprocess ranks are), with the signal dispositions the launcher was started with (not the agent's SIGTERM handler,
which would make a SIGTERMed rank exit 1 instead of -15), writing to the launcher's stdout and stderr, unbuffered.
Each ends with `os._exit` (multiprocessing's forked children always do): no teardown of torch after success.

Why fork is safe here: before it forks, the launcher has only imported modules, and with OMP_NUM_THREADS=1 while it
imports (torch starts an OpenMP worker thread at import when more than one thread is allowed; a forked child of a
process with a live OpenMP pool can hang in its first parallel region). `fork_hazard` then checks that no thread
but the main one (and jemalloc's background thread, which jemalloc's own fork handlers cover) runs and that CUDA
is untouched (torch's CUDA state unused, no CUDA driver library loaded); otherwise the ranks start fresh, with a
warning. After that the agent starts its own threads (its TCPStore and rendezvous keep-alive) and forks, as torch's
`--start-method fork` always does; nothing of the launcher's state but the imported modules is used by a rank. Each
rank sets its thread count from OMP_NUM_THREADS as a fresh interpreter would (the trainers pin `run.torch_threads`
anyway). Differences that remain: a forked rank shares the launcher's hash seed and numpy's global random state
(rollout seeds everything from content), and numpy's BLAS has the single thread it was loaded with. A rank whose
launcher is SIGKILLed lives on as a fresh one does (torch's multiprocessing asks for SIGINT then: undone).

On a GPU machine the ranks must be the first to touch CUDA: nothing the launcher imports may initialise it (checked
as above; a fork after CUDA's initialisation is unusable in the child). Each rank then selects its local rank's GPU
(rank_group.join_group). Not yet run on a GPU machine: should a CUDA build of torch map the driver library at import,
`fork_hazard` refuses and the ranks start fresh (safe, not faster).

Why fork and not forkserver: the agent imports torch itself (~1.3 CPU-s); a forkserver is a second interpreter that
imports everything again before it forks the ranks. A launcher and 2 ranks that join a gloo group and end:
fork 4.4-4.6 CPU-s, forkserver 5.8 (and its server outlived the launcher's `os._exit`), a fresh interpreter per rank
10.0-10.1 (/tmp/cgtime, 2 runs each, 2 cores at load 15-20).

`ROLLOUT_RANK_START=fresh` (RANK_START_ENV) starts every rank as a fresh interpreter: plain torchrun, as before;
so does any other module than PART_MODULES, and so does a group over several nodes (for now: `main` says why).
"""

from __future__ import annotations

import ctypes
import importlib
import io
import logging
import os
import signal
import sys
import threading
import time

# Read by the launcher: "fork" (the default) or "fresh" (plain torchrun: a fresh interpreter per rank).
RANK_START_ENV = "ROLLOUT_RANK_START"
RANK_STARTS = ("fork", "fresh")
# What every rank module imports as it starts or builds its trainer, imported once in the launcher: transformers'
# modeling code and its auto classes (a model's own modeling module is imported by the rank that loads it), the
# trainers the specs name (SFT, RM, RL's policy state), what loads a model, and pyarrow's pandas bridge (pandas:
# ~0.3 CPU-s a rank otherwise).
PRELOADED = ("transformers.modeling_utils", "transformers.models.auto.modeling_auto",
             "transformers.models.auto.tokenization_auto", "transformers.generation.utils",
             "rollout_lib.trainer.causal", "rollout_lib.rm.trainer", "rollout_lib.rl.policy_state",
             "rollout_lib.model.loading", "pyarrow.pandas_compat")
# The signals torch's agent handles (its default TORCHELASTIC_SIGNALS_TO_HANDLE): a rank gets them back as they were.
AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
PR_SET_PDEATHSIG = 1  # prctl(2)
# How long a forked rank that raised waits before it ends (RankEntrypoint): many of torch's 0.1-s polls of the ranks.
FAILED_RANK_GRACE_S = 2.0
# Threads allowed in the launcher when it forks: the main thread, and jemalloc's (pyarrow's allocator) background
# thread, which jemalloc's fork handlers stop and restart.
FORK_SAFE_THREADS = ("jemalloc_bg_thd",)

logger = logging.getLogger(__name__)


def rank_start() -> str:
    value = os.environ.get(RANK_START_ENV, "fork")
    if value not in RANK_STARTS:
        print(f"{RANK_START_ENV}={value!r}: expected one of {', '.join(RANK_STARTS)}; unset it for fork",
              file=sys.stderr)
        sys.exit(2)
    return value


class RankEntrypoint:
    """What a forked rank runs: MODULE.main(ARGS), named MODULE in torch's summary, as a fresh rank is."""

    def __init__(self, module: str):
        self.module = module
        self.__name__ = self.__qualname__ = module
        self.launcher = os.getpid()

    def __call__(self, *argv: str) -> None:
        # torch's multiprocessing asks for SIGINT when the launcher dies; a fresh rank outlives a SIGKILLed torchrun
        # (it serves the flow until the flow closes its socket), and so does this one
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads:  # what a fresh interpreter takes from the environment (the launcher imported torch with 1)
            import torch

            torch.set_num_threads(int(threads))
        _unbuffered_std_streams()  # torchrun starts a fresh rank with `python -u`
        try:
            importlib.import_module(self.module).main(list(argv))
        except Exception:
            # torch's agent names one failed forked rank, the first its poll finds ended (a fresh rank's summary
            # lists every one): a rank whose collective failed because a peer died must not be found first
            time.sleep(FAILED_RANK_GRACE_S)
            raise
        # Stopped. The agent learns it from the return value and lets the rank end; with the launcher gone (SIGKILLed:
        # an orphan served the flow until it closed the socket) no agent will, so end as a fresh rank would.
        threading.Thread(target=_end_when_orphaned, args=(self.launcher,), daemon=True).start()


def _end_when_orphaned(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(0.5)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _unbuffered_std_streams() -> None:
    """sys.stdout and sys.stderr as `python -u` makes them (PYTHONUNBUFFERED, which rollout sets, did already)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(getattr(stream, "buffer", None), io.BufferedIOBase):
            continue  # unbuffered already, or no file behind it
        stream.flush()
        setattr(sys, name, io.TextIOWrapper(io.FileIO(stream.fileno(), "w", closefd=False), encoding=stream.encoding,
                                            errors=stream.errors, line_buffering=stream.line_buffering,
                                            write_through=True))


def unknown_threads() -> list[str]:
    """The names of this process's threads but the main one and FORK_SAFE_THREADS."""
    names = []
    for task in os.listdir("/proc/self/task"):
        if int(task) == os.getpid():
            continue
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                name = comm.read().strip()
        except OSError:  # ended meanwhile
            continue
        if name not in FORK_SAFE_THREADS:
            names.append(name)
    return names


def fork_hazard() -> str | None:
    """Why this process must not fork ranks (a thread besides the main one and FORK_SAFE_THREADS, CUDA touched),
    or None."""
    threads = unknown_threads()
    if threads:
        return f"{len(threads)} thread(s) besides the main one run in the launcher ({', '.join(threads)})"
    import torch

    if torch.cuda.is_initialized():
        return "torch has initialised CUDA in the launcher"
    with open("/proc/self/maps") as maps:
        if "libcuda.so" in maps.read():
            return "the CUDA driver library is loaded in the launcher"
    return None


def _after_fork_in_child(launcher: int, dispositions: dict) -> None:
    """In each forked rank, first: a session of its own (torch's subprocess ranks start one), and the signal
    dispositions the launcher started with (the agent's handlers raise SignalException). Not in a process a rank
    forks itself (it inherits this hook)."""
    if os.getppid() != launcher:
        return
    os.setsid()
    for signum, disposition in dispositions.items():
        signal.signal(signum, disposition)


def launch_forked(args, module: str) -> None:
    """torch.distributed.run.run(args), the ranks forked from this process running `module`'s main."""
    import uuid

    import torch.multiprocessing
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    torch.multiprocessing._set_thread_name("pt_elastic")
    # as torch.distributed.run.run settles the rendezvous before config_from_args
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, command = config_from_args(args)
    # torchrun's command for a fresh rank: `-u -m MODULE ARGS` (its --local-rank among them where it adds one)
    if command[:3] != ["-u", "-m", module]:
        raise RuntimeError(f"unexpected torchrun command for {module}: {command}")
    config.start_method = "fork"
    elastic_launch(config=config, entrypoint=RankEntrypoint(module))(*command[3:])


def main(argv: list[str] | None = None) -> None:
    """torchrun with `argv` (sys.argv[1:]); its ranks forked when they run one of rollout's rank modules."""
    if rank_start() == "fresh":
        from torch.distributed.run import main as torchrun

        torchrun(argv)
        return
    # Import torch single-threaded (module docstring); the ranks get the environment's value back.
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import parse_args, run

    from rollout_lib.trainer.node_parts import PART_MODULES

    args = parse_args(argv)
    # One node only: with several, the rendezvous endpoint's port is bound by whichever torchrun creates its store
    # first, and the launcher's import (seconds) would widen the time in which another socket can take that port
    # (seen: test_node_agents' nodes on 127.0.0.1 both failing to reach the store). Those ranks start fresh.
    single_node = args.standalone or args.nnodes == "1"
    forked = (args.module and not args.no_python and not args.run_path and args.training_script in PART_MODULES
              and single_node)
    if forked:
        for module in (*PRELOADED, args.training_script):
            importlib.import_module(module)
    if threads is None:
        del os.environ["OMP_NUM_THREADS"]
    else:
        os.environ["OMP_NUM_THREADS"] = threads
    hazard = fork_hazard() if forked else None
    if hazard is not None:
        logger.warning("rollout torchrun: ranks start as fresh interpreters: %s", hazard)
    if not forked or hazard is not None:
        record(run)(args)
        return
    dispositions = {signum: signal.getsignal(signum) for signum in AGENT_SIGNALS}
    launcher = os.getpid()
    os.register_at_fork(after_in_child=lambda: _after_fork_in_child(launcher, dispositions))
    import gc

    gc.freeze()  # the imported modules' objects out of the collector's reach: fewer pages copied in the ranks
    record(launch_forked)(args, args.training_script)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
