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

`run_segment_in_processes` is the launching side: `torchrun --standalone --nproc_per_node N -m
rollout_lib.trainer.segment_worker SPEC` from the segment's start checkpoint in the store (with hardware.nnodes > 1:
node 0 of a c10d rendezvous, the other nodes' commands announced); it returns the snapshot's checkpoint id and the
per-step metrics, publishing each step as rank 0 reports it. With hardware.sharding = "fsdp" the ranks shard the
model instead of each holding it (trainer/sharding.py); the arithmetic above is unchanged. A rank that dies
(an exception, SIGKILL) makes torchrun stop the others; the segment then fails naming its steps and the rank, and
a rerun trains it again from the same start checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pyarrow as pa
import torch
import torch.distributed as dist

from rollout_lib import step_events
from rollout_lib.losses import COMPONENTS
from rollout_lib.hardware import hardware_of_config, hardware_settings, visible_devices
# RECEIVE_SPEC: re-exported for the ranks (segment_worker)
from rollout_lib.trainer.node_parts import (RECEIVE_SPEC, SHARDED_MALLOC, NodeLauncher, NodePart, NodePartError,
                                            launcher_for)

logger = logging.getLogger(__name__)

# Rank 0 prints one line per finished step, `STEP_MARKER {"step": n, "metrics": {...}}`, on its stdout.
STEP_MARKER = "ROLLOUT_DATA_PARALLEL_STEP "
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
class SegmentSpec:
    """What a rank needs to train a segment: the trainer class, its inputs (config, identity, data ids), the start
    checkpoint, the steps, the trainer's options (picklable: `causal.PlannedBatches` reloads in the worker), and
    the file rank 0 writes the result to."""

    trainer_class: type
    inputs: object  # trainer.base.TrainingInputs
    checkpoint_id: str
    first: int
    last: int
    options: dict
    result_path: str


def data_parallel_segment(trainer_class: type, inputs, checkpoint_id: str, resident, **options):
    """For `segment.run_segment(train_elsewhere=...)`: None when the entry point's hardware says one process, else
    a function training a segment in `nproc` processes from `checkpoint_id`. A resident trainer at that checkpoint
    is dropped (the workers open it from the store)."""

    hardware = hardware_settings(inputs.settings)
    if hardware.world_size == 1:
        return None

    def train(segment) -> tuple[str, list[dict]]:
        resident.pop(checkpoint_id)
        return run_segment_in_processes(trainer_class, inputs, checkpoint_id, segment.first, segment.last,
                                        hardware.nproc, **options)

    return train


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
    return [sys.executable, "-m", "torch.distributed.run", *launch, f"--nproc_per_node={nproc}", "-m", module,
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


def run_segment_in_processes(trainer_class: type, inputs, checkpoint_id: str, first: int, last: int, nproc: int,
                             announce: NodeLauncher | Callable | None = None, **options) -> tuple[str, list[dict]]:
    """Steps first..last from `checkpoint_id` as `nproc` torchrun processes (per node: with hardware.nnodes > 1 this
    machine is node 0, and the other nodes' parts are started by `announce`, by default hardware.node_pool's agents
    or logged commands: node_parts.launcher_for); (the snapshot's id, per-step metrics). Each finished step is
    published (step_events) as rank 0 reports it. Raises DataParallelError when a rank fails or a node's part
    fails, never starts or is lost."""
    hardware = hardware_settings(inputs.settings)
    nodes = Nodes.of(hardware)
    launcher = launcher_for(hardware, announce) if nodes is not None else None
    with tempfile.TemporaryDirectory(prefix="rollout-dp-") as workdir:
        spec = SegmentSpec(trainer_class, inputs, checkpoint_id, first, last, options,
                           os.path.join(workdir, "result.json"))
        spec_path = os.path.join(workdir, "spec.pkl")
        with open(spec_path, "wb") as out:
            pickle.dump(spec, out)
        tail: deque[str] = deque(maxlen=400)
        env = rank_environment(inputs)
        run_id = f"rollout-{os.path.basename(workdir)}"
        module = "rollout_lib.trainer.segment_worker"
        process = subprocess.Popen(torchrun_command(nproc, spec_path, module, nodes=nodes, run_id=run_id),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   text=True, env=env)
        if launcher is not None:
            try:
                # a part that ends badly while node 0 waits stops it (SIGTERM: torchrun stops its ranks)
                launcher.launch(other_node_parts(inputs, nodes, nproc, module, run_id), abort=process.terminate)
            except BaseException as exc:
                process.kill()
                process.wait()
                if isinstance(exc, NodePartError):
                    raise DataParallelError(f"train steps {first}-{last}: {exc}") from None
                raise
        with process:
            for line in process.stdout:
                marker = line.find(STEP_MARKER)
                if marker >= 0:
                    reported = json.loads(line[marker + len(STEP_MARKER):])
                    step_events.publish(reported["step"], reported["metrics"])
                else:
                    tail.append(line.rstrip("\n"))
        succeeded = process.returncode == 0 and os.path.exists(spec.result_path)
        node_problem = launcher.settle(succeeded) if launcher is not None else None
        rerun = f"the segment's start checkpoint is in the store, so a rerun trains steps {first}-{last} again from it"
        if not succeeded:
            where = f"train steps {first}-{last}: data-parallel segment ({nproc} processes) failed"
            # a node's part never started or was lost, or failed before its node joined: the segment's failure
            if node_problem is not None and (node_problem.caused or rendezvous_timeout(list(tail), nodes)):
                raise DataParallelError(f"train steps {first}-{last}: {node_problem.line}; {rerun}.\nnode 0's last "
                                        "output:\n" + "\n".join(list(tail)[-20:]))
            if node_problem is not None:  # it failed with node 0's ranks: which side began it, node 0's output says
                where += f" ({node_problem.line})"
            if rendezvous_timeout(list(tail), nodes):
                raise DataParallelError(
                    f"train steps {first}-{last}: not every node of {nodes.count} joined the rendezvous at "
                    f"{nodes.endpoint} within {nodes.timeout_s:g} s (hardware.rdzv_timeout_s); start the other "
                    f"nodes' torchrun (logged as the segment started), or set hardware.nnodes = 1. The segment's "
                    f"start checkpoint is in the store, so a rerun trains steps {first}-{last} again from it")
            raise DataParallelError(failure_message(where, process.returncode, list(tail), rerun))
        if node_problem is not None:  # node 0 has the result: the segment stands; say what a node did afterwards
            logger.warning("train steps %d-%d: %s", first, last, node_problem.line)
        with open(spec.result_path) as result:
            done = json.load(result)
    return done["checkpoint"], done["history"]


def failure_message(where: str, returncode: int | None, tail: list[str], rerun: str) -> str:
    """`where`: which rank failed and how, from torchrun's failure summary ("rank : 1 (local_rank: 1)",
    "exitcode : -9", "traceback : Signal 9 (SIGKILL) received by PID ..."), else the last lines of output; then
    what a rerun does (`rerun`) and the last output."""
    failure = first_failure(tail)
    if failure is not None:
        cause = failure["traceback"] or f"exit code {failure['exitcode']}"
        # torchrun's placeholder, or the first line of a traceback: the worker's own error is in the output above
        if cause.startswith(("To enable traceback", "Traceback")):
            errors = [line for line in tail if re.search(r"\b\w+(Error|Exception)\b:", line)
                      and "ChildFailedError" not in line]
            cause = errors[-1].strip() if errors else f"exit code {failure['exitcode']}"
        message = f"{where}: rank {failure['rank']} exited with code {failure['exitcode']} ({cause})"
    else:
        message = f"{where}: torchrun exited with code {returncode}"
    return f"{message}; {rerun}.\nlast output:\n" + "\n".join(tail[-20:])


_FAILURE = re.compile(r"^\s*\[\d+\]:\s*$")
_FIELD = re.compile(r"^\s*(rank|exitcode|traceback)\s*:\s*(.*)$")
SIGTERM_EXIT = -15  # how torchrun stops the ranks still running once one has failed


def first_failure(tail: list[str]) -> dict | None:
    """The failure that started it, from torchrun's summary: {"rank", "exitcode", "traceback"}, or None when the
    output holds no summary. torchrun names its "Root Cause" by time, at one-second resolution, so a rank it
    stopped itself (SIGTERM, once another rank died) can tie with the rank that died and win on rank order: a
    failure that is not torchrun's own SIGTERM is preferred."""
    text = "\n".join(tail)
    start = text.rfind("Failures:")
    if start < 0:
        return None
    failures, current = [], None
    for line in text[start:].splitlines():
        if _FAILURE.match(line):
            current = {}
            failures.append(current)
            continue
        found = _FIELD.match(line)
        if current is not None and found and found.group(1) not in current:  # a traceback's own lines may match
            current[found.group(1)] = found.group(2).strip()
    failures = [parsed for parsed in map(_parsed_failure, failures) if parsed is not None]
    if not failures:
        return None
    root = failures[-1]  # torchrun lists its root cause last
    if root["exitcode"] == SIGTERM_EXIT:
        return next((failure for failure in failures if failure["exitcode"] != SIGTERM_EXIT), root)
    return root


def _parsed_failure(fields: dict[str, str]) -> dict | None:
    rank = re.match(r"(\d+)", fields.get("rank", ""))
    if rank is None:
        return None
    code = re.match(r"(-?\d+)", fields.get("exitcode", ""))
    return {"rank": int(rank.group(1)), "exitcode": int(code.group(1)) if code else "?",
            "traceback": fields.get("traceback", "")}


def root_cause_rank(tail: list[str]) -> int | None:
    """The rank whose failure started it (first_failure), if torchrun's summary names one."""
    failure = first_failure(tail)
    return failure["rank"] if failure is not None else None