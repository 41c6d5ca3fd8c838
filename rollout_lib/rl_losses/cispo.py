"""CISPO: clipped importance-sampling policy optimisation (MiniMax-M1, Chen et al. 2025).

    r_t = π(y_t)/π_inf(y_t);  ŵ_t = sg( clip(r_t, 1 - eps_low, 1 + eps_high) )
    loss_t = -ŵ_t · A_t · log π(y_t)  +  kl_coef · ½ log² r_t

Why: PPO's clip (and the default loss's trust-region mask) drops a token whose ratio left the trust region: its
gradient is zero. The tokens dropped that way are often the rare, decisive ones (a "however" that forks the
reasoning), which then never learn. CISPO clips the importance *weight* instead and stops its gradient: every token
keeps the REINFORCE gradient -A_t · ∇log π(y_t), scaled by at most 1 + eps_high, so none is dropped and none is
over-weighted. eps_low: None (the default) puts no lower bound on the weight, as MiniMax-M1 tuned only the upper
one; the defaults follow that (eps_high = 0.28). The value of loss_t is not an objective to read (it is -A · log π
scaled); its gradient is: on-policy (r = 1) it is plain REINFORCE.
Normalisation: token-level, as the default loss (docs/algorithms.md, "The rl loss menu").
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from rollout_lib.losses import capped
from rollout_lib.rl_losses.base import EpsSettings, RlLoss, mean_over

CISPO_EPS_HIGH = 0.28


class CispoSettings(EpsSettings):
    type: Literal["cispo"]
    eps_low: float | None = Field(None, gt=0, lt=1, exclude_if=lambda value: value is None)  # None: no lower bound
    eps_high: float = Field(CISPO_EPS_HIGH, gt=0)
    kl_coef: float = Field(0.0, ge=0)


class Cispo(RlLoss):
    type_name = "cispo"
    settings_class = CispoSettings

    def terms(self, logprobs: Tensor, inference_logprobs: Tensor, advantages: Tensor, weights: Tensor, *,
              sequence_ids: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        settings = self.settings
        member = weights != 0
        log_ratio = logprobs - inference_logprobs
        with torch.no_grad():  # the weight scales the gradient, it is never a path for it
            ratio = torch.exp(log_ratio)
            low = None if settings.eps_low is None else 1 - settings.eps_low
            weight = capped(ratio, settings.max_ratio).clamp(min=low, max=1 + settings.eps_high)
        numerator = (weights * (-weight * advantages * logprobs + settings.kl_coef * 0.5 * log_ratio.square())).sum()

        with torch.no_grad():
            metrics = {
                "tokens": int(member.sum()),
                # Tokens whose weight the clip changed (they still train, at the clipped weight).
                "clipped_fraction": mean_over((weight != ratio).float(), member),
                "ratio_mean": mean_over(ratio, member),
                "mismatch_kl": mean_over(ratio - 1 - log_ratio, member),
            }
        return numerator, metrics
