"""The rl component's losses, one module each, registered by their `type` name (base.py): `default` (DPPO+k2,
losses.rl_loss_terms), `gspo`, `cispo`. Importing this package imports every module in it, so a loss module dropped
here appears in the config's `algorithm.rl.loss` union without editing anything else. (`custom`, a user's function,
is the config's: it is located by import path, config/rl.py.) correction.py is no loss: the mismatch correction
any of them can run under (`algorithm.rl.loss.correction`).
"""

import importlib
import pkgutil

from rollout_lib.rl_losses.base import RL_LOSSES, ConstantNormalizer, LossSettings, RlLoss

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")


def rl_loss_settings_types() -> tuple[type[LossSettings], ...]:
    """The settings class of every registered rl loss, in type-name order (for the config's union)."""
    return tuple(RL_LOSSES[name].settings_class for name in sorted(RL_LOSSES))


def build_rl_loss(settings: LossSettings) -> RlLoss:
    return RL_LOSSES[settings.type](settings)


__all__ = ["RL_LOSSES", "ConstantNormalizer", "LossSettings", "RlLoss", "build_rl_loss", "rl_loss_settings_types"]
