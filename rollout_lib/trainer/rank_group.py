"""A group of torchrun ranks that lives for a whole run and serves the flow's commands (issue 44).

Both kinds of data-parallel training keep one: RL's policy group (rl/policy_group.py, ranks rl/policy_rank.py) and
SFT's and RM's segment group (trainer/segment_group.py, ranks trainer/segment_worker.py). This module is what they
share, the flow's side (`RankGroup`) and the ranks' (`join_group`, `serve`):

    flow process                                  torchrun --nproc_per_node N -m MODULE SPEC
           |  one JSON line per command, to every     rank r: joins the process group, connects to the flow's
           |  rank (a socket each); each rank         socket, presents the group's secret, then runs each
           |  answers with one line, the reporting    command in lockstep with the others; the reporting
           |  rank first ({"event"} lines before      rank (the first on the flow's node) may send
           v  its reply are passed on as they come)   {"event": ...} lines while a command runs

torchrun starts once, at the first command, and the group stays until `close` (the flow's end, failed or not). With
hardware.nnodes > 1 this machine runs node 0's torchrun and its launcher starts the other nodes' parts
(trainer/node_parts.py: hardware.node_pool's agents, or logged commands) once per start, not per command; their
ranks receive the spec over the process group and connect to the flow's socket at the rendezvous host.

The socket is closed to anyone but the group's ranks: each group draws a secret (`secrets.token_hex(32)`), hands it
to node 0's torchrun in its environment (SECRET_ENV: never on a command line, which the other nodes' announced
commands print, and never logged), and every rank presents it as it joins (node 0's reporting rank sends it to the
other nodes' ranks over the process group, with the spec). A connection that does not present it within
HELLO_TIMEOUT_S is closed and the group keeps waiting for its ranks.

A rank that fails (an exception, a signal) makes torchrun stop the others; the command then raises
DataParallelError naming what it was doing and the rank (torchrun's summary, or the rank's own {"error"} reply),
the group is forgotten, and the next command starts a new one (whose ranks rebuild what they are asked for from the
store).
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
import os
import pickle
import secrets
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rollout_lib.hardware import hardware_settings
from rollout_lib.trainer.data_parallel import (DataParallelError, DataParallelRank, Nodes, group_backend,
                                               other_node_parts, rank_environment, rendezvous_timeout,
                                               torchrun_command)
from rollout_lib.trainer.node_parts import RECEIVE_SPEC, NodeLauncher, NodePartError, launcher_for
from rollout_lib.trainer.torchrun_summary import failure_message, root_cause_rank

logger = logging.getLogger(__name__)

# How long the ranks may take to start and connect (importing torch and transformers, under load), and to stop.
CONNECT_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0
# The environment variable node 0's torchrun carries the group's secret in (`group_secret` reads it).
SECRET_ENV = "ROLLOUT_GROUP_SECRET"
# How long a connection may take to present the secret: a silent client must not hold the ranks' door for long.
HELLO_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class GroupSpec:
    """What every rank is started with (pickled into a file torchrun's command line names; other nodes receive it
    over the process group): the training's inputs, the flow's socket, and what the rank module needs besides."""

    inputs: object  # trainer.base.TrainingInputs
    host: str  # the flow's socket the ranks connect to: this machine's loopback, or with several nodes the
    port: int  # rendezvous host's (node 0's, this machine's) address that every node reaches
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class GroupKind:
    """How a group names itself in its errors: `label` ("data-parallel policy training") and `name` ("policy
    group"), and the rank module torchrun runs."""

    module: str
    label: str
    name: str


class RankGroup:
    """The processes of one group (started at the first command) and the flow's side of their commands."""

    def __init__(self, inputs, kind: GroupKind, extra: dict | None = None,
                 announce: NodeLauncher | Callable | None = None, nproc: int | None = None):
        hardware = hardware_settings(inputs.settings)
        self.inputs = inputs
        self.kind = kind
        self.extra = extra or {}
        self.nproc = nproc or hardware.nproc  # per node
        self.world_size = self.nproc * hardware.nnodes
        self.nodes = Nodes.of(hardware)
        # starts the other nodes' parts at each start (hardware.node_pool's agents, or logged commands: node_parts)
        self.launcher = launcher_for(hardware, announce) if self.nodes is not None else None
        self._workdir = tempfile.TemporaryDirectory(prefix="rollout-group-")
        self._process: subprocess.Popen | None = None
        self._ranks: list = []  # reporting rank first, then rank order: (rank, its socket's file, JSON lines)
        self._tail: deque[str] = deque(maxlen=400)
        self._lock = threading.Lock()  # one command at a time (off-policy RL asks from two threads)
        self._starts = itertools.count(1)  # each start is a rendezvous of its own
        self.starts = 0  # how many times torchrun was started (a test counts them)
        self._secret = secrets.token_hex(32)  # what a rank presents as it joins (module docstring); never logged

    @property
    def workdir(self) -> str:
        return self._workdir.name

    def command(self, what: str, command: dict, rerun: str, on_event: Callable[[dict], None] | None = None) -> dict:
        """Every rank runs `command`; the reporting rank's reply. `what` and `rerun` (what a rerun does) name a
        failure; `on_event` gets each {"event"} the reporting rank sends meanwhile."""
        with self._lock:
            if self._process is None:
                self._start(what, rerun)
            try:
                self._send(command)
            except OSError:  # a rank is gone since the last command
                raise self._failed(what, [], rerun) from None
            replies, errors = [], []
            for rank, channel in self._ranks:
                while True:
                    line = channel.readline()
                    if not line:
                        break  # the rank is gone: torchrun's summary says how
                    reply = json.loads(line)
                    if "event" in reply:
                        if on_event is not None:
                            on_event(reply["event"])
                        continue
                    (errors if "error" in reply else replies).append((rank, reply))
                    break
                if not line:
                    break
            if errors or len(replies) < self.world_size:
                raise self._failed(what, errors, rerun)
            return replies[0][1]

    def close(self) -> None:
        with self._lock:
            if self._process is not None and self._process.poll() is None:
                try:
                    self._send({"op": "stop"})
                    self._process.wait(timeout=STOP_TIMEOUT_S)
                except (OSError, subprocess.TimeoutExpired):
                    self._process.kill()
                    self._process.wait()
                if self.launcher is not None:  # the other nodes' parts end with the group
                    problem = self.launcher.settle(self._process.returncode == 0)
                    if problem is not None:
                        logger.warning("%s stopped: %s", self.kind.name, problem.line)
            self._forget()
        self._workdir.cleanup()

    # --- the processes ----------------------------------------------------------------------------------------

    def _send(self, command: dict) -> None:
        line = json.dumps(command) + "\n"
        for _, channel in self._ranks:
            channel.write(line)
            channel.flush()

    def _start(self, what: str, rerun: str) -> None:
        """Start the group for the command `what` (named by a failure to start)."""
        # Several nodes: the ranks connect to the rendezvous host, node 0's name as every node resolves it; this
        # machine may resolve its own name otherwise (Debian maps it to 127.0.1.1), so listen on every interface,
        # for the start only (closed once every rank is in).
        host, bind = ("127.0.0.1", "127.0.0.1") if self.nodes is None else (self.nodes.endpoint.rpartition(":")[0], "")
        listener = socket.create_server((bind, 0))
        spec_path = os.path.join(self.workdir, "spec.pkl")
        with open(spec_path, "wb") as out:
            pickle.dump(GroupSpec(self.inputs, host, listener.getsockname()[1], self.extra), out)
        env = {**rank_environment(self.inputs), SECRET_ENV: self._secret}
        run_id = f"rollout-{os.path.basename(self.workdir)}-{next(self._starts)}"
        self._tail.clear()
        try:
            self._process = subprocess.Popen(
                torchrun_command(self.nproc, spec_path, module=self.kind.module, nodes=self.nodes, run_id=run_id),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=env)
        except BaseException:
            listener.close()
            raise
        self.starts += 1
        threading.Thread(target=self._keep_output, args=(self._process,), daemon=True).start()
        if self.launcher is not None:  # a rendezvous per start (once per run): the other nodes join it
            try:
                # a part that ends badly while the group runs stops node 0's torchrun (SIGTERM: it stops its ranks)
                self.launcher.launch(other_node_parts(self.inputs, self.nodes, self.nproc, self.kind.module, run_id),
                                     abort=self._process.terminate)
            except BaseException as exc:
                self._process.kill()
                self._process.wait()
                self._process = None
                listener.close()
                if isinstance(exc, NodePartError):
                    raise DataParallelError(f"{what}: {exc}") from None
                raise
        logger.info("%s: %d processes (torchrun pid %d)", self.kind.label, self.world_size, self._process.pid)
        ranks: dict[int, tuple[object, bool]] = {}
        # the other nodes may take up to the rendezvous' timeout to join, then start like this node's ranks
        deadline = time.monotonic() + CONNECT_TIMEOUT_S + (self.nodes.timeout_s if self.nodes else 0)
        with listener:
            while len(ranks) < self.world_size:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise self._failed(what, [], rerun)
                if select.select([listener], [], [], 1.0)[0]:
                    connection, address = listener.accept()
                    joined = self._admit(connection, ranks)
                    if joined is None:
                        logger.warning("%s: refused a connection from %s (no rank of this group: it did not present "
                                       "the group's secret within %g s)", self.kind.name, address[0], HELLO_TIMEOUT_S)
                    else:
                        ranks[joined[0]] = (joined[1], joined[2])
        # the reporting rank first: its events are read as they come, the others' replies after its own
        order = sorted(ranks, key=lambda rank: (not ranks[rank][1], rank))
        self._ranks = [(rank, ranks[rank][0]) for rank in order]

    def _admit(self, connection: socket.socket, joined: dict) -> tuple[int, object, bool] | None:
        """(rank, its channel, whether it reports) for a rank of this group that has not joined yet: it sends
        `{"rank", "secret", "reports"}` within HELLO_TIMEOUT_S. Anything else is closed: None."""
        connection.settimeout(HELLO_TIMEOUT_S)
        channel = connection.makefile("rw", encoding="utf-8")
        try:
            hello = json.loads(channel.readline())
            rank, secret = hello["rank"], str(hello["secret"]).encode()
            # compare_digest: the time taken says nothing of how much of the secret matched
            if hmac.compare_digest(secret, self._secret.encode()) and rank in range(self.world_size) \
                    and rank not in joined:
                connection.settimeout(None)  # a rank's commands take as long as they take
                return rank, channel, bool(hello.get("reports", rank == 0))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # silent, cut off, not a rank's hello
            pass
        channel.close()
        connection.close()
        return None

    def _keep_output(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self._tail.append(line.rstrip("\n"))
            logger.debug("%s: %s", self.kind.name, line.rstrip("\n"))

    def _failed(self, what: str, errors: list[tuple[int, dict]], rerun: str) -> DataParallelError:
        """The group's failure as an error naming `what` and the rank; the processes are stopped and forgotten,
        so the next command starts new ones."""
        process = self._process
        try:
            returncode = process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            returncode = process.wait()
        time.sleep(0.2)  # the output thread's last lines
        tail = list(self._tail)
        self._forget()
        where = f"{what}: {self.kind.label} ({self.world_size} processes) failed"
        node_problem = self.launcher.settle(False) if self.launcher is not None else None
        # a node's part never started or was lost, or failed before its node joined: the group's failure
        if node_problem is not None and (node_problem.caused or rendezvous_timeout(tail, self.nodes)):
            return DataParallelError(f"{what}: {node_problem.line}; {rerun}.\nnode 0's last output:\n"
                                     + "\n".join(tail[-20:]))
        if node_problem is not None:  # it failed with node 0's ranks: which side began it, their output says
            where += f" ({node_problem.line})"
        if rendezvous_timeout(tail, self.nodes):
            return DataParallelError(
                f"{what}: not every node of {self.nodes.count} joined the {self.kind.name}'s rendezvous at "
                f"{self.nodes.endpoint} within {self.nodes.timeout_s:g} s (hardware.rdzv_timeout_s); start the other "
                f"nodes' torchrun (logged as the group started), or set hardware.nnodes = 1. {rerun[0].upper()}"
                f"{rerun[1:]}")
        # The rank that failed first, as torchrun tells it: the others may report errors of their own (a
        # collective whose peer vanished) before torchrun stops them.
        first = root_cause_rank(tail)
        reported = dict(errors)
        if first in reported or (first is None and errors):
            rank = first if first in reported else errors[0][0]
            return DataParallelError(f"{where}: rank {rank}: {reported[rank]['error']}; {rerun}.")
        return DataParallelError(failure_message(where, returncode, tail, rerun))

    def _forget(self) -> None:
        for _, channel in self._ranks:
            try:
                channel.close()
            except OSError:
                pass
        self._ranks, self._process = [], None


# --- the ranks' side --------------------------------------------------------------------------------------------


def join_group(argv: list[str] | None) -> tuple[object, DataParallelRank]:
    """(the spec this rank was started with, this rank's place in the process group), the group joined (gloo on
    CPU; on CUDA, nccl with this rank on its local rank's GPU). The flow's node names the pickled spec file on the
    command line; another node's ranks (`RECEIVE_SPEC BACKEND`) receive it from the flow's node over the group,
    whose first rank there reports to the flow (DataParallelRank.reporter)."""
    arguments = argv if argv is not None else sys.argv[1:]
    spec = None
    if arguments[0] == RECEIVE_SPEC:
        cuda = arguments[1] == "nccl"
    else:
        (spec_path,) = arguments
        with open(spec_path, "rb") as spec_file:  # written by the flow for its own children
            spec = pickle.load(spec_file)
        cuda = group_backend(spec.inputs) == "nccl"
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)  # "cuda" (no index) in the settings now means this rank's GPU
    dist.init_process_group("nccl" if cuda else "gloo")
    holders = [None] * world_size
    dist.all_gather_object(holders, spec is not None)
    reporter = holders.index(True)
    if not all(holders):  # other nodes: the spec travels as torch's collectives move any object (a pickle)
        received = [spec]
        dist.broadcast_object_list(received, src=reporter)
        spec = received[0]
    return spec, DataParallelRank(rank, world_size, device, reporter)


def group_secret(data_parallel: DataParallelRank) -> str:
    """The secret this rank presents to the flow's socket: node 0's torchrun carries it in its environment
    (SECRET_ENV), the reporting rank (on node 0) sends it to every other rank over the group, so other nodes'
    commands need not carry it. Every rank calls this (a collective)."""
    own = os.environ.pop(SECRET_ENV, None)  # out of the environment: no child process inherits it
    held = [own if data_parallel.reports else None]
    dist.broadcast_object_list(held, src=data_parallel.reporter)
    return held[0]


class Channel:
    """A rank's line to the flow: `event` (the reporting rank's, while a command runs) and `reply`."""

    def __init__(self, file):
        self.file = file

    def send(self, message: dict) -> None:
        self.file.write(json.dumps(message) + "\n")
        self.file.flush()

    def event(self, payload: dict) -> None:
        self.send({"event": payload})


def serve(argv: list[str] | None, handler_of: Callable[[GroupSpec, DataParallelRank, Channel], Callable]) -> None:
    """A rank's life: join the group, connect to the flow and present the secret, then run each command with
    `handler_of(spec, data_parallel, channel)(command) -> reply` until `stop`, then return (the process then ends:
    `end_rank`). A command that raises is answered with {"error"} and the rank exits non-zero (torchrun then stops
    the others)."""
    spec, data_parallel = join_group(argv)
    secret = group_secret(data_parallel)
    channel = Channel(socket.create_connection((spec.host, spec.port)).makefile("rw", encoding="utf-8"))
    try:
        channel.send({"rank": data_parallel.rank, "secret": secret, "reports": data_parallel.reports})
        handle = handler_of(spec, data_parallel, channel)
        for line in channel.file:
            command = json.loads(line)
            if command["op"] == "stop":
                break
            try:
                reply = handle(command)
            except Exception as exc:
                where = f"step {command['step']}: " if "step" in command else ""
                channel.send({"error": f"{where}{type(exc).__name__}: {exc}"})
                raise
            channel.send(reply)
    finally:
        channel.file.close()
        dist.destroy_process_group()


def end_rank() -> None:
    """A rank started as `python -m MODULE` (trainer/torchrun.py, ROLLOUT_RANK_START=fresh), stopped: everything it
    wrote is written and closed. Skip the interpreter's teardown of torch and transformers (a CPU-second a rank,
    several seconds of wall under load, all spent before torchrun sees the group end and the flow's `close`
    returns). A rank that failed raised before this, so torchrun's error file is written as before. A forked rank
    returns to torch's agent instead (its return value is how the agent learns it succeeded) and multiprocessing
    ends it with `os._exit`."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
