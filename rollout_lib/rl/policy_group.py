"""Data-parallel RL training: the policy's trainer lives in N torchrun processes for the whole run.

RL trains one optimizer step per RL step, and the next step samples from its result, so a process per step (what
train-sft and train-rm do per segment, trainer/data_parallel.py) would pay torchrun's start and a rebuild of the
trainer every step. Here the ranks start once, on the first train step, and stay:

    flow process                                  torchrun --standalone --nproc_per_node N
    (samples, scores, evaluates with a frozen       -m rollout_lib.rl.policy_rank SPEC
     copy of each state; writes nothing it          rank r: the trainer (weights + optimizer state) at the
     did not compute)                                 current state; trains its share of each step's micro-
           |  one JSON line per command, to every     batches (trainer.data_parallel: counts and gradients
           |  rank (a socket each);                   summed over the ranks); rank 0 writes the new state
           |  rank 0's reply carries the result       (a pending-step record or a snapshot) to the store, the
           v                                          reporting rank the weights file the flow loads its
                                                      frozen copy from

With hardware.nnodes > 1 the group is nproc ranks on each of nnodes nodes, joined by torchrun's c10d rendezvous:
this machine runs node 0's torchrun and its launcher starts the others' parts (trainer/node_parts.py: hardware.
node_pool's agents, or logged commands), as a training segment does;
their ranks receive the spec over the group and connect to the flow's socket at the rendezvous host, node 0's
address. The store is the only thing the nodes share (object storage across machines).

Commands: `train` (step n from a parent state: the ranks rebuild that state from the store first if they are
elsewhere, replaying its steps data-parallel, so the bits match the first time), `snapshot` (rank 0 checkpoints a
state), `export` (the weights of a state the flow has no copy of: after a crash, a rerun) and `stop`. The flow
process holds no trainer, only frozen copies (rl/policy_state.py `FrozenPolicy`) built from the exported files, bit
for bit what the ranks trained.

The socket is closed to anyone but the group's ranks: each group draws a secret (`secrets.token_hex(32)`), hands
it to node 0's torchrun in its environment (SECRET_ENV: never on a command line, which the other nodes' announced
commands print, and never logged), and every rank presents it as it joins (node 0's reporting rank sends it to the
other nodes' ranks over the process group, with the spec: a second node needs nothing beyond its logged command). A
connection that does not present it within HELLO_TIMEOUT_S is closed and the group keeps waiting for its ranks.

A rank that fails (an exception, SIGKILL) makes torchrun stop the others; the command then raises
DataParallelError naming the step and the rank, the group is gone, and the next command (a rerun's) starts a new
one, which rebuilds the state it is asked for from the store.
"""

from __future__ import annotations

import copy
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
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from safetensors.torch import load_file

from rollout_lib.rl.policy_state import FrozenPolicy
from rollout_lib.trainer.base import TrainingInputs
from rollout_lib.trainer.causal import CausalLmTrainer
from rollout_lib.checkpoint import load_model_weights
from rollout_lib.hardware import hardware_settings
from rollout_lib.trainer.data_parallel import (DataParallelError, Nodes, failure_message, other_node_parts,
                                               rank_environment, rendezvous_timeout, root_cause_rank,
                                               torchrun_command)
from rollout_lib.trainer.node_parts import NodeLauncher, NodePartError, launcher_for
from rollout_lib.determinism import GLOBAL_RNG

logger = logging.getLogger(__name__)

# How long the ranks may take to start and connect (importing torch and transformers, under load), and to stop.
CONNECT_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0
# The environment variable node 0's torchrun carries the group's secret in (policy_rank.group_secret reads it).
SECRET_ENV = "ROLLOUT_POLICY_GROUP_SECRET"
# How long a connection may take to present the secret: a silent client must not hold the ranks' door for long.
HELLO_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class GroupSpec:
    """What every rank is started with (pickled into a file torchrun's command line names)."""

    inputs: TrainingInputs
    host: str  # the flow's socket the ranks connect to: this machine's loopback, or with several nodes the
    port: int  # rendezvous host's (node 0's, this machine's) address that every node reaches


class PolicyGroup:
    """The N processes training the policy (started on first use), and the flow's side of their commands."""

    def __init__(self, inputs: TrainingInputs, announce: NodeLauncher | Callable | None = None):
        hardware = hardware_settings(inputs.settings)
        self.inputs = inputs
        self.nproc = hardware.nproc  # per node
        self.world_size = hardware.world_size
        self.nodes = Nodes.of(hardware)
        # starts the other nodes' parts at each start (hardware.node_pool's agents, or logged commands: node_parts)
        self.launcher = launcher_for(hardware, announce) if self.nodes is not None else None
        self._workdir = tempfile.TemporaryDirectory(prefix="rollout-rl-dp-")
        self._process: subprocess.Popen | None = None
        self._ranks: list = []  # rank -> its socket's file (JSON lines both ways)
        self._tail: deque[str] = deque(maxlen=400)
        self._lock = threading.Lock()  # one command at a time (off-policy runs ask from two threads)
        self._skeleton = None  # a model to copy frozen copies from (the trainer's build, weights replaced)
        self._exports = itertools.count(1)  # next() is atomic: two threads never get one file name
        self._starts = itertools.count(1)  # each start is a rendezvous of its own
        self._secret = secrets.token_hex(32)  # what a rank presents as it joins (module docstring); never logged

    # --- the commands -----------------------------------------------------------------------------------------

    def train(self, parent: str, step: int, micro_batches_id: str) -> tuple[str, dict, str]:
        """Step `step` from state `parent`. Returns (the new state's id, the step's metrics, the weights file of
        the new state, for `frozen_copy`)."""
        path = self._export_path()
        reply = self._command(f"train step {step}", {
            "op": "train", "parent": parent, "step": step, "micro_batches": micro_batches_id, "export": path})
        return reply["state"], reply["metrics"], path

    def snapshot(self, state_id: str, metrics: dict) -> str:
        """The checkpoint of `state_id` (rank 0 writes it, or finds it indexed; every rank adopts it)."""
        return self._command(f"snapshot of state {state_id}", {"op": "snapshot", "state": state_id,
                                                                "metrics": metrics})["checkpoint"]

    def export(self, state_id: str) -> str:
        """The weights file of `state_id` (the ranks rebuild it from the store when they are elsewhere)."""
        path = self._export_path()
        self._command(f"export of state {state_id}", {"op": "export", "state": state_id, "export": path})
        return path

    def frozen_copy(self, state_id: str, weights_path: str):
        """A FrozenPolicy of `state_id` from its exported weights file (deleted once loaded)."""
        if self._skeleton is None:
            with GLOBAL_RNG:  # build seeds the RNG: never while another thread trains or samples
                model, tokenizer, _ = CausalLmTrainer.build(self.inputs)
            self._skeleton = FrozenPolicy(state_id, model.eval().requires_grad_(False), tokenizer)
        model = copy.deepcopy(self._skeleton.model)
        try:
            load_model_weights(model, load_file(weights_path, device=str(next(model.parameters()).device)))
        finally:
            os.unlink(weights_path)
        return FrozenPolicy(state_id, model, self._skeleton.tokenizer)

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
                        logger.warning("policy group stopped: %s", problem.line)
            self._forget()
        self._workdir.cleanup()

    # --- the processes ----------------------------------------------------------------------------------------

    def _export_path(self) -> str:
        return os.path.join(self._workdir.name, f"weights-{next(self._exports)}.safetensors")

    def _command(self, what: str, command: dict) -> dict:
        with self._lock:
            if self._process is None:
                self._start(what)
            try:
                self._send(command)
            except OSError:  # a rank is gone since the last command
                raise self._failed(what, []) from None
            replies, errors = [], []
            for rank, channel in enumerate(self._ranks):
                line = channel.readline()
                if not line:
                    break  # the rank is gone: torchrun's summary says how
                reply = json.loads(line)
                (errors if "error" in reply else replies).append((rank, reply))
            if errors or len(replies) < self.world_size:
                raise self._failed(what, errors)
            return replies[0][1]

    def _send(self, command: dict) -> None:
        line = json.dumps(command) + "\n"
        for channel in self._ranks:
            channel.write(line)
            channel.flush()

    def _start(self, what: str) -> None:
        """Start the group for the command `what` (named by a failure to start)."""
        # Several nodes: the ranks connect to the rendezvous host, node 0's name as every node resolves it; this
        # machine may resolve its own name otherwise (Debian maps it to 127.0.1.1), so listen on every interface,
        # for the start only (closed once every rank is in).
        host, bind = ("127.0.0.1", "127.0.0.1") if self.nodes is None else (self.nodes.endpoint.rpartition(":")[0], "")
        listener = socket.create_server((bind, 0))
        spec_path = os.path.join(self._workdir.name, "spec.pkl")
        with open(spec_path, "wb") as out:
            pickle.dump(GroupSpec(self.inputs, host, listener.getsockname()[1]), out)
        env = {**rank_environment(self.inputs), SECRET_ENV: self._secret}
        run_id = f"rollout-policy-{os.path.basename(self._workdir.name)}-{next(self._starts)}"
        module = "rollout_lib.rl.policy_rank"
        self._tail.clear()
        self._process = subprocess.Popen(
            torchrun_command(self.nproc, spec_path, module=module, nodes=self.nodes, run_id=run_id),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=env)
        threading.Thread(target=self._keep_output, args=(self._process,), daemon=True).start()
        if self.launcher is not None:  # a new rendezvous at every start: the other nodes join each
            try:
                # a part that ends badly while the group runs stops node 0's torchrun (SIGTERM: it stops its ranks)
                self.launcher.launch(other_node_parts(self.inputs, self.nodes, self.nproc, module, run_id),
                                     abort=self._process.terminate)
            except BaseException as exc:
                self._process.kill()
                self._process.wait()
                self._process = None
                if isinstance(exc, NodePartError):
                    raise DataParallelError(f"{what}: {exc}") from None
                raise
        logger.info("data-parallel policy training: %d processes (torchrun pid %d)", self.world_size,
                    self._process.pid)
        ranks: dict[int, object] = {}
        # the other nodes may take up to the rendezvous' timeout to join, then start like this node's ranks
        deadline = time.monotonic() + CONNECT_TIMEOUT_S + (self.nodes.timeout_s if self.nodes else 0)
        with listener:
            while len(ranks) < self.world_size:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise self._failed(what, [])
                if select.select([listener], [], [], 1.0)[0]:
                    connection, address = listener.accept()
                    joined = self._admit(connection, ranks)
                    if joined is None:
                        logger.warning("policy group: refused a connection from %s (no rank of this group: it did not "
                                       "present the group's secret within %g s)", address[0], HELLO_TIMEOUT_S)
                    else:
                        ranks[joined[0]] = joined[1]
        self._ranks = [ranks[rank] for rank in range(self.world_size)]

    def _admit(self, connection: socket.socket, joined: dict) -> tuple[int, object] | None:
        """(rank, its channel) for a rank of this group that has not joined yet: it sends `{"rank", "secret"}`
        within HELLO_TIMEOUT_S. Anything else is closed: None."""
        connection.settimeout(HELLO_TIMEOUT_S)
        channel = connection.makefile("rw", encoding="utf-8")
        try:
            hello = json.loads(channel.readline())
            rank, secret = hello["rank"], str(hello["secret"]).encode()
            # compare_digest: the time taken says nothing of how much of the secret matched
            if hmac.compare_digest(secret, self._secret.encode()) and rank in range(self.world_size) \
                    and rank not in joined:
                connection.settimeout(None)  # a rank's commands take as long as they take
                return rank, channel
        except (OSError, ValueError, KeyError, TypeError):  # silent, cut off, not JSON, not a rank's hello
            pass
        channel.close()
        connection.close()
        return None

    def _keep_output(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self._tail.append(line.rstrip("\n"))
            logger.debug("policy group: %s", line.rstrip("\n"))

    def _failed(self, what: str, errors: list[tuple[int, dict]]) -> DataParallelError:
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
        where = f"{what}: data-parallel policy training ({self.world_size} processes) failed"
        rerun = "the steps before it are in the store, so a rerun trains from the last of them"
        node_problem = self.launcher.settle(False) if self.launcher is not None else None
        # a node's part never started or was lost, or failed before its node joined: the group's failure
        if node_problem is not None and (node_problem.caused or rendezvous_timeout(tail, self.nodes)):
            return DataParallelError(f"{what}: {node_problem.line}; {rerun}.")
        if node_problem is not None:  # it failed with node 0's ranks: which side began it, their output says
            where += f" ({node_problem.line})"
        if rendezvous_timeout(tail, self.nodes):
            return DataParallelError(
                f"{what}: not every node of {self.nodes.count} joined the policy group's rendezvous at "
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
        for channel in self._ranks:
            try:
                channel.close()
            except OSError:
                pass
        self._ranks, self._process = [], None

