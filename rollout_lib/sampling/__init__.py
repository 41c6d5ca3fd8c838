"""Rollout generation: the Sampler interface (base.py) and its backends, one module each (hf.py: embedded
transformers generate on the live policy; vllm.py: the live policy on a vLLM policy server, weights reloaded per
state; frozen.py: a frozen model's pool, built per env, not a registered backend). Importing this package registers
every backend module in it."""

import importlib
import pkgutil

from rollout_lib.sampling.base import SAMPLERS, Sampler, SamplerSettings, SamplingContext, SamplingParams

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")


def sampler_settings_types() -> tuple[type[SamplerSettings], ...]:
    """The settings class of every registered sampler, in type-name order (for the config's union)."""
    return tuple(SAMPLERS[name].settings_class for name in sorted(SAMPLERS))


__all__ = ["SAMPLERS", "Sampler", "SamplerSettings", "SamplingContext", "SamplingParams",
           "sampler_settings_types"]
