"""The default rl loss: DPPO-Binary-TV trust-region mask + k2 KL (prime-rl's "DPPO+KL"), losses.rl_loss_terms.

    r_t = π(y_t)/π_inf(y_t);  keep_t = not (A_t > 0 and p_t - p_inf_t > eps_high) and not (A_t <= 0 and p_t - p_inf_t
    < -eps_low);  loss_t = -keep_t · r_t · A_t + kl_coef · ½ log² r_t

The math and why this variant: the `rollout_lib/losses.py` docstring. Token-level: each rl token counts once, so over
N_rl (normalizer = "tokens") the step loss is the mean over the step's rl tokens. `type = "default"` is left out of
the settings' dump, so a run that names it is the run that names no loss.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from torch import Tensor

from rollout_lib.losses import DEFAULT_EPS_HIGH, DEFAULT_EPS_LOW, DEFAULT_KL_COEF, rl_loss_terms
from rollout_lib.rl_losses.base import EpsSettings, RlLoss


class DefaultLossSettings(EpsSettings):
    type: Literal["default"] = Field("default", exclude_if=lambda value: value == "default")
    eps_low: float = Field(DEFAULT_EPS_LOW, gt=0, le=1)  # probability-space trust region, A <= 0 side
    eps_high: float = Field(DEFAULT_EPS_HIGH, gt=0, le=1)  # A > 0 side
    kl_coef: float = Field(DEFAULT_KL_COEF, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _custom_keys_need_custom(cls, value):
        # Only the default's own: the custom loss's settings (config/rl.py) extend these with exactly those keys.
        named_default = isinstance(value, dict) and value.get("type", "default") == "default"
        if named_default and ("import_path" in value or "kwargs" in value):
            raise ValueError('import_path and kwargs are for type = "custom"')
        return value


class DppoKl(RlLoss):
    type_name = "default"
    settings_class = DefaultLossSettings

    def terms(self, logprobs: Tensor, inference_logprobs: Tensor, advantages: Tensor, weights: Tensor, *,
              sequence_ids: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        settings = self.settings
        return rl_loss_terms(logprobs, inference_logprobs, advantages, weights, eps_low=settings.eps_low,
                             eps_high=settings.eps_high, kl_coef=settings.kl_coef, max_ratio=settings.max_ratio)
