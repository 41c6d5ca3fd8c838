"""Shipping the trainer's weights to a policy server on this machine: one safetensors file in shared memory,
rewritten in place after each step (a LoRA policy: its adapter directory, `AdapterDirectory`).

The first write is safetensors' own `save_file` (the format is the library's); every later write checks that the
model's tensors still have the file's names, dtypes and shapes and copies each tensor's bytes into its slot of the
memory-mapped file (one memcpy per tensor, no new file; a changed layout gets a fresh file). The directory is in
/dev/shm where it has room, else beside the deployment's record (engine.weights_dirs). Every tensor is written, a
tied `lm_head.weight` included (vLLM would otherwise keep its output head on the old embeddings).

Nothing reads the file while it is rewritten: the policy server writes, then asks its replicas to reload, then
probes them, under one lock; a reload that saw a half-written file (a crash mid-write) fails its probe.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
from pathlib import Path

import torch

from rollout_lib.adapters import adapter_config, adapter_weights, merged_state_dict
from rollout_lib.store_tensors import SAFETENSORS_DTYPES

WEIGHTS_FILE = "model.safetensors"


def state_tensors(model) -> dict[str, torch.Tensor]:
    """The model's state dict on the CPU, contiguous: every entry, tied ones included, as its own name (a LoRA
    model's: its base's names, the adapter merged in: adapters.merged_state_dict)."""
    return {name: tensor.detach().to("cpu").contiguous() for name, tensor in merged_state_dict(model).items()}


class SharedWeightsFile:
    """`<directory>/model.safetensors`, kept mapped and rewritten in place while the model's layout stays the same.
    `directories`: where it may live, best first; a new file goes to the first whose filesystem has room for it
    (writing through a map into a full tmpfs would kill the process with SIGBUS, not raise)."""

    def __init__(self, directories: os.PathLike | tuple[os.PathLike, ...]):
        self.candidates = tuple(Path(d) for d in (directories if isinstance(directories, tuple) else (directories,)))
        self.directory = self.candidates[0]
        self._map: mmap.mmap | None = None
        self._slots: dict[str, tuple[str, tuple[int, ...], int, int]] = {}  # name -> (dtype, shape, begin, end)

    @property
    def path(self) -> Path:
        return self.directory / WEIGHTS_FILE

    def write(self, model) -> str:
        """Write the model's weights; returns "in place" or "new file" (what it took)."""
        tensors = state_tensors(model)
        if self._map is not None and self._fits(tensors):
            for name, tensor in tensors.items():
                _, _, begin, end = self._slots[name]
                self._map[begin:end] = _bytes_of(tensor)
            return "in place"
        self._new_file(tensors)
        return "new file"

    def _fits(self, tensors: dict[str, torch.Tensor]) -> bool:
        return tensors.keys() == self._slots.keys() and all(
            (_dtype_name(tensor), tuple(tensor.shape)) == self._slots[name][:2] for name, tensor in tensors.items())

    def _new_file(self, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        self.close()
        size = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        self.directory = directory_with_room(self.candidates, size, "weights file")
        staging = self.directory / f".{WEIGHTS_FILE}.{os.getpid()}.tmp"
        # safetensors refuses tensors that share storage: a tied lm_head is written as its own copy.
        seen: set[int] = set()
        unshared = {}
        for name, tensor in tensors.items():
            pointer = tensor.untyped_storage().data_ptr()
            unshared[name] = tensor.clone() if pointer in seen else tensor
            seen.add(pointer)
        save_file(unshared, str(staging))
        os.replace(staging, self.path)
        with open(self.path, "r+b") as handle:
            self._map = mmap.mmap(handle.fileno(), 0)
        (header_length,) = struct.unpack("<Q", self._map[:8])
        header = json.loads(self._map[8:8 + header_length])
        base = 8 + header_length
        self._slots = {name: (entry["dtype"], tuple(entry["shape"]), base + entry["data_offsets"][0],
                              base + entry["data_offsets"][1])
                       for name, entry in header.items() if name != "__metadata__"}

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        self._slots = {}

    def remove(self) -> None:
        self.close()
        for directory in self.candidates:
            shutil.rmtree(directory, ignore_errors=True)


def _dtype_name(tensor: torch.Tensor) -> str:
    return SAFETENSORS_DTYPES.get(tensor.dtype, str(tensor.dtype))


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy (a contiguous CPU tensor viewed as bytes)."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


class AdapterDirectory:
    """A LoRA policy's weights for the engine: a PEFT adapter directory (adapter_config.json and
    adapter_model.safetensors, adapters.py) rewritten each step, which vLLM loads in place under one adapter name
    (policy_server.py). The adapter is ~19 MB where SmolLM2 is 538 MB, so a fresh file each time costs little;
    it is staged and renamed, so a reader never sees half of one. `directories`: as SharedWeightsFile's."""

    def __init__(self, directories: os.PathLike | tuple[os.PathLike, ...], base_model: str):
        self.candidates = tuple(Path(d) for d in (directories if isinstance(directories, tuple) else (directories,)))
        self.base_model = base_model
        self.directory = self.candidates[0] / "adapter"

    def write(self, model) -> str:
        from safetensors.torch import save_file

        tensors = adapter_weights(model)
        size = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        self.directory = directory_with_room(self.candidates, size, "adapter") / "adapter"
        self.directory.mkdir(parents=True, exist_ok=True)
        staging = self.directory / f".adapter_model.{os.getpid()}.tmp"
        save_file(tensors, str(staging), {"format": "pt"})
        os.replace(staging, self.directory / "adapter_model.safetensors")
        config = self.directory / f".adapter_config.{os.getpid()}.tmp"
        config.write_text(json.dumps(adapter_config(model, self.base_model), sort_keys=True))
        os.replace(config, self.directory / "adapter_config.json")
        return "adapter"

    def remove(self) -> None:
        for directory in self.candidates:
            shutil.rmtree(directory, ignore_errors=True)


def directory_with_room(candidates: tuple[Path, ...], size: int, what: str) -> Path:
    """The first candidate directory whose filesystem has room for `size` bytes and a margin, created (writing
    through a map into a full tmpfs would kill the process with SIGBUS, not raise)."""
    for directory in candidates:
        directory.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(directory).free > size * 1.1 + (64 << 20):
            return directory
    raise OSError(f"no room for the policy's {size / 2**20:.0f} MB {what} in any of {', '.join(map(str, candidates))}")
