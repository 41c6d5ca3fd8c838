"""A training chain's identity: what decides the weights at every step, and nothing else.

Checkpoint manifests carry it and every training task's cache key is built from it, so two runs that would train
the same weights share checkpoints and cache entries (extending a run, adding an eval set, changing the snapshot
interval or the store's credentials reuses every finished step), and anything that would change the weights
(a setting, the seed, the thread count, the base model's files) starts a new chain.
"""

from __future__ import annotations

import functools
from pathlib import Path

import blake3

from rollout_lib.checkpoint import checkpoint_named
from rollout_lib.config.loading import training_hash
from rollout_lib.errors import ConfigError
from rollout_lib.model.loading import ModelLoadError, model_content_digest
from rollout_lib.serving.settings import ExternalModel
from rollout_lib.store import ObjectStore, StoreError, canonical_json


def training_identity(config) -> str:
    """blake3 of (the settings that decide the weights, the base model's content digest, the content of every
    frozen model rollout serves from a reference: a teacher's weights decide the student's as much as a
    setting does, and of every reward model an env scores with: retraining it, moving `runs/<rm>/latest`, changes
    every reward)."""
    return _identity(training_hash(config), config.settings.base_model, tuple(served_model_contents(config).values()),
                     reward_model_contents(config))


def claim_run_name(config, identity: str | None = None) -> str:
    """Claim `run.name` in the run's store for this training (store.claim_run), recording what the identity hashes
    (`claimed_settings`) so that a refused claim names the settings that differ; returns the identity."""
    identity = identity or training_identity(config)
    _store(config).claim_run(config.run.name, identity, claimed_settings(config))
    return identity


def claimed_settings(config) -> dict:
    """What `training_identity` hashes, flat and keyed as a user writes it (`algorithm.rm.optimizer.lr`,
    `run.seed`), with each model's content as `<its locator> (files)`: one JSON value per key, so two claims
    compare key by key."""
    block = f"algorithm.{config.algorithm.kind}"
    trained = config.training_settings()
    flat = {f"run.{key}": trained.pop(key) for key in ("seed", "torch_threads")}
    horizon = trained.pop("schedule_horizon")
    if horizon is not None and not config.settings.optimizer.decay_steps:  # the horizon is max_steps itself
        flat[f"{block}.budget.max_steps"] = horizon
    _flatten(trained, block, flat)
    flat[f"{block}.base_model (files)"] = model_content_digest(config.settings.base_model)
    flat.update((f"{where}.model (files)", content) for where, content in served_model_contents(config).items())
    reward_models = getattr(config, "reward_models", list)()
    flat.update((f"{where} (files)", content)
                for (where, _), content in zip(reward_models, reward_model_contents(config)))
    return flat


def _flatten(value, key: str, into: dict) -> dict:
    """`{"a": {"b": [1]}}` under `x` -> `{"x.a.b[0]": 1}` (an empty dict or list stays one value)."""
    if isinstance(value, dict) and value:
        for name, item in value.items():
            _flatten(item, f"{key}.{name}", into)
    elif isinstance(value, list) and value:
        for index, item in enumerate(value):
            _flatten(item, f"{key}[{index}]", into)
    else:
        into[key] = value
    return into


def content_identity(ref, store: ObjectStore | None) -> str:
    """What a served model's weights are: `checkpoint:<id>` for a checkpoint of the store, else the model's
    content digest (a local directory of a ref's spelling is that directory, as everywhere)."""
    checkpoint_id = None if Path(ref.uri).expanduser().is_dir() else checkpoint_named(store, ref.uri)
    return f"checkpoint:{checkpoint_id}" if checkpoint_id else model_content_digest(ref)


def frozen_identity(config, frozen) -> str:
    """`sampled_from` of a frozen model's rollouts: what identifies its weights (as in the training identity), never
    where it runs: `frozen:served:<name>` for a server you run, `frozen:checkpoint:<id>` or `frozen:<content
    digest>` for one rollout serves."""
    if isinstance(frozen, ExternalModel):
        return f"frozen:served:{frozen.name}"
    return f"frozen:{content_identity(frozen.model, _store(config))}"


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
    store = _store(config)
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


def _store(config) -> ObjectStore:
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
