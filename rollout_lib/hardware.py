"""Where models compute: the hardware settings every entry point composes (`[algorithm.<kind>.hardware]`), "auto"
resolved, models placed, forward passes under the chosen precision. A ground-floor fact: trainers, samplers,
scorers and evaluators all read it, so it imports nothing of rollout_lib above the ground.

`resolve_hardware` turns `HardwareSettings` into a `ResolvedHardware` on this machine (a CUDA device asked for where
there is none, or bf16 where the device has no bf16, is a ConfigError naming the setting). `place_model` moves a
model there, turns gradient checkpointing on when asked and tags the model with the hardware it runs on, so that
every function handed the model (the training step, the evaluators, the embedded sampler and reward-model scorer,
a frozen copy of the policy) computes where and as it does: inputs go to `model_device(model)` and forward passes
run under `autocast_for(model)`.

Checkpoints stay device-independent: weights and optimizer state are written from CPU copies
(checkpoint.py) and copied onto the configured device when a checkpoint is restored.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from pydantic import Field, ValidationInfo, field_validator, model_validator

from rollout_lib.determinism import use_deterministic_torch
from rollout_lib.errors import ConfigError
from rollout_lib.settings_base import StrictModel

class HardwareSettings(StrictModel):
    """Where an entry point's models compute and in what precision (`[algorithm.<kind>.hardware]`, docs/hardware.md).

    Every model the entry point trains, samples, scores or evaluates with goes to `device`; checkpoints are written
    from CPU copies, so one trained anywhere loads anywhere. `precision = "bf16"`: forward passes under bf16
    autocast, weights, gradients and optimizer state in fp32. `gradient_checkpointing`: activations recomputed in
    backward (less memory, more time, the same numbers)."""

    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")  # auto: CUDA when available, else CPU
    # bf16 autocast on a CPU is slow on most CPUs and rounds differently from fp32: a config written for a GPU
    # with device = "auto" must not silently run it on a CPU-only machine. Set this to mean it. (Declared before
    # `precision`: its validator reads this.)
    allow_cpu_bf16: bool = False
    precision: Literal["fp32", "bf16"] = "fp32"
    gradient_checkpointing: bool = False
    # CUDA only: torch.use_deterministic_algorithms (and CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set). Off by
    # default: slower, and an op with no deterministic CUDA kernel then raises. On CPU kernels are always pinned.
    cuda_deterministic: bool = False
    # Data parallelism (docs/hardware.md "Data parallel"): a training segment runs as this many processes on this
    # machine (`torchrun --standalone`, gloo on CPU, nccl on CUDA: one GPU per process), each taking its share of
    # every step's micro-batches, gradients summed across them. 1: in the flow's own process, as always.
    nproc: int = Field(1, ge=1)
    # "fsdp": the nproc processes shard parameters, gradients and optimizer state between them (FSDP2,
    # trainer/sharding.py; docs/hardware.md "Sharded training") instead of each holding everything. "none": plain
    # data parallelism. Absent from the identity unless "fsdp".
    sharding: Literal["none", "fsdp"] = "none"
    # sharding = "fsdp": shards live on the CPU between uses (FSDP2's CPUOffloadPolicy): GPU memory for CPU time.
    cpu_offload: bool = False
    # Several nodes (docs/scale.md): a segment's ranks are nproc per node on `nnodes` nodes, joined by torchrun's c10d
    # rendezvous at `rdzv_endpoint` ("host:port", reachable from every node); this machine is node 0, the others run
    # the torchrun command the segment logs. A node that has not joined within `rdzv_timeout_s` fails the segment.
    nnodes: int = Field(1, ge=1)
    rdzv_endpoint: str | None = Field(None, pattern=r"^[^\s:]+:[0-9]{1,5}$")
    rdzv_timeout_s: float = Field(300.0, gt=0)
    # The Prefect work pool whose node agents (`rollout node start --pool P --node K`, one per other node) start
    # the other nodes' parts of every rendezvous by themselves, submitted by the flow (trainer/node_parts.py); a
    # part not running and joined within rdzv_timeout_s fails the segment naming its node. None: each segment logs
    # the other nodes' torchrun commands for someone to run. Where ranks run, never what: not in the identity.
    node_pool: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$")
    # With node_pool: once node 0's torchrun has failed, how long the other nodes' parts may take to report their
    # end (their ranks lose node 0's and fail likewise) before a part still Running counts as lost: its agent
    # killed or its node gone, the part marked Crashed. Longer where agents report slowly (a busy Prefect server);
    # shorter to fail sooner. Not in the identity.
    node_lost_after_s: float = Field(20.0, gt=0)
    # The GPUs of each node the trainer takes (docs/scale.md, "GPUs placed"): torchrun's ranks see only these
    # (CUDA_VISIBLE_DEVICES), local rank i computes on the i-th; one process in the flow's own: on the first. None:
    # every GPU, as before. Where the model computes, never what: not in the identity.
    gpus: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_gpu_per_process(self) -> "HardwareSettings":
        if self.nproc > 1 and self.device.startswith("cuda:"):
            raise ValueError(f'nproc = {self.nproc} gives each process its own GPU (process i: cuda:i); use '
                             f'device = "cuda" or "auto", not {self.device!r}')
        if self.sharding == "fsdp" and self.nproc * self.nnodes < 2:
            raise ValueError(f'sharding = "fsdp" shards the model over the nproc processes, and nproc = {self.nproc}: '
                             'set nproc >= 2 (one process holds everything anyway)')
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ValueError(f'nnodes = {self.nnodes} joins the nodes at a rendezvous: set rdzv_endpoint = "host:port" '
                             '(a free port on node 0, reachable from every node)')
        if self.node_pool is not None and self.nnodes == 1:
            raise ValueError(f"node_pool = {self.node_pool!r} starts the other nodes' parts, and nnodes = 1: set "
                             "nnodes to the nodes' count (this one included), or leave node_pool out")
        if self.gpus is not None:
            if len(set(self.gpus)) < len(self.gpus):
                raise ValueError(f"gpus lists a GPU twice: {self.gpus}")
            if self.device == "cpu" or self.device.startswith("cuda:"):
                raise ValueError(f'gpus places the trainer on GPUs {self.gpus}: use device = "cuda" or "auto", '
                                 f'not {self.device!r}')
        if self.cpu_offload and self.sharding != "fsdp":
            raise ValueError('cpu_offload is FSDP2\'s offload of the shards: set sharding = "fsdp" with it')
        return self

    @field_validator("precision")
    @classmethod
    def _bf16_on_cpu_only_when_meant(cls, precision: str, info: ValidationInfo) -> str:
        if precision == "bf16" and info.data.get("device") == "cpu" and not info.data.get("allow_cpu_bf16"):
            raise ValueError('bf16 autocast on device = "cpu" is slow on most CPUs and not the vetted setting; '
                             'use "fp32", or set allow_cpu_bf16 = true')
        return precision

    @property
    def world_size(self) -> int:
        """Every rank of a segment: nproc per node on nnodes nodes."""
        return self.nproc * self.nnodes

    def identity_settings(self, device_type: str) -> dict | None:
        """What of these settings decides the weights, given the device type `device` resolved to: the device type
        (CPU and CUDA kernels round differently; not its index: cuda:0 and cuda:1 compute alike), the precision
        and, on CUDA, deterministic kernels. None for fp32 on CPU, so a CPU run's identity is what it was before
        these settings existed. gradient_checkpointing never enters: recomputing the forward pass in backward
        gives the same bits (tests/test_hardware.py), only memory and time change. The ranks' count (nproc x nnodes)
        enters as `nproc` when above 1:
        gradients summed across processes add in another order than one process accumulating them, so the weights
        agree with a 1-process run only within rounding (docs/hardware.md "Data parallel"), never bit for bit.
        `sharding` enters when "fsdp": the gradients sum as data parallelism sums them, but the clipping norm adds
        up per shard, so the weights can differ from an unsharded run's in the last bits. `cpu_offload` never
        enters: where the shards wait between uses changes no number."""
        material = {}
        if device_type != "cpu" or self.precision != "fp32":
            material = {"device": device_type, "precision": self.precision}
        if device_type == "cuda" and self.cuda_deterministic:
            material["cuda_deterministic"] = True
        if self.world_size > 1:  # the ranks' count, however they spread over nodes: the same additions
            material["nproc"] = self.world_size
        if self.sharding != "none":  # the clipping norm is summed from the shards: its last bits can differ
            material["sharding"] = self.sharding
        return material or None


def hardware_settings(settings) -> HardwareSettings:
    """An entry point's hardware settings: its block's `hardware`, or the defaults for a block without one."""
    hardware = getattr(settings, "hardware", None)
    return hardware if isinstance(hardware, HardwareSettings) else HardwareSettings()


# The attribute a placed model carries its ResolvedHardware in (copied with the model by copy.deepcopy).
HARDWARE_ATTRIBUTE = "rollout_hardware"


@dataclass(frozen=True)
class ResolvedHardware:
    device: torch.device
    precision: str = "fp32"
    gradient_checkpointing: bool = False
    cuda_deterministic: bool = False

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.precision == "bf16" else None

    def autocast(self):
        """The context forward passes run in: bf16 autocast (fp32 weights) for precision "bf16", else nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def use_deterministic_kernels(self, threads: int) -> None:
        """CPU: deterministic kernels and the pinned thread count, always (byte-identical checkpoints). CUDA:
        deterministic kernels only with `cuda_deterministic` (cuBLAS then needs its workspace setting, which must
        be in the environment before cuBLAS starts: set here unless the user set one)."""
        use_deterministic_torch(threads)
        if self.device.type == "cuda":
            if self.cuda_deterministic:
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            else:
                torch.use_deterministic_algorithms(False)


CPU = ResolvedHardware(torch.device("cpu"))


def resolve_hardware(settings: HardwareSettings, where: str = "hardware") -> ResolvedHardware:
    """The settings on this machine. `where`: their locator (`algorithm.sft.hardware`), for the errors."""
    if settings.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(settings.device)
    if device.type == "cuda" and settings.gpus and settings.world_size == 1:
        # in the flow's own process, which sees every GPU; torchrun's ranks see only `gpus` (gpu_env.visible_devices)
        device = torch.device("cuda", settings.gpus[0])
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError([(f"{where}.device", f"{settings.device!r}: CUDA is not available on this machine "
                                                   "(torch sees no GPU); use \"auto\" or \"cpu\"")])
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError([(f"{where}.device", f"{settings.device!r}: this machine has "
                                                   f"{torch.cuda.device_count()} CUDA device(s)")])
    if settings.precision == "bf16":
        if device.type == "cpu" and not settings.allow_cpu_bf16:
            raise ConfigError([(f"{where}.precision",
                                f'bf16 with device = {settings.device!r} runs on the CPU here, where bf16 autocast is '
                                'slow on most CPUs; use "fp32", or set allow_cpu_bf16 = true')])
        if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
            raise ConfigError([(f"{where}.precision", f"{torch.cuda.get_device_name(device)} has no bf16 support; "
                                                      'use "fp32"')])
    return ResolvedHardware(device, settings.precision, settings.gradient_checkpointing, settings.cuda_deterministic)


def replica_gpus(gpus: list[int] | None, replicas: int) -> list[list[int]]:
    """`gpus` split into `replicas` consecutive equal shares, replica j's the j-th ([] without gpus)."""
    if not gpus:
        return []
    share = len(gpus) // replicas
    return [list(gpus[j * share:(j + 1) * share]) for j in range(replicas)]


def placement_problems(where: str, hardware: HardwareSettings,
                       served: list[tuple[str, list[int] | None]] = ()) -> list[tuple[str, str]]:
    """Plan-time (locator, problem) pairs of GPU placement: the trainer's `gpus` (at `where`.gpus) too few for its
    nproc ranks, a served model's GPUs (`served`: (locator, gpus)) shared with the trainer or another served model,
    and, where torch sees CUDA, a GPU the node does not have (on a CPU-only machine that check is skipped: the
    nodes' GPUs are unknown here)."""
    problems = []
    trainer = hardware.gpus or []
    if trainer and hardware.nproc > len(trainer):
        problems.append((f"{where}.gpus", f"nproc = {hardware.nproc} ranks per node take one GPU each, and gpus "
                                          f"lists {len(trainer)} ({trainer}): list {hardware.nproc} GPUs or "
                                          "lower nproc"))
    taken = {gpu: f"{where}.gpus" for gpu in trainer}
    for locator, gpus in served:
        for gpu in gpus or []:
            if gpu in taken:
                problems.append((locator, f"GPU {gpu} is also in {taken[gpu]}: the trainer's ranks and each served "
                                          "model's replicas take disjoint GPUs"))
                break
        taken.update({gpu: locator for gpu in gpus or []})
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        problems += [(locator, f"GPU {gpu} is not on this node, which has {count} (0-{count - 1})")
                     for gpu, locator in sorted(taken.items()) if gpu >= count][:1]
    return problems


def hardware_of_config(config) -> ResolvedHardware:
    """An entry point config's hardware (`config.settings.hardware`, the defaults when its block has none)."""
    locator = getattr(config, "hardware_locator", "hardware")
    return resolve_hardware(hardware_settings(config.settings), locator)


def place_model(model: torch.nn.Module, hardware: ResolvedHardware, *, trainable: bool = False) -> torch.nn.Module:
    """`model` on the hardware's device (fp32 weights), tagged with it; with `trainable` and gradient
    checkpointing asked for, activations are recomputed in backward (non-reentrant: it works with inputs that need
    no gradient and keeps dropout's RNG state, so the gradients are the ones without it)."""
    model.to(hardware.device)
    if trainable and hardware.gradient_checkpointing:
        non_reentrant = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # its name from transformers 5.x on
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=non_reentrant)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=non_reentrant)
    setattr(model, HARDWARE_ATTRIBUTE, hardware)
    return model


def hardware_of(model: torch.nn.Module) -> ResolvedHardware:
    """The hardware a model was placed on (`place_model`); an untagged model: where its weights are, in fp32."""
    hardware = getattr(model, HARDWARE_ATTRIBUTE, None)
    if isinstance(hardware, ResolvedHardware):
        return hardware
    return ResolvedHardware(model_device(model))


def is_checkpointing(model: torch.nn.Module) -> bool:
    """Whether the model recomputes activations in backward (transformers' name for it moved in 5.x)."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def model_device(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def autocast_for(model: torch.nn.Module):
    """The precision context of `model`'s forward passes (see ResolvedHardware.autocast)."""
    return hardware_of(model).autocast()
