"""Data parallelism: a training segment run by N processes (`torchrun`), each taking its share of every step.

    rank r of N trains micro-batches r, r+N, r+2N, ... of a step (RM: pairs r, r+N, ...); every rank runs the
        same number of them, a rank short of one runs a filler (the step's first micro-batch, every weight zero)
    N_c   = all_reduce(SUM) of the ranks' component token counts [N_rl, N_ce, N_ref_kl], before any loss
    grads = all_reduce(SUM) of the ranks' accumulated gradients, after their backward passes

A rank's loss is Σ numerator_c / N_c over its own micro-batches with the step-global N_c, so the SUM of the ranks'
gradients is the gradient one process accumulates over all of them. (DistributedDataParallel would AVERAGE them,
a factor 1/N off: hence a plain all_reduce here, one flat buffer per step, after backward.) Every rank then clips
and steps the same gradients from the same weights, so the weights stay identical on every rank without a
broadcast, and rank 0 alone writes the snapshot. A filler runs forward and backward on a graph-attached zero, so
every rank issues the same collectives whatever its share holds: a rank with nothing to train never hangs the
others.

The launching side is a group of ranks kept for a whole run (trainer/rank_group.py): SFT's and RM's segments
(trainer/segment_group.py, ranks trainer/segment_worker.py) and RL's steps (rl/policy_group.py). This module holds
what they build on: the torchrun command (node 0's; with hardware.nnodes > 1, the first of a c10d rendezvous whose
other nodes' parts trainer/node_parts.py starts) and the ranks' environment; trainer/torchrun_summary.py reads
torchrun's failure summary, which names the rank that failed. With hardware.sharding = "fsdp" the ranks shard the model instead of each
holding it (trainer/sharding.py); the arithmetic above is unchanged.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

import pyarrow as pa
import torch
import torch.distributed as dist

from rollout_lib.losses import COMPONENTS
from rollout_lib.gpu_env import visible_devices
from rollout_lib.hardware import hardware_of_config, hardware_settings
from rollout_lib.trainer.node_parts import SHARDED_MALLOC, TORCHRUN, NodePart

# Test hook: "RANK:STEP" makes that rank SIGKILL itself as it starts that step (a rank dying mid-segment).
KILL_RANK_ENV = "ROLLOUT_TEST_KILL_RANK_AT_STEP"
# Test hook: "STEP:PATH" makes every rank that sees it write PATH as it starts that step and wait there, for a test
# to kill its node (an agent and all it started) mid-segment, the group joined.
HOLD_AT_STEP_ENV = "ROLLOUT_TEST_HOLD_AT_STEP"
WEIGHT_COLUMNS = ("rl_weights", "ce_weights", "ref_kl_weights")


class DataParallelError(RuntimeError):
    """The processes of a data-parallel segment failed; the message names the steps and the rank."""


@dataclass(frozen=True)
class DataParallelRank:
    """This process's place in the group (`rank` of `world_size`) and the device its collectives run on (gloo: CPU
    tensors, nccl: CUDA ones)."""

    rank: int
    world_size: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # The rank that reports to the flow (step lines, the result file, a policy's exported weights): the first rank
    # on the flow's own node, which is not rank 0 when the rendezvous ranks another node first.
    reporter: int = 0

    @property
    def reports(self) -> bool:
        return self.rank == self.reporter

    def share(self, micro_batches: pa.Table) -> pa.Table:
        """This rank's micro-batches of a step: rows rank, rank + N, ..., then fillers up to ceil(rows / N)."""
        mine = micro_batches.take(pa.array(range(self.rank, micro_batches.num_rows, self.world_size), pa.int64()))
        missing = -(-micro_batches.num_rows // self.world_size) - mine.num_rows
        if missing:
            filler = empty_micro_batch(micro_batches.slice(0, 1))
            mine = pa.concat_tables([mine, *[filler] * missing])
        return mine

    def share_rows(self, rows: list[int]) -> list[int]:
        """This rank's rows (pairs) of a step: rows[rank], rows[rank + N], ..."""
        return rows[self.rank::self.world_size]

    def sum_counts(self, counts: dict[str, int]) -> dict[str, int]:
        """The step-global component token counts from each rank's own."""
        totals = torch.tensor([counts[c] for c in COMPONENTS], dtype=torch.int64, device=self.device)
        dist.all_reduce(totals)
        return dict(zip(COMPONENTS, (int(n) for n in totals.tolist())))

    def sum_numbers(self, values: dict[str, float]) -> dict[str, float]:
        """Each value summed over the ranks (every rank passes the same names), in float64."""
        names = sorted(values)
        totals = torch.tensor([float(values[name]) for name in names], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        return dict(zip(names, totals.tolist()))

    def sum_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Every trainable parameter's gradient summed over the ranks (a missing gradient counts as zero)."""
        trainable = [p for p in parameters if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in trainable]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for parameter in trainable:
            size = parameter.numel()
            parameter.grad = flat[offset:offset + size].view_as(parameter).clone()
            offset += size


def empty_micro_batch(micro_batch: pa.Table) -> pa.Table:
    """`micro_batch` with nothing to train: loss mask off and every component weight zero (it still runs forward
    and backward, contributing exactly zero)."""
    for name in ("loss_mask", *WEIGHT_COLUMNS):
        index = micro_batch.schema.get_field_index(name)
        kind = micro_batch.schema.field(name).type
        zero = False if name == "loss_mask" else 0.0
        column = pa.array([[zero] * len(tokens) for tokens in micro_batch.column(name).to_pylist()], kind)
        micro_batch = micro_batch.set_column(index, micro_batch.schema.field(name), column)
    return micro_batch


# --- the launching side ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Nodes:
    """Where a segment's ranks run beyond this machine: `count` nodes joined at `endpoint` by torchrun's c10d
    rendezvous (hardware.nnodes, rdzv_endpoint, rdzv_timeout_s). This machine is node 0."""

    count: int
    endpoint: str
    timeout_s: float

    @classmethod
    def of(cls, hardware) -> "Nodes | None":
        if hardware.nnodes == 1:
            return None
        return cls(hardware.nnodes, hardware.rdzv_endpoint, hardware.rdzv_timeout_s)


def torchrun_command(nproc: int, spec_path: str, module: str = "rollout_lib.trainer.segment_worker",
                     nodes: Nodes | None = None, run_id: str = "rollout") -> list[str]:
    """Node 0's torchrun command (this machine's): alone (`--standalone`), or the first of `nodes`. The other
    nodes' are their `NodePart`s' (`node_parts`), which receive the spec from node 0 over the group."""
    if nodes is None:
        launch = ["--standalone"]
    else:
        launch = [f"--nnodes={nodes.count}", "--node-rank=0", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint={nodes.endpoint}", f"--rdzv-id={run_id}",
                  f"--rdzv-conf=join_timeout={nodes.timeout_s:g}"]
    return [sys.executable, "-m", TORCHRUN, *launch, f"--nproc_per_node={nproc}", "-m", module,
            spec_path]


def other_node_parts(inputs, nodes: Nodes, nproc: int, module: str, run_id: str) -> dict[int, NodePart]:
    """Every other node's part of a group whose node 0 runs `torchrun_command(nproc, ..., module, nodes, run_id)`,
    its ranks' environment made as node 0's (rank_environment)."""
    hardware = hardware_settings(inputs.settings)
    return {rank: NodePart(node_rank=rank, nnodes=nodes.count, nproc=nproc, endpoint=nodes.endpoint, run_id=run_id,
                           timeout_s=nodes.timeout_s, module=module, backend=group_backend(inputs),
                           threads=inputs.config.run.torch_threads, sharded=hardware.sharding == "fsdp",
                           gpus=tuple(hardware.gpus) if hardware.gpus is not None else None)
            for rank in range(1, nodes.count)}


def group_backend(inputs) -> str:
    """The process group's backend for an entry point's device: nccl on CUDA, gloo on the CPU."""
    return "nccl" if hardware_of_config(inputs.config).device.type == "cuda" else "gloo"


def rendezvous_timeout(tail: list[str], nodes: Nodes | None) -> bool:
    """Whether a group's torchrun output says that not every node joined the rendezvous in time."""
    return nodes is not None and any("RendezvousTimeoutError" in line for line in tail)


def rank_environment(inputs) -> dict[str, str]:
    """The environment torchrun starts the ranks with: this process's, unbuffered output, the run's thread count
    (torchrun would set 1), sharded, SHARDED_MALLOC (a user's own values of those win) and, with hardware.gpus, only
    those GPUs visible: torchrun starts every local rank with this one environment, and local rank i computes on
    the i-th visible GPU (segment_worker.join_group)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", str(inputs.config.run.torch_threads))
    if hardware_settings(inputs.settings).sharding == "fsdp":
        env = {**SHARDED_MALLOC, **env}
    return {**env, **visible_devices(hardware_settings(inputs.settings).gpus)}
