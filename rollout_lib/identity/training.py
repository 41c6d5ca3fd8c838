"""A training chain's identity: what decides the weights at every step, and nothing else.

Checkpoint manifests carry it and every training task's cache key is built from it, so two runs that would train
the same weights share checkpoints and cache entries (extending a run, adding an eval set, changing the snapshot
interval or the store's credentials reuses every finished step), and anything that would change the weights
(a setting, the seed, the thread count, the base model's files) starts a new chain.

The settings part is projected out of a config here (`training_settings`): every entry point's block but for what
never decides the weights (NOT_TRAINING); RL's further keeps a frozen model as what identifies its content, a file
as its content digest, and drops what only decides how fast, or whether, a run goes on (identity/rl_training.py).
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path

import blake3

from rollout_lib.checkpoint import checkpoint_named
from rollout_lib.errors import ConfigError
from rollout_lib.hardware import hardware_settings, resolve_hardware
from rollout_lib.identity.digests import file_digest
from rollout_lib.model.loading import ModelLoadError, model_content_digest
from rollout_lib.store import ObjectStore, StoreError, canonical_json


# Settings of the entry point that never decide the trained weights: where and how often to snapshot, what to
# evaluate on, the budget (the schedule's horizon enters on its own), and the dataset's location (its content
# enters cache keys as a content id).
NOT_TRAINING = frozenset({"checkpoint_interval", "budget", "eval_dataset", "eval_batch_size", "dataset"})
# RL's collapse guard watches the steps and may stop the run; it never decides what a step trains.
NOT_TRAINING_BY_KIND = {"rl": NOT_TRAINING | {"collapse"}}
# A kind's own projection of its settings, named rather than imported: an SFT or RM task's code version (its static
# import closure, identity/code.py) then holds no RL module, and editing RL code never invalidates their results.
KIND_PROJECTIONS = {"rl": "rollout_lib.identity.rl_training:rl_training_settings"}


def training_hash(config) -> str:
    """Hash of the settings that decide the trained weights (`training_settings`): not where they are stored, not
    how often they are snapshotted or evaluated, no credentials. (identity.training adds the base model's
    content.)"""
    return blake3.blake3(canonical_json(training_settings(config))).hexdigest()


def training_settings(config) -> dict:
    """The settings that decide the trained weights, as JSON: everything of the entry point's block but
    NOT_TRAINING, the learning-rate schedule's horizon, the seed and the thread count. `run.name`, `run.store` and
    `run.storage_options` (credentials) never enter it."""
    settings = config.settings
    # `hardware` enters resolved, never as spelt: "auto" and the device it resolves to are one training, and
    # gradient checkpointing is none at all.
    not_training = NOT_TRAINING_BY_KIND.get(config.algorithm.kind, NOT_TRAINING)
    block = settings.model_dump(mode="json",
                                exclude=(set(not_training) | {"hardware"}) & set(type(settings).model_fields))
    trained = {**block, "schedule_horizon": settings.optimizer.schedule_horizon(settings.budget.max_steps),
               "seed": config.run.seed, "torch_threads": config.run.torch_threads}
    resolved = resolve_hardware(hardware_settings(settings), config.hardware_locator)
    hardware = hardware_settings(settings).identity_settings(resolved.device.type)
    if hardware is not None:  # absent for fp32 on CPU: identities of CPU runs are what they always were
        trained["hardware"] = hardware
    if getattr(settings, "chat_template", None) is not None:  # its content, not where this checkout keeps it
        trained["chat_template"] = file_digest(settings.chat_template)
    projection = KIND_PROJECTIONS.get(config.algorithm.kind)
    if projection is None:
        return trained
    module, _, function = projection.partition(":")
    return getattr(importlib.import_module(module), function)(config, trained)


def training_identity(config) -> str:
    """blake3 of (the settings that decide the weights, the base model's content digest, the content of every
    frozen model rollout serves from a reference: a teacher's weights decide the student's as much as a
    setting does, and of every reward model an env scores with: retraining it, moving `runs/<rm>/latest`, changes
    every reward)."""
    return _identity(training_hash(config), config.settings.base_model, tuple(served_model_contents(config).values()),
                     reward_model_contents(config))


def content_identity(ref, store: ObjectStore | None) -> str:
    """What a served model's weights are: `checkpoint:<id>` for a checkpoint of the store, else the model's
    content digest (a local directory of a ref's spelling is that directory, as everywhere)."""
    checkpoint_id = None if Path(ref.uri).expanduser().is_dir() else checkpoint_named(store, ref.uri)
    return f"checkpoint:{checkpoint_id}" if checkpoint_id else model_content_digest(ref)


def reward_model_contents(config) -> tuple[str, ...]:
    """The content digest of each reward model of an RL config, in config order (a checkpoint: its id). A reference
    that resolves nowhere (`runs/<rm>/latest` not trained yet) is a ConfigError naming its setting."""
    contents = []
    for where, reward in getattr(config, "reward_models", list)():
        try:
            contents.append(model_content_digest(reward.reward_model))
        except (ModelLoadError, StoreError) as exc:
            raise ConfigError([(where, str(exc))]) from None
    return tuple(contents)


def served_model_contents(config) -> dict[str, str]:
    """The content identity of each frozen model rollout serves from a reference, by its setting's locator, in config
    order (a model you serve yourself, given by URL, has none: it is named, not hashed). A reference that resolves
    nowhere (a teacher's `runs/<name>/latest` not trained yet) is a ConfigError naming the setting."""
    served = [(where, settings) for where, settings in getattr(config, "frozen_models", list)()
              if hasattr(settings, "model")]
    if not served:
        return {}
    store = run_store(config)
    identities = {}
    for where, settings in served:
        try:
            identities[where] = content_identity(settings.model, store)
        except ModelLoadError as exc:
            # A teacher's checkpoint not trained yet (runs/<name>/latest missing from the store) fails here, the
            # first thing a run does: name the setting and where the ref was looked for.
            uri = settings.model.uri
            if "/" in uri and not uri.startswith((".", "/", "~")):
                message = f"no checkpoint ref {uri!r} in {store.root}, and no local directory of that name"
            else:
                message = str(exc)
            raise ConfigError([(f"{where}.model", message)]) from None
    return identities


def run_store(config) -> ObjectStore:
    return ObjectStore(config.run.store, config.run.storage_options or None)


@functools.lru_cache(maxsize=16)
def _identity(settings_hash: str, base_model, served_models: tuple[str, ...], reward_models: tuple[str, ...]) -> str:
    # Cached per process: hashing a model's files (once per file version, see model.loading) is not free.
    material = {"settings": settings_hash, "base_model": model_content_digest(base_model)}
    if served_models:  # absent otherwise, so identities of runs without frozen models are unchanged
        material["served_models"] = list(served_models)
    if reward_models:  # likewise
        material["reward_models"] = list(reward_models)
    return blake3.blake3(canonical_json(material)).hexdigest()
