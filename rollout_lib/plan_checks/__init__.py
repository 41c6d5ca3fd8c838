"""The checks that refuse a config before anything runs (checks.py), and the loaders that run them after the schema
(rollout_lib/config only validates each setting): a problem is a ConfigError naming each setting, a warning is said
once, as a UserWarning."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TypeVar

from rollout_lib.config.loading import load_settings, validate_settings
from rollout_lib.errors import ConfigError
from rollout_lib.plan_checks.checks import plan_problems, plan_warnings

__all__ = ["checked", "load_config", "plan_problems", "plan_warnings", "validate_config"]

ConfigT = TypeVar("ConfigT")


def checked(config: ConfigT, source: str | None = None) -> ConfigT:
    """`config` itself when its plan checks pass (each warning said); else a ConfigError with every problem."""
    problems = plan_problems(config)
    if problems:
        raise ConfigError(problems, source)
    for locator, message in plan_warnings(config):
        warnings.warn(f"{locator}: {message}", UserWarning, stacklevel=2)
    return config


def validate_config(cls: type[ConfigT], raw: dict, source: str | None = None,
                    base_dir: str | Path | None = None) -> ConfigT:
    """Settings validated and checked; relative paths in them resolve from `base_dir` (default: the working
    directory)."""
    return checked(validate_settings(cls, raw, source, base_dir), source)


def load_config(cls: type[ConfigT], path: str | Path, overrides: list[str] | dict | None = None) -> ConfigT:
    """A config file's settings with `overrides` applied, validated and checked; relative paths in both resolve
    from the file's project root (paths.config_base_dir), whatever the working directory."""
    return checked(load_settings(cls, path, overrides), str(path))
