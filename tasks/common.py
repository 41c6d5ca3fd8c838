"""What every task shares: the store, and cache keys built from content ids.

A task's cache key is blake3(task name, code version, settings hash, content ids of its inputs), never the
flow run id, so rerunning a flow (CLI rerun, Retry in the UI) returns completed work from cache.

Some task parameters are not inputs but resources the flow owns for the run (the resident trainer, the reward
loops): they never enter a key (RESOURCE_PARAMETERS).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import blake3

from rollout_lib.config.loading import settings_hash
from rollout_lib.store import ObjectStore, canonical_json
from rollout_lib.code_version import code_version

# Task results are small JSON (ids and numbers): they persist, and come back `Cached` on a rerun.
TASK_OPTIONS = dict(persist_result=True, result_serializer="json", retries=0)

# Objects a flow creates, hands to its tasks and closes: they change how fast a task runs, never its result.
RESOURCE_PARAMETERS = frozenset({"resident", "reward_loops"})


def open_store(config) -> ObjectStore:
    return ObjectStore(config.run.store, config.run.storage_options or None)


def content_key(*, ignore: tuple[str, ...] = (), extra: Callable[[dict], dict] | None = None):
    """A Prefect `cache_key_fn` over the task's parameters: the `config` parameter enters as its settings hash,
    parameters in `ignore` (deterministic consequences of the others, such as step metrics) are left out."""

    def key_fn(context, parameters: dict[str, Any]) -> str:
        inputs = {}
        for name, value in parameters.items():
            if name in ignore or name in RESOURCE_PARAMETERS:
                continue
            inputs[name] = settings_hash(value) if name == "config" else value
        if extra is not None:
            inputs.update(extra(parameters))
        material = {"task": context.task.name, "code": code_version(context.task.fn.__module__),
                    "inputs": inputs}
        return blake3.blake3(canonical_json(material)).hexdigest()

    return key_fn


def dataset_path(config, split: str) -> str:
    """The JSONL file of a split ("train" or "eval") of an entry point with `dataset` and `eval_dataset`."""
    dataset = config.settings.dataset if split == "train" else config.settings.eval_dataset
    return dataset.path


def file_digest(path: str | Path) -> str:
    try:
        return blake3.blake3(Path(path).read_bytes()).hexdigest()
    except FileNotFoundError:
        return "missing"  # the task itself reports the missing file with its path


def module_digest(module: str) -> str:
    """The blake3 of a module's source file, found without running it (its parent packages are imported, as
    find_spec does); "missing" when it cannot be found."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        return "missing"  # the task itself reports the unimportable module
    return file_digest(spec.origin)
