"""The other nodes' parts of a rendezvous, and who starts them (docs/scale.md, "Several nodes").

A group over several nodes (a training segment, RL's policy group) is node 0's torchrun, on the flow's machine,
plus one torchrun per other node. `NodePart` is one other node's part as structured parameters (JSON: numbers, a
host:port, an id, one of the two rank modules), never a shell string: the node builds its torchrun command from
them (`command`) after `from_parameters` has checked every field, so whoever can submit a part can start a rank of
rollout's and nothing else.

A `NodeLauncher` starts the parts and, once node 0's torchrun has ended, says whether they did their share
(`settle`): None, or a `NodeProblem`, one line naming the node whose part failed, never started or was lost. `LoggedCommands` (no
hardware.node_pool) logs each part's command for someone to run on that node, as before. With hardware.node_pool
the flows register a launcher that submits each part as a flow run to the node agents of that Prefect work pool
(flows/node_launch.py; `register_pool_launcher`): this library never imports Prefect, so the factory is handed
down, not imported.
"""

from __future__ import annotations

import logging
import re
import shlex
import sys
from dataclasses import asdict, dataclass

from rollout_lib.gpu_env import visible_devices

logger = logging.getLogger(__name__)

# The only modules a node's part may run: a training segment's rank, or a rank of RL's policy group.
PART_MODULES = ("rollout_lib.trainer.segment_worker", "rollout_lib.rl.policy_rank")
# What the ranks of the other nodes are started with instead of the spec file: they receive the spec from the
# flow's node over the process group once it is joined (segment_worker.join_group), so those nodes need a checkout
# and environment like node 0's and the run's store, not node 0's files. Then the group's backend.
RECEIVE_SPEC = "--receive-spec"
# What every node's torchrun runs as: torch.distributed.run, ended without the interpreter's teardown once its group
# has succeeded (trainer/torchrun.py).
TORCHRUN = "rollout_lib.trainer.torchrun"
BACKENDS = ("gloo", "nccl")
_ENDPOINT = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:[0-9]{1,5}$")
_RUN_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
# Sharded ranks gather and free a layer's full parameters and gradients every micro-batch; glibc keeps such freed
# blocks in its heap, so a rank's RSS kept the peak of an unsharded one. Large blocks from mmap, returned on free:
# SmolLM2 SFT peak RSS per rank 3730 -> 2271 MiB (docs/hardware.md, "Sharded training"). A user's own values win.
SHARDED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
# Where a node agent's parts run (its working directory for torchrun): set by `rollout node start` in the
# deployment's environment; unset, the flow run's own working directory.
NODE_DIR_ENV = "ROLLOUT_NODE_DIR"


class NodePartError(RuntimeError):
    """A node's part could not be started or did not do its share; the message names the node."""


@dataclass(frozen=True)
class NodePart:
    """Node `node_rank`'s part of a group of `nnodes` nodes joined at `endpoint` under `run_id`: `nproc` ranks of
    `module`, which receive the spec over the group in `backend`. `threads`, `sharded` and `gpus` make the ranks'
    environment as node 0's (data_parallel.rank_environment)."""

    node_rank: int
    nnodes: int
    nproc: int
    endpoint: str
    run_id: str
    timeout_s: float
    module: str
    backend: str
    threads: int = 1
    sharded: bool = False
    gpus: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        checks = [
            (type(self.nnodes) is int and self.nnodes >= 2, f"nnodes must be an integer >= 2, not {self.nnodes!r}"),
            (type(self.node_rank) is int and 1 <= self.node_rank < self.nnodes if type(self.nnodes) is int else False,
             f"node_rank must be 1..nnodes-1, not {self.node_rank!r}"),
            (type(self.nproc) is int and self.nproc >= 1, f"nproc must be an integer >= 1, not {self.nproc!r}"),
            (isinstance(self.endpoint, str) and bool(_ENDPOINT.match(self.endpoint)),
             f'endpoint must be "host:port", not {self.endpoint!r}'),
            (isinstance(self.run_id, str) and bool(_RUN_ID.match(self.run_id)),
             f"run_id must be letters, digits, '_', '.', '-', not {self.run_id!r}"),
            (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0,
             f"timeout_s must be a positive number, not {self.timeout_s!r}"),
            (self.module in PART_MODULES, f"module must be one of {', '.join(PART_MODULES)}, not {self.module!r}"),
            (self.backend in BACKENDS, f"backend must be gloo or nccl, not {self.backend!r}"),
            (type(self.threads) is int and self.threads >= 1, f"threads must be an integer >= 1, not {self.threads!r}"),
            (isinstance(self.sharded, bool), f"sharded must be true or false, not {self.sharded!r}"),
            (self.gpus is None or all(type(gpu) is int and gpu >= 0 for gpu in self.gpus),
             f"gpus must be GPU indices, not {self.gpus!r}"),
        ]
        for ok, problem in checks:
            if not ok:
                raise ValueError(f"node part: {problem}")

    def command(self) -> list[str]:
        """This part's torchrun command, as an argument list (data_parallel.torchrun_command for node 0's)."""
        return [sys.executable, "-m", TORCHRUN, f"--nnodes={self.nnodes}",
                f"--node-rank={self.node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={self.endpoint}",
                f"--rdzv-id={self.run_id}", f"--rdzv-conf=join_timeout={self.timeout_s:g}",
                f"--nproc_per_node={self.nproc}", "-m", self.module, RECEIVE_SPEC, self.backend]

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        """The ranks' environment on the node: its own (`base`) as node 0's is made (data_parallel.rank_environment):
        unbuffered output, the run's thread count and malloc settings unless the node sets its own, the GPUs."""
        env = {**base, "PYTHONUNBUFFERED": "1"}
        env.setdefault("OMP_NUM_THREADS", str(self.threads))
        if self.sharded:
            env = {**SHARDED_MALLOC, **env}
        return {**env, **visible_devices(list(self.gpus) if self.gpus is not None else None)}

    def to_parameters(self) -> dict:
        """JSON, what the flow run of this part is given."""
        fields = asdict(self)
        fields["gpus"] = list(self.gpus) if self.gpus is not None else None
        return fields

    @classmethod
    def from_parameters(cls, parameters: dict) -> "NodePart":
        """The part from a flow run's parameters; ValueError naming the field when one is missing, unknown or
        wrong."""
        if not isinstance(parameters, dict):
            raise ValueError(f"node part: expected an object of fields, not {type(parameters).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(parameters) - known)
        if unknown:
            raise ValueError(f"node part: unknown field(s) {', '.join(unknown)}")
        missing = sorted(name for name in ("node_rank", "nnodes", "nproc", "endpoint", "run_id", "timeout_s",
                                           "module", "backend") if name not in parameters)
        if missing:
            raise ValueError(f"node part: missing field(s) {', '.join(missing)}")
        gpus = parameters.get("gpus")
        return cls(**{**parameters, "gpus": tuple(gpus) if isinstance(gpus, list) else gpus})


def node_queue(node_rank: int) -> str:
    """The work queue of node `node_rank`'s agent in the run's pool: one agent per node, so each part has its node."""
    return f"node-{node_rank}"


NODE_FLOW = "node-part"


def node_deployment(pool: str, node_rank: int) -> str:
    """The deployment (flow/name) node `node_rank`'s agent registers in `pool` (`rollout node start`)."""
    return f"{NODE_FLOW}/{pool}-{node_queue(node_rank)}"


def agent_command(pool: str, node_rank: int) -> str:
    return f"rollout node start --pool {shlex.quote(pool)} --node {node_rank}"


@dataclass(frozen=True)
class NodeProblem:
    """What a node's part did wrong, in one line naming the node. `caused`: it never started or was lost, so the
    group's failure is the node's; else it failed along with node 0's ranks (which side began it, their output
    says)."""

    line: str
    caused: bool


class NodeLauncher:
    """Starts the other nodes' parts of each group (`launch`) and tells, once node 0's torchrun has ended, whether
    they did their share (`settle`). This one logs each part's command for someone to run on that node."""

    def launch(self, parts: dict[int, NodePart], abort=None) -> None:
        """Start every part; `abort()` stops node 0's torchrun, for a launcher that sees a part end badly while
        node 0 still waits for it (this one sees nothing)."""
        for node_rank, part in parts.items():
            logger.warning("node %d joins this process group with: %s", node_rank, shlex.join(part.command()))

    def settle(self, succeeded: bool) -> NodeProblem | None:
        """After node 0's torchrun ended (`succeeded` or not): None, or the first node whose part failed, never
        started or was lost, and what to do."""
        return None


class LoggedCommands(NodeLauncher):
    """The parts' commands handed to `announce({node_rank: command})` (a test's stand-in for a launcher)."""

    def __init__(self, announce):
        self.announce = announce

    def launch(self, parts: dict[int, NodePart], abort=None) -> None:
        self.announce({node_rank: part.command() for node_rank, part in parts.items()})


_pool_launcher = None  # (hardware settings) -> NodeLauncher of hardware.node_pool, handed down by the flows


def register_pool_launcher(factory) -> None:
    """How parts reach a Prefect work pool's node agents (flows/node_launch.py registers it on import)."""
    global _pool_launcher
    _pool_launcher = factory


def launcher_for(hardware, announce=None) -> NodeLauncher:
    """Who starts the other nodes' parts: `announce` (a callable given the commands, or a NodeLauncher) when given,
    else the node agents of hardware.node_pool, else logged commands."""
    if announce is not None:
        return announce if isinstance(announce, NodeLauncher) else LoggedCommands(announce)
    if hardware.node_pool is None:
        return NodeLauncher()
    if _pool_launcher is None:
        raise NodePartError(f"hardware.node_pool = {hardware.node_pool!r}: node agents are reached through the "
                            "flows (rollout train, a deployment); this caller registered no launcher")
    return _pool_launcher(hardware)
