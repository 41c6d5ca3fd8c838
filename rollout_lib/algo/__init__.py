"""RL algorithms, one module each, registered by their `type` name (see base.py).

Importing this package imports every module in it, so an algorithm module dropped here is registered and
appears in the config's `algo` union without editing anything else; then it loads the algorithms other
distributions declare as entry points (plugins.py), so theirs appear too.
"""

import importlib
import pkgutil

from rollout_lib.algo.base import (ALGORITHMS, Algorithm, AlgorithmResources, AlgoSettings, Group, MissingResourceError,
                                   build_algorithm)
from rollout_lib.algo.plugins import load_algorithm_plugins

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in ("base", "plugins", "stamping"):
        importlib.import_module(f"{__name__}.{_module.name}")
load_algorithm_plugins()


def algo_settings_types() -> tuple[type[AlgoSettings], ...]:
    """The settings class of every registered algorithm, in type-name order (for the config's union)."""
    return tuple(ALGORITHMS[name].settings_class for name in sorted(ALGORITHMS))


__all__ = ["ALGORITHMS", "AlgoSettings", "Algorithm", "AlgorithmResources", "Group", "MissingResourceError",
           "algo_settings_types", "build_algorithm"]
