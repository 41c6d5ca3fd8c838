"""The hardware settings at run time: "auto" resolved, models placed, forward passes under the chosen precision.

`resolve_hardware` turns `HardwareSettings` into a `ResolvedHardware` on this machine (a CUDA device asked for where
there is none, or bf16 where the device has no bf16, is a ConfigError naming the setting). `place_model` moves a
model there, turns gradient checkpointing on when asked and tags the model with the hardware it runs on, so that
every function handed the model (the training step, the evaluators, the embedded sampler and reward-model scorer,
a frozen copy of the policy) computes where and as it does: inputs go to `model_device(model)` and forward passes
run under `autocast_for(model)`.

Checkpoints stay device-independent: weights and optimizer state are written from CPU copies
(trainer.checkpoint) and copied onto the configured device when a checkpoint is restored.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from rollout_lib.config.common import HardwareSettings
from rollout_lib.config.errors import ConfigError
from rollout_lib.trainer.determinism import use_deterministic_torch

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


def hardware_of_config(config) -> ResolvedHardware:
    """An entry point config's hardware (`config.settings.hardware`, the defaults when its block has none)."""
    from rollout_lib.config.common import hardware_settings

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
