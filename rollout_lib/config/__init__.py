"""Validated, hashed settings per entry point."""

from rollout_lib.config.errors import ConfigError
from rollout_lib.config.loading import apply_overrides, load_config, settings_hash, training_hash, validate_config
from rollout_lib.config.rm import RmConfig

__all__ = ["ConfigError", "RmConfig", "apply_overrides", "load_config", "settings_hash", "training_hash", "validate_config"]
