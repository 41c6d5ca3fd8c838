"""Runs inside a vLLM policy server, not in rollout: part of its worker extension (worker_extension.py, which engine.py
gives every live-policy server), it copies a policy state's files from the run's store to a directory on the
server's own machine, so a server on another node, which shares nothing with the trainer but the store, can reload
them as a local server does (`reload_policy_weights`, `/v1/load_lora_adapter`).

    POST /collective_rpc {"method": "fetch_from_store", "args": ["<store URL of a directory>"]}
        -> {"results": ["<local directory>"]}

The store is read with fsspec and the server's own credentials (its environment, as a Dask worker's), never with
secrets sent over HTTP. Only the standard library and fsspec: vLLM's environment has no rollout.
"""

from __future__ import annotations

import os
import tempfile

# The files a state directory may hold: a full model's weights, or a LoRA adapter. Nothing else is copied.
STATE_FILES = ("model.safetensors", "adapter_model.safetensors", "adapter_config.json")


def fetch(source: str, target: str) -> str:
    """Copy the state files under the fsspec URL `source` into `target` (each replaced whole: written beside,
    then renamed); return `target`. FileNotFoundError when `source` holds none of them."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(source)
    found = [name for name in STATE_FILES if fs.exists(f"{root.rstrip('/')}/{name}")]
    if not found:
        raise FileNotFoundError(f"no policy state at {source} (none of {', '.join(STATE_FILES)}) as this server "
                                "reads the store")
    os.makedirs(target, exist_ok=True)
    for name in STATE_FILES:
        if name not in found:
            try:
                os.unlink(os.path.join(target, name))  # a file of another kind of state must not be reloaded
            except FileNotFoundError:
                pass
            continue
        partial = os.path.join(target, f".{name}.partial")
        fs.get_file(f"{root.rstrip('/')}/{name}", partial)
        os.replace(partial, os.path.join(target, name))
    return target


def fetch_directory(pid: int) -> str:
    """Where the server process `pid` keeps what it fetched: in shared memory where there is one. A model's size:
    engine.py removes it when it stops the server (vLLM's shutdown runs no exit handlers)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"rollout-policy-fetch-{pid}")
