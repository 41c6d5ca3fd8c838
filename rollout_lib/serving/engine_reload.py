"""Runs inside a vLLM policy server, not in rollout: the live policy's weights reloaded in place by the shortest
path vLLM's CPU backend allows, with vLLM's own `reload_weights` wherever that path does not apply.

    POST /collective_rpc {"method": "reload_policy_weights", "args": ["<directory with model.safetensors>"]}
        -> {"results": ["in place" | "vllm reload_weights (<why>)"]}

On the CPU backend a linear layer keeps no weight once loaded (vLLM's `dispatch_cpu_unquantized_gemm` packs it into
the kernel's own copy), so nothing can be copied into in place: each such layer is handed its new weight (its
checkpoint tensors concatenated as `packed_modules_mapping` says) and that same dispatch runs again; every other
parameter is copied in place; the output head is packed again from the (tied) embeddings. No layer is rebuilt and
no loader runs; the file stays mapped between reloads. Why not `reload_weights`, measured, and the bit-for-bit
check against it: docs/serving.md.

It applies to one worker (no tensor parallelism), unquantized weights, on the CPU platform. Anything else, or a
checkpoint that lacks a tensor the model needs or holds one of another shape (checked before anything changes),
takes vLLM's `reload_weights`: slower, always right. Either way the policy server's probe checks the result.

Imports vLLM, torch and safetensors only, lazily: vLLM's environment has no rollout beyond the files this package
puts on its path (worker_extension.py).
"""

from __future__ import annotations

import os

WEIGHTS_FILE = "model.safetensors"


class NotInPlace(Exception):
    """This model or checkpoint is not one the in-place path handles; the message says why."""


def reload_policy_weights(worker, directory: str) -> str:
    """Reload `directory`'s weights into `worker`'s model; which path ran."""
    from vllm.config import set_current_vllm_config

    try:
        with set_current_vllm_config(worker.vllm_config):  # as the worker's own reload_weights runs
            _reload_in_place(worker.model_runner, _open_checkpoint(worker, os.path.join(directory, WEIGHTS_FILE)))
    except NotInPlace as why:
        worker.reload_weights(weights_path=directory)
        return f"vllm reload_weights ({why})"
    # What vLLM's own reload resets after new weights (caches derived from the old ones).
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        getattr(worker.model_runner, reset, lambda: None)()
    return "in place"


def _open_checkpoint(worker, weights_file: str):
    """The weights file, opened (memory-mapped: its tensors are views of the file's pages) once and kept open while
    it is the same file: the policy server rewrites it in place (weight_sync.py), and a fresh mapping each reload
    would fault in all its pages again. A new file (another inode or size) is opened afresh."""
    from safetensors import safe_open

    try:
        status = os.stat(weights_file)
    except FileNotFoundError:
        raise NotInPlace(f"no {WEIGHTS_FILE}") from None
    key = (weights_file, status.st_dev, status.st_ino, status.st_size)
    cached = getattr(worker, "_rollout_policy_checkpoint", None)
    if cached is None or cached[0] != key:
        worker._rollout_policy_checkpoint = (key, safe_open(weights_file, framework="pt"))
    return worker._rollout_policy_checkpoint[1]


def _reload_in_place(model_runner, checkpoint) -> None:
    import torch
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise NotInPlace("not the CPU backend: its parameters keep their weights and reload_weights copies into them")
    if get_tensor_model_parallel_world_size() != 1:
        raise NotInPlace("tensor parallel")
    if model_runner.model_config.quantization is not None:
        raise NotInPlace(f"quantized ({model_runner.model_config.quantization})")
    model = model_runner.get_model()
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    modules = dict(model.named_modules())
    names = set(checkpoint.keys())
    # zentorch's kernel (AMD Zen CPUs) keeps the tensor it is given: hand it a copy, never a view of the file.
    views_allowed = not current_platform.is_zen_cpu()
    with torch.no_grad():
        plan = [(name, parameter, modules[name.rpartition(".")[0]], _sources(name, packed, checkpoint, names))
                for name, parameter in model.named_parameters()]
        # Check everything before changing anything: a refusal must leave the model as it was.
        for name, parameter, module, sources in plan:
            shape = _expected_shape(parameter, module)
            if shape is None or (parameter.numel() == 0 and not name.endswith(".weight")):
                raise NotInPlace(f"{name} is empty and is no linear layer's weight packed into its kernel")
            got = (sum(source.shape[0] for source in sources), *sources[0].shape[1:])
            if tuple(got) != shape:
                raise NotInPlace(f"{name}: the checkpoint's shape {tuple(got)} is not the model's {shape}")
        for name, parameter, module, sources in plan:
            if parameter.numel() == 0:
                module.weight = torch.nn.Parameter(_joined(sources, parameter.dtype, views_allowed),
                                                   requires_grad=False)
                _dispatch(module, remove_weight=True)
                if module.weight.numel() > 0:  # a kernel that multiplies by layer.weight itself (torch's fallback)
                    module.weight = torch.nn.Parameter(module.weight.detach().clone(), requires_grad=False)
            else:
                parameter.copy_(torch.cat(sources) if len(sources) > 1 else sources[0])
        for module in _output_heads(model):
            _dispatch(module, remove_weight=False)


def _sources(name: str, packed: dict[str, list[str]], checkpoint, names: set[str]) -> list:
    """The checkpoint tensors (zero-copy views of the mapped file) a parameter of the vLLM model is made of, in
    order: q, k, v for `qkv_proj.weight`; one tensor, under the same name, for the rest."""
    name = name.replace(".base_layer.", ".")  # a LoRA-enabled server wraps its linear layers
    module_name, _, parameter_name = name.rpartition(".")
    prefix, _, leaf = module_name.rpartition(".")
    wanted = ([f"{prefix}.{part}.{parameter_name}" for part in packed[leaf]] if leaf in packed else [name])
    missing = [source for source in wanted if source not in names]
    if missing:
        raise NotInPlace(f"the checkpoint has no {', '.join(missing)}")
    return [checkpoint.get_tensor(source) for source in wanted]


def _expected_shape(parameter, module) -> tuple[int, ...] | None:
    """The shape the checkpoint must give `parameter`: its own, or for a linear layer whose weight lives only in
    its kernel (an empty parameter), the layer's (out, in) sizes."""
    if parameter.numel() > 0:
        return tuple(parameter.shape)
    if not hasattr(module, "cpu_linear"):
        return None
    out_size = getattr(module, "output_size_per_partition", None)
    in_size = getattr(module, "input_size_per_partition", None)
    return (out_size, in_size) if out_size and in_size else None


def _joined(sources: list, dtype, views_allowed: bool):
    """A linear layer's new weight for its kernel to pack: its parts concatenated (a new tensor), or its one part
    as the file's own view where the kernel copies what it is given (oneDNN's and sgl's packing do: vLLM's dispatch
    then empties `layer.weight`) and the dtypes agree, else a copy. A view must not outlive the packing: the trainer
    rewrites the file next step."""
    import torch

    if len(sources) > 1:
        return torch.cat(sources).to(dtype)
    if views_allowed and sources[0].dtype == dtype:
        return sources[0]
    return sources[0].to(dtype, copy=True)


def _dispatch(module, *, remove_weight: bool) -> None:
    """vLLM's own choice and packing of the CPU matmul kernel for `module` (what process_weights_after_loading
    runs)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(module, remove_weight=remove_weight)


def _output_heads(model) -> list:
    """The modules that keep their weight and multiply by it through a packed kernel: the output head (its weight
    often the input embeddings', tied), packed again from the weights just copied. An input embedding also has a
    kernel from the same dispatch but only looks rows up, so packing it again would be 40 ms for nothing."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    return [module for module in model.modules()
            if hasattr(module, "cpu_linear") and module.weight.numel() > 0
            and not (isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead))]
