"""Run-name claims: a run name belongs to one training identity. `refs/runs/<name>/identity` points at a record of
the identity that claimed the name and the settings it hashes, and a run of other settings under the same name is
refused, naming the settings that differ, rather than allowed to move `refs/runs/<name>/latest` to a checkpoint of
something else."""

from __future__ import annotations

import json
from typing import Any

from rollout_lib.identity.training import (reward_model_contents, run_store, served_model_contents, training_identity,
                                           training_settings)
from rollout_lib.model.loading import model_content_digest
from rollout_lib.store import ObjectStore, StoreError

RUN_CLAIM_KIND = "rollout.run-claim/v1"


def claim_run_name(config, identity: str | None = None) -> str:
    """Claim `run.name` in the run's store for this training (claim_run), recording what the identity hashes
    (`claimed_settings`) so that a refused claim names the settings that differ; returns the identity."""
    identity = identity or training_identity(config)
    claim_run(run_store(config), config.run.name, identity, claimed_settings(config))
    return identity


def claimed_settings(config) -> dict:
    """What `training_identity` hashes, flat and keyed as a user writes it (`algorithm.rm.optimizer.lr`,
    `run.seed`), with each model's content as `<its locator> (files)`: one JSON value per key, so two claims
    compare key by key."""
    block = f"algorithm.{config.algorithm.kind}"
    trained = training_settings(config)
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


def claim_run(store: ObjectStore, name: str, identity: str, settings: dict[str, Any] | None = None) -> None:
    """Claim run name ``name`` for the training identity ``identity`` (a hash of the settings that decide the
    run's checkpoints), or check that it already belongs to it. A flow calls this before it trains, so that a
    run of other settings never moves ``runs/<name>/latest``. ``settings``: what the identity hashes, flat
    (``{"algorithm.rm.optimizer.lr": 1e-05, ...}``), recorded so that a refused claim names what differs. The
    first claim of a name wins; on a local disk two simultaneous first claims cannot both win, on a remote
    store (no exclusive create) they can."""
    if not isinstance(identity, str) or not identity:
        raise StoreError(f"invalid run identity {identity!r}: expected a non-empty string")
    ref = f"runs/{name}/identity"
    held = store.get_ref(ref)  # a name that is no ref name fails here, before anything is stored
    record = {"kind": RUN_CLAIM_KIND, "run": name, "identity": identity}
    claim = store.put_json({**record, "settings": settings} if settings is not None else record)
    if held is None:
        if store.create_ref(ref, claim):
            return
        held = store.get_ref(ref)  # another run claimed the name first
    if held == claim:
        return
    held_record = _claim_record(store, held)
    if held_record.get("identity") == identity:
        return  # the same training, claimed with other (or no) recorded settings: an older claim
    raise StoreError(f"run name {name!r} in {store.root} already holds a run of other settings: "
                     f"{_claim_differences(held_record, identity, settings)}; rerun with --name <another name> "
                     "(a deployment: the override run.name=<another name>)")


def _claim_record(store: ObjectStore, claim_id: str) -> dict:
    try:
        record = store.get_json(claim_id)
    except (StoreError, ValueError):
        record = None
    return record if isinstance(record, dict) else {"identity": f"unreadable, claim record {claim_id}"}


_CLAIM_DIFFERENCES_SHOWN = 3


def _claim_differences(held: dict, identity: str, settings: dict | None) -> str:
    """What differs between a run name's claim and this run's settings: a few key paths with both values, or, for a
    claim that recorded no settings, both identities."""
    held_settings = held.get("settings")
    if not isinstance(held_settings, dict) or settings is None:
        return (f"training identity {held.get('identity')} (stored run) vs {identity} (this run); the stored claim "
                "records no settings to compare")
    differing = sorted(key for key in held_settings.keys() | settings.keys()
                       if held_settings.get(key, _UNSET) != settings.get(key, _UNSET))
    if not differing:
        return (f"training identity {held.get('identity')} (stored run) vs {identity} (this run), from the same "
                "recorded settings (another version of rollout hashed them)")
    shown = [f"{key}: {_shown(held_settings.get(key, _UNSET))} (stored run) vs {_shown(settings.get(key, _UNSET))} "
             "(this run)" for key in differing[:_CLAIM_DIFFERENCES_SHOWN]]
    more = len(differing) - len(shown)
    return ", ".join(shown) + (f", and {more} more" if more else "")


_UNSET = object()


def _shown(value: Any) -> str:
    if value is _UNSET:
        return "unset"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."
