"""Validated settings per entry point (checked against the plan: rollout_lib/plan_checks; hashed:
rollout_lib/identity)."""

from rollout_lib.errors import ConfigError
from rollout_lib.config.loading import apply_overrides, load_settings, validate_settings
from rollout_lib.config.rl import RlConfig
from rollout_lib.config.rlhf import RlhfConfig
from rollout_lib.config.rm import RmConfig
from rollout_lib.config.sft import SftConfig

__all__ = ["ConfigError", "RlConfig", "RlhfConfig", "RmConfig", "SftConfig", "apply_overrides", "load_settings",
           "validate_settings"]
