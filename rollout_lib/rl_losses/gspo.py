"""GSPO: group sequence policy optimisation (Zheng et al. 2025, Qwen), a sequence-level importance ratio.

    s_i = exp( (1/|y_i|) Σ_{t∈y_i} log π(y_t)/π_inf(y_t) )          length-normalised sequence ratio
    loss_t = -min( s_i · A_t, clip(s_i, 1 - eps_low, 1 + eps_high) · A_t )  +  kl_coef · ½ log² r_t   (t ∈ y_i)

Why: a token-level ratio is one noisy sample per token; its variance accumulates over a long sequence and, with
PPO's clip, keeps or drops single tokens of an answer the reward judged as a whole. GSPO importance-weights and
clips the unit the reward scores, the sequence: a sequence whose likelihood moved too far, in the direction its
advantage pushes, gets no gradient at all; otherwise every token gets s_i · A_t · (1/|y_i|)-scaled credit through
∇s_i = s_i · (1/|y_i|) Σ_t ∇log π(y_t). Because s_i is a geometric mean, its clip range is small (the paper's
3e-4 / 4e-4, the defaults here), far tighter than a token ratio's 0.2. The optional k2 term (kl_coef, default 0:
the paper has none) is the default loss's per-token pull toward the sampler.

y_i is one packed sequence of the micro-batch (`sequence_lengths`), |y_i| its rl tokens (weight != 0), A_t each
token's advantage. Every rl token carries its sequence's surrogate, so the numerator is Σ_i |y_i| · surrogate_i;
how that meets N_rl and the paper's (1/G) Σ_i: docs/algorithms.md, "The rl loss menu".
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from rollout_lib.losses import capped
from rollout_lib.rl_losses.base import EpsSettings, RlLoss, mean_over, sequence_means

# The paper's clip range for the sequence ratio (Zheng et al. 2025, section 5.1).
GSPO_EPS_LOW = 3e-4
GSPO_EPS_HIGH = 4e-4


class GspoSettings(EpsSettings):
    type: Literal["gspo"]
    eps_low: float = Field(GSPO_EPS_LOW, gt=0, lt=1)  # s_i below 1 - eps_low: no gradient for A < 0
    eps_high: float = Field(GSPO_EPS_HIGH, gt=0)  # s_i above 1 + eps_high: no gradient for A > 0
    kl_coef: float = Field(0.0, ge=0)


class Gspo(RlLoss):
    type_name = "gspo"
    settings_class = GspoSettings

    def terms(self, logprobs: Tensor, inference_logprobs: Tensor, advantages: Tensor, weights: Tensor, *,
              sequence_ids: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        if sequence_ids is None:
            raise ValueError("gspo needs each token's sequence (the micro-batch's sequence_lengths)")
        settings = self.settings
        member = weights != 0
        log_ratio = logprobs - inference_logprobs
        mean_log_ratio, _ = sequence_means(log_ratio, sequence_ids, member)
        sequence_ratio = capped(torch.exp(mean_log_ratio), settings.max_ratio)
        clipped = sequence_ratio.clamp(1 - settings.eps_low, 1 + settings.eps_high)
        unclipped_term, clipped_term = sequence_ratio * advantages, clipped * advantages
        surrogate = torch.minimum(unclipped_term, clipped_term)
        numerator = (weights * (-surrogate + settings.kl_coef * 0.5 * log_ratio.square())).sum()

        with torch.no_grad():
            # Tokens whose policy gradient the clip cut: the clipped branch is the smaller and differs.
            cut = member & (clipped_term < unclipped_term)
            metrics = {
                "tokens": int(member.sum()),
                "clipped_fraction": mean_over(cut.float(), member),
                "sequence_ratio_mean": mean_over(sequence_ratio, member),
                "mismatch_kl": mean_over(torch.exp(log_ratio) - 1 - log_ratio, member),
            }
        return numerator, metrics
