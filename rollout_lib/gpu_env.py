"""Which GPUs a started process sees, as its environment says it. Torch-free: a node agent's part process
(trainer/node_parts.py) sets it for the torchrun it starts without importing torch itself."""

from __future__ import annotations


def visible_devices(gpus: list[int] | None) -> dict[str, str]:
    """The environment that shows a process only `gpus` (None or empty: nothing set, every GPU as before)."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(gpu) for gpu in gpus)} if gpus else {}
