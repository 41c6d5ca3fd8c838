"""Multi-turn environments: the Interaction interface (base.py), the episode driver (episodes.py), the rendering of
env replies (render.py), and the interactions, one module each. Importing this package registers every module in
it, so the config's `interaction` union is built from the registry."""

import importlib
import pkgutil
from collections.abc import Sequence

from rollout_lib.envs.base import INTERACTIONS, EnvReply, Interaction, InteractionSettings

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in ("base", "episodes", "render", "agent_episodes", "agent_server", "agent_tokens",
                            "verifiers_client", "verifiers_data", "verifiers_rubric"):
        importlib.import_module(f"{__name__}.{_module.name}")


def interaction_settings_types() -> tuple[type[InteractionSettings], ...]:
    """The settings class of every registered interaction, in type-name order (for the config's union)."""
    return tuple(INTERACTIONS[name].settings_class for name in sorted(INTERACTIONS))


def build_interaction(settings: InteractionSettings, tools: Sequence = ()) -> Interaction:
    """The interaction of an env, given the env's `tools` settings (envs.tools.ToolSettings; imported here, where
    the episodes run, never at plan time)."""
    from rollout_lib.envs.tools import build_toolbox

    return INTERACTIONS[settings.type](settings, build_toolbox(tools) if tools else None)


__all__ = ["INTERACTIONS", "EnvReply", "Interaction", "InteractionSettings", "build_interaction",
           "interaction_settings_types"]
