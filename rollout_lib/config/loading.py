"""Load settings from TOML with `--set key.path=value` overrides, validated against their schema. (Checked against
the plan as well: rollout_lib/plan_checks; hashed for cache keys: rollout_lib/identity.)"""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from rollout_lib.config.common import BASE_DIR
from rollout_lib.config.keys import closest_key, key_paths
from rollout_lib.errors import FILE, ConfigError, from_validation_error, locator
from rollout_lib.paths import config_base_dir

ConfigT = TypeVar("ConfigT", bound=BaseModel)


# One segment of an override key: a table key, optionally followed by list indices (`envs[0]`, `grid[1][2]`).
_SEGMENT = re.compile(r"([^.\[\]]+)((?:\[\d+\])*)")


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b[0].c=value` -> (["a","b[0]","c"], value); the value is read as a TOML value, else kept as a string.

    Segments keep their `[index]` text, so `".".join(path)` writes the key back as the user typed it."""
    if "=" not in text:
        raise ConfigError([(text, "override must look like key.path=value")])
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(_SEGMENT.fullmatch(part) for part in path):
        raise ConfigError([(key, "override key must be a dotted path like algorithm.rm.optimizer.lr "
                                 "(list items as algorithm.rl.envs[0].sampling.group_size)")])
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare words (model ids, paths) need no quotes on the command line
    return path, value


def _steps(path: list[str]) -> list[str | int]:
    """Key segments to the keys and list indices they walk through: ["envs[0]", "name"] -> ["envs", 0, "name"]."""
    steps: list[str | int] = []
    for part in path:
        match = _SEGMENT.fullmatch(part)
        if match is None:
            raise ConfigError([(".".join(path), f"bad key segment {part!r}; list items are written name[0]")])
        steps.append(match.group(1))
        steps.extend(int(index) for index in re.findall(r"\d+", match.group(2)))
    return steps


def _set_value(data: dict, steps: list[str | int], value: Any) -> None:
    node: Any = data
    for depth, step in enumerate(steps):
        here, parent = locator(tuple(steps[: depth + 1])), locator(tuple(steps[:depth]))
        if isinstance(step, int):
            if not isinstance(node, list):
                raise ConfigError([(parent, "is not a list; [index] can only name a list item")])
            if step >= len(node):
                raise ConfigError([(here, f"index out of range: {parent} has {len(node)} item(s)")])
        elif isinstance(node, list):
            raise ConfigError([(parent, f"is a list; name an item first, e.g. {parent}[0].{step}")])
        elif not isinstance(node, dict):
            raise ConfigError([(parent, "is a value, not a table; cannot override inside it")])
        if depth == len(steps) - 1:
            node[step] = value
        elif isinstance(step, str) and step not in node:
            if isinstance(steps[depth + 1], int):
                raise ConfigError([(here, "is not in the config: [index] can only reach an existing list item")])
            node = node.setdefault(step, {})  # a missing table is created; the schema judges its keys
        else:
            node = node[step]


def apply_overrides(raw: dict, overrides: list[str] | dict[str, Any] | None) -> dict:
    """Return a copy of `raw` with overrides applied; the schema (extra="forbid") then rejects unknown keys.

    Keys reach list items by index (`algorithm.rl.envs[0].sampling.group_size`), the same spelling with `--set`
    and in a deployment's `overrides` (list of "key=value" strings, or a dict keyed by the dotted key)."""
    data = copy.deepcopy(raw)
    items = overrides.items() if isinstance(overrides, dict) else [parse_override(o) for o in overrides or []]
    for path, value in items:
        _set_value(data, _steps(path.split(".") if isinstance(path, str) else list(path)), value)
    return data


def read_toml(path: str | Path) -> dict:
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError([(FILE, "config file not found")], source=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([(FILE, f"not valid TOML: {exc}")], source=str(path)) from None


def validate_settings(cls: type[ConfigT], raw: dict, source: str | None = None,
                      base_dir: str | Path | None = None) -> ConfigT:
    """Validate settings; relative paths in them resolve from `base_dir` (default: the working directory)."""
    try:
        return cls.model_validate(raw, context={BASE_DIR: str(base_dir)} if base_dir is not None else None)
    except ValidationError as exc:
        raise from_validation_error(exc, source, suggest=lambda unknown: closest_key(unknown, key_paths(cls))) from None


def load_settings(cls: type[ConfigT], path: str | Path, overrides: list[str] | dict | None = None) -> ConfigT:
    """A config file's settings with `overrides` applied; relative paths in both resolve from the file's project
    root (paths.config_base_dir), whatever the working directory."""
    return validate_settings(cls, apply_overrides(read_toml(path), overrides), source=str(path),
                             base_dir=config_base_dir(path))

