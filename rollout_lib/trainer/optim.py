"""Optimizers, and the learning-rate schedule as a pure function of the step (optimizer state as tensors: the
checkpoint format, checkpoint.py).

The schedule is a function of the step (not a stateful scheduler) so a run restored from any snapshot computes
exactly the same learning rates as an uninterrupted one.
"""

from __future__ import annotations

import math

import torch

from rollout_lib.config.common import OptimizerSettings


def build_optimizer(params, settings: OptimizerSettings) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if settings.kind == "adamw":
        # fused: one elementwise kernel per tensor on CPU and GPU (deterministic: no reduction, no dependence on
        # how tensors are grouped), ~0.3 s a step faster than the per-tensor loop on SmolLM2 here
        # (bench/bench_train_step.py). A checkpoint's saved param groups keep the implementation it trained with.
        return torch.optim.AdamW(params, lr=settings.lr, betas=settings.betas, eps=settings.eps,
                                 weight_decay=settings.weight_decay, fused=True)
    return torch.optim.SGD(params, lr=settings.lr, momentum=settings.momentum,
                           weight_decay=settings.weight_decay, foreach=False)


def lr_at(step: int, settings: OptimizerSettings, max_steps: int) -> float:
    """Learning rate of optimizer step `step` (1-based): linear warmup, then constant / linear / cosine decay."""
    if settings.warmup_steps and step <= settings.warmup_steps:
        return settings.lr * step / settings.warmup_steps
    if settings.schedule == "constant":
        return settings.lr
    decay_steps = max(1, settings.schedule_horizon(max_steps) - settings.warmup_steps)
    progress = min(1.0, (step - settings.warmup_steps) / decay_steps)
    floor = settings.min_lr_ratio
    if settings.schedule == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return settings.lr * (floor + (1.0 - floor) * factor)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_gradients(parameters, max_grad_norm: float | None) -> torch.Tensor:
    """Total gradient norm (before clipping) over the parameters that have a gradient; with `max_grad_norm`,
    the gradients are scaled in place so that their total norm is at most that."""
    params = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    # Sharded gradients (FSDP2's DTensors): the norm is a DTensor too, its value summed over the shards.
    total = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    # clip_grad_norm_ in two calls (the same bits), so that a non-finite norm scales nothing: it would turn every
    # gradient NaN and hide which one was not (trainer/nonfinite.py); such a step never reaches the optimizer.
    if max_grad_norm is not None and bool(torch.isfinite(total)):
        torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm)
    return total
