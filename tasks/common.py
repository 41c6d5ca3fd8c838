"""What every task shares: the store, and cache keys built from what decides a task's result.

A task's cache key is blake3(task name, code version, the settings it reads, content ids of its inputs), never
the flow run id, so rerunning a flow (CLI rerun, Retry in the UI) returns completed work from cache, and a change
to a setting a task does not read (the run's length, the snapshot interval, an eval set, the store's credentials)
never invalidates it. A training task reads the chain's identity (rollout_lib.identity): every setting that decides
the weights and the base model's content.

Some task parameters are not inputs but resources the flow owns for the run (the resident trainer, the reward
loops, the frozen models' pools): they never enter a key (RESOURCE_PARAMETERS).
"""

from __future__ import annotations

from typing import Any, Callable

import blake3

from rollout_lib.identity.code import code_version
from rollout_lib.store import ObjectStore, canonical_json
from rollout_lib.identity.data_keys import dataset_identity
from rollout_lib.identity.training import training_identity

# Task results are small JSON (ids and numbers): they persist, and come back `Cached` on a rerun.
TASK_OPTIONS = dict(persist_result=True, result_serializer="json", retries=0)

# Objects a flow creates, hands to its tasks and closes: they change how fast a task runs, never its result.
RESOURCE_PARAMETERS = frozenset({"resident", "reward_loops", "served_models", "resources"})


def open_store(config) -> ObjectStore:
    return ObjectStore(config.run.store, config.run.storage_options or None)


def content_key(*, reads: Callable[[Any], Any] = training_identity, ignore: tuple[str, ...] = (),
                extra: Callable[[dict], dict] | None = None):
    """A Prefect `cache_key_fn` over the task's parameters. The `config` parameter enters as `reads(config)`, the
    settings the task reads (default: the training identity); parameters in `ignore` (consequences of the others,
    such as step metrics or a table derived from another input) are left out; `extra(parameters)` adds what the
    parameters only point to (a file's digest)."""

    def key_fn(context, parameters: dict[str, Any]) -> str:
        inputs = {}
        for name, value in parameters.items():
            if name in ignore or name in RESOURCE_PARAMETERS:
                continue
            inputs[name] = reads(value) if name == "config" else value
        if extra is not None:
            inputs.update(extra(parameters))
        material = {"task": context.task.name, "code": code_version(context.task.fn.__module__),
                    "inputs": inputs}
        return blake3.blake3(canonical_json(material)).hexdigest()

    return key_fn


# A data load task's key: what it reads of its split's data (identity.sources.dataset_identity), no setting.
dataset_load_key = content_key(reads=lambda config: None, extra=lambda p: dataset_identity(p["config"], p["split"]))
