"""Load settings from TOML with `--set key.path=value` overrides; hash them stably for cache keys."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import blake3
from pydantic import BaseModel, ValidationError

from rollout_lib.config.errors import ConfigError, from_validation_error
from rollout_lib.store import canonical_json

ConfigT = TypeVar("ConfigT", bound=BaseModel)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value); the value is read as a TOML value, else kept as a string."""
    if "=" not in text:
        raise ConfigError([(text, "override must look like key.path=value")])
    key, raw = text.split("=", 1)
    path = [part for part in key.strip().split(".")]
    if not all(path):
        raise ConfigError([(key, "override key must be a dotted path like algorithm.rm.optimizer.lr")])
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare words (model ids, paths) need no quotes on the command line
    return path, value


def apply_overrides(raw: dict, overrides: list[str] | dict[str, Any] | None) -> dict:
    """Return a copy of `raw` with overrides applied; the schema (extra="forbid") then rejects unknown keys."""
    data = copy.deepcopy(raw)
    items = overrides.items() if isinstance(overrides, dict) else [parse_override(o) for o in overrides or []]
    for path, value in items:
        path = path.split(".") if isinstance(path, str) else path
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError([(".".join(path[: i + 1]), "is a value, not a table; cannot override inside it")])
            node = child
        node[path[-1]] = value
    return data


def read_toml(path: str | Path) -> dict:
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError([("<file>", f"config file not found: {path}")]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([("<toml>", str(exc))], source=str(path)) from None


def validate_config(cls: type[ConfigT], raw: dict, source: str | None = None) -> ConfigT:
    try:
        config = cls.model_validate(raw)
    except ValidationError as exc:
        raise from_validation_error(exc, source) from None
    problems = config.plan_problems() if hasattr(config, "plan_problems") else []
    if problems:
        raise ConfigError(problems, source)
    return config


def load_config(cls: type[ConfigT], path: str | Path, overrides: list[str] | dict | None = None) -> ConfigT:
    return validate_config(cls, apply_overrides(read_toml(path), overrides), source=str(path))


def settings_hash(config: BaseModel) -> str:
    """Stable across processes and key order: blake3 of the canonical JSON of the validated settings."""
    return blake3.blake3(canonical_json(config.model_dump(mode="json"))).hexdigest()


def training_hash(config: BaseModel) -> str:
    """Hash of what decides the trained weights (algorithm settings and seed), not where they are stored:
    checkpoints carry it, so the same training in two stores produces the same checkpoint ids."""
    dumped = config.model_dump(mode="json")
    run = dumped.get("run", {})
    return blake3.blake3(canonical_json({"algorithm": dumped["algorithm"], "seed": run.get("seed")})).hexdigest()
