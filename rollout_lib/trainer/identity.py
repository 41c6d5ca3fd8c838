"""A training chain's identity: what decides the weights at every step, and nothing else.

Checkpoint manifests carry it and every training task's cache key is built from it, so two runs that would train
the same weights share checkpoints and cache entries (extending a run, adding an eval set, changing the snapshot
interval or the store's credentials reuses every finished step), and anything that would change the weights
(a setting, the seed, the thread count, the base model's files) starts a new chain.
"""

from __future__ import annotations

import functools

import blake3

from rollout_lib.config.loading import training_hash
from rollout_lib.model.loading import model_content_digest
from rollout_lib.errors import ConfigError
from rollout_lib.store import ObjectStore, StoreError, canonical_json


def training_identity(config) -> str:
    """blake3 of (the settings that decide the weights, the base model's content digest, the content of every
    frozen model rollout serves from a reference: a teacher's weights decide the student's as much as a
    setting does, and of every reward model an env scores with: retraining it, moving `runs/<rm>/latest`, changes
    every reward)."""
    return _identity(training_hash(config), config.settings.base_model, _served_models(config),
                     reward_model_contents(config))


def reward_model_contents(config) -> tuple[str, ...]:
    """The content digest of each reward model of an RL config, in config order (a checkpoint: its id). A reference
    that resolves nowhere (`runs/<rm>/latest` not trained yet) is a ConfigError naming its setting."""
    found = getattr(config, "reward_models", list)()
    if not found:
        return ()
    from rollout_lib.model.loading import ModelLoadError

    contents = []
    for where, reward in found:
        try:
            contents.append(model_content_digest(reward.reward_model))
        except (ModelLoadError, StoreError) as exc:
            raise ConfigError([(where, str(exc))]) from None
    return tuple(contents)


def _served_models(config) -> tuple[str, ...]:
    frozen = [(where, settings) for where, settings in getattr(config, "frozen_models", list)()
              if hasattr(settings, "model")]
    if not frozen:
        return ()
    from rollout_lib.model.loading import ModelLoadError
    from rollout_lib.serving.references import content_identity

    store = ObjectStore(config.run.store, config.run.storage_options or None)
    identities = []
    for where, settings in frozen:
        try:
            identities.append(content_identity(settings.model, store))
        except ModelLoadError as exc:
            # A teacher's checkpoint not trained yet (runs/<name>/latest missing from the store) fails here, the
            # first thing a run does: name the setting and where the ref was looked for.
            uri = settings.model.uri
            if "/" in uri and not uri.startswith((".", "/", "~")):
                message = f"no checkpoint ref {uri!r} in {store.root}, and no local directory of that name"
            else:
                message = str(exc)
            raise ConfigError([(f"{where}.model", message)]) from None
    return tuple(identities)


@functools.lru_cache(maxsize=16)
def _identity(settings_hash: str, base_model, served_models: tuple[str, ...], reward_models: tuple[str, ...]) -> str:
    # Cached per process: hashing a model's files (once per file version, see model.loading) is not free.
    material = {"settings": settings_hash, "base_model": model_content_digest(base_model)}
    if served_models:  # absent otherwise, so identities of runs without frozen models are unchanged
        material["served_models"] = list(served_models)
    if reward_models:  # likewise
        material["reward_models"] = list(reward_models)
    return blake3.blake3(canonical_json(material)).hexdigest()
