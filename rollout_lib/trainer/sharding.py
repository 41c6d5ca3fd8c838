"""Sharded data parallelism (FSDP2): every rank holds 1/N of the parameters, gradients and optimizer state.

`hardware.sharding = "fsdp"` (with `nproc` >= 2) turns the data-parallel segment (trainer/data_parallel.py) into a
sharded one, with torch's own FSDP2 (`torch.distributed.fsdp.fully_shard`): each decoder layer (the classes the
model names in `_no_split_modules`, as accelerate wraps them) and then the whole model become FSDP units, whose
parameters are DTensors holding this rank's rows. A forward or backward pass all-gathers one unit at a time and
frees it after; gradients are reduce-scattered, each rank keeping the sum of its rows (divide factor 1: the
step-global token counts already normalise the loss, as in data_parallel.py), and the optimizer steps the shards.

The arithmetic of a step is data_parallel.py's (each rank trains its share of the micro-batches with the step's
global token counts, fillers included); what changes is where the bytes live. Checkpoints do not change at all:
a snapshot gathers full tensors one at a time and rank 0 streams them into the store (`stream_state`) and writes the same
safetensors as a 1-process run, and a sharded trainer is opened from any checkpoint by loading it whole and then
sharding it, so a checkpoint written by N ranks opens on M.

Settings: `hardware.cpu_offload` keeps the shards (parameters, gradients, optimizer state) on the CPU between uses
(FSDP2's CPUOffloadPolicy; meaningful on a GPU); `hardware.precision = "bf16"` runs units in bf16 with fp32
gradient reduction (MixedPrecisionPolicy), beside the autocast every forward runs under.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from rollout_lib.adapters import base_of, is_adapted
from rollout_lib.checkpoint import (gathered_weights, optimizer_entry, optimizer_state_entries, param_groups,
                                    unshared_names)
from rollout_lib.store_tensors import safetensors_order


def shard_model(model: torch.nn.Module, *, bf16: bool = False, cpu_offload: bool = False) -> torch.nn.Module:
    """`model`, sharded in place over the default process group: each decoder layer, each part that owns its
    parameters (_callable_parts), then the root (which keeps what is left: embeddings tied to an output head, the
    final norm). Gradients reduce by SUM."""
    layer_classes = set(getattr(base_of(model), "_no_split_modules", None) or ())
    options = {}
    if bf16:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cpu_offload:
        # Pinned host memory makes the copies to and from a GPU faster; torch cannot pin without an accelerator
        # ("Cannot access accelerator device"), and a CPU model's shards are on the CPU already: a config written
        # for GPUs still trains on a laptop.
        on_accelerator = next(model.parameters()).device.type != "cpu"
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=on_accelerator)
    layers = [module for module in model.modules() if type(module).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"{type(base_of(model)).__name__} names no decoder layer classes (_no_split_modules) to "
                         "shard by")
    for layer in layers:
        fully_shard(layer, **options)
    for child in _callable_parts(base_of(model)):
        fully_shard(child, **options)
    fully_shard(model, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # SUM: the loss is already normalised by the global counts
            if hasattr(module, "set_force_sum_reduction_for_comms"):  # torch >= 2.12; older: nccl only
                module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no pre-multiplied sum)
    return model


def _callable_parts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformers model's direct children that own their parameters: units of their own, so that code
    calling one directly (a reward model's decoder, then its score head: model/reward.py) gathers what it needs.
    Children that share a parameter (an output head tied to the embeddings) stay in the root unit together."""
    children = [child for child in model.children() if any(True for _ in child.parameters())]
    holders = Counter(id(parameter) for child in children for parameter in child.parameters())
    return [child for child in children if all(holders[id(parameter)] == 1 for parameter in child.parameters())]


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank must ask), any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def trainable_names(model: torch.nn.Module) -> list[str]:
    """The trainable parameters' names in the optimizer's order (trainer/optim.py builds it over these)."""
    return [name for name, parameter in model.named_parameters() if parameter.requires_grad]


def full_weights(model: torch.nn.Module, keeper: int = 0) -> dict[str, torch.Tensor] | None:
    """The model's full state dict on rank `keeper`, on the CPU; None on the other ranks. Every rank must call it:
    each DTensor is gathered whole (an all-gather), one at a time in the same order everywhere, so no rank holds
    more than its shards and one full tensor at once (the keeper keeps what it gathers)."""
    keep = torch.distributed.get_rank() == keeper
    weights = {}
    for name, tensor in model.state_dict().items():
        value = _whole(tensor)
        if keep:
            weights[name] = value
    return weights if keep else None


def stream_state(store, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[str, str] | None:
    """Write a sharded trainer's weights and optimizer state to `store` as the objects an unsharded trainer's
    checkpoint holds (checkpoint.model_weights, optimizer_state_tensors), gathering one tensor at a time in the
    objects' own layout order: no rank ever holds more than its shards and one full tensor. Every rank calls it (the
    gathers are collectives); rank 0 writes and gets (weights id, optimizer id), the others None."""
    writer = torch.distributed.get_rank() == 0
    if is_adapted(model):  # an adapter's weights are small: gathered whole, then written as usual
        full = full_weights(model)
        weights_id = store.put_tensors(gathered_weights(model, full), {"format": "pt"}) if writer else None
    else:
        state = model.state_dict()
        weights_id = _stream(store, {name: state[name] for name in unshared_names(state)}, {"format": "pt"}, writer)
    entries, metadata = optimizer_state_entries(optimizer.state_dict())
    optimizer_id = _stream(store, entries, metadata, writer)
    return (weights_id, optimizer_id) if writer else None


def _stream(store, tensors: dict[str, torch.Tensor], metadata: dict[str, str], writer: bool) -> str | None:
    shapes = {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items()}  # a DTensor's: global
    whole = ((name, _whole(tensors[name])) for name in safetensors_order(shapes))
    if writer:
        return store.put_tensors_streamed(shapes, whole, metadata)
    for _ in whole:  # take part in every gather
        pass
    return None


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of a DTensor (a collective) on the CPU; a plain tensor on the CPU."""
    return local_value(tensor.detach()).to("cpu")


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict,
                              names: list[str]) -> None:
    """Shard an optimizer state dict in index form (every rank holds the same full one) into `optimizer`, built
    over the sharded model's trainable parameters in the same order: each per-parameter tensor is cut as its
    parameter is (`_own_rows`), scalars (`step`) stay as they are. (Not torch.distributed.checkpoint's
    set_optimizer_state_dict: fed a state restored from safetensors, its shards of the fused AdamW state came out
    corrupt here, NaN by the second step.)"""
    parameters = dict(model.named_parameters())
    sharded = {index: {key: _own_rows(parameters[names[index]], value) for key, value in entry.items()}
               for index, entry in state["state"].items()}
    optimizer.load_state_dict({"state": sharded, "param_groups": state["param_groups"]})


def receive_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: list[str],
                            store, optimizer_id: str) -> None:
    """`load_full_optimizer_state` of a checkpoint's optimizer object (`optimizer_id`, checkpoint.py's
    `state.<index>.<key>` tensors) with no rank ever holding more than its shards and one full tensor: rank 0
    streams the object from the store (ObjectStore.get_tensors_streamed) and broadcasts its layout, then each tensor
    in turn; every rank keeps its rows. AdamW's state is twice the model, so every rank reading it whole (what a
    1-process trainer does) set a later segment's peak. Every rank calls it."""
    streamed = store.get_tensors_streamed(optimizer_id) if torch.distributed.get_rank() == 0 else None
    shared = [(streamed.layout, streamed.metadata) if streamed is not None else None]
    torch.distributed.broadcast_object_list(shared, src=0)
    layout, metadata = shared[0]
    tensors = streamed.tensors() if streamed is not None else None
    parameters = dict(model.named_parameters())
    state: dict[int, dict] = {}
    for name, (dtype, shape) in layout.items():
        value = None
        if tensors is not None:
            read, value = next(tensors)
            assert read == name, (read, name)
        index, key = optimizer_entry(name)
        state.setdefault(index, {})[key] = _own_rows(parameters[names[index]], _broadcast(value, dtype, shape))
    if tensors is not None:
        next(tensors, None)  # the end: the object's hash is checked
    optimizer.load_state_dict({"state": state, "param_groups": param_groups(metadata)})


def _own_rows(parameter: torch.nn.Parameter, value):
    """A full per-parameter tensor cut as `parameter` is: this rank's rows, copied out (the full tensor is not kept
    alive by a view); a scalar or anything else as it is."""
    if isinstance(parameter, DTensor) and torch.is_tensor(value) and value.shape == parameter.shape:
        return distribute_tensor(value.to(parameter.device), parameter.device_mesh, parameter.placements,
                                 src_data_rank=None)  # every rank cuts its own: no collective
    return value


def _broadcast(value: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Rank 0's tensor on every rank (`value` on rank 0, None elsewhere), returned on the CPU; nccl moves CUDA
    tensors only, so there it travels through this rank's GPU."""
    nccl = torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    value = torch.empty(shape, dtype=dtype, device=device) if value is None else value.to(device)
    torch.distributed.broadcast(value, src=0)
    return value.cpu()
