"""Inference-training mismatch: the correction of the rl component for a sampler whose logprobs are not the
trainer's, and its diagnostics (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training"; verl's rollout_is and prime-rl implement the same four).

A fast engine samples from π_sampler, which differs from the trainer's π_old (same weights) by numerics: kernels,
bf16, batch shape. Taking the sampler's logprobs as the behaviour policy ("fast") then trains with a biased ratio;
the correction instead takes the trust-region ratio against π_old and reweights each token by how much likelier
the trainer finds it than the sampler did:

    w_t = exp(logp_old_t - logp_sampler_t)                          the per-token mismatch ratio
    tis      loss_t · sg(min(w_t, C))                               token-level truncated importance sampling
    seq_tis  loss_t · sg(min(Π_{t∈y} w_t, C))                       one weight per sequence (product in log space)
    mis      loss_t · [w_t <= C]                                    masked importance sampling: drop, never scale
    icepop   loss_t · [low <= w_t <= high]                          drop tokens mismatched either way

π_old is the trainer's: off-policy (k >= 1) its recompute under the weights that sampled, with the sampler's report
kept beside it on the wire (`sampler_logprobs`); on-policy with the sampler's report as the behaviour stream, the
step's own forward (losses.correction_inputs). Off-policy the trust region acts on π_θ / π_old (staleness) and w_t
only on the engine's numerics, as verl's decoupled rollout_is does.

sg: no gradient; the weight scales a token's loss, it never pulls on the policy itself. A masked token's loss is
zero but it still counts in N_rl, so the step's other tokens keep their per-token step size.

Diagnostics (`mismatch/...`, over the rl tokens): kl, the k3 estimate of KL(π_sampler ‖ π_old) (w - 1 - log w);
ratio_max; clipped_fraction (tokens whose weight the cap lowered) and masked_fraction (tokens dropped). Without a
correction set, wherever a stream holds π_old beside the sampler's report, `sampler_report_diagnostics` gives the
same kl and ratio_max and what a correction at its defaults would cut or drop (`behaviour/sampler_*`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import Tensor

from rollout_lib.losses import mean_over
from rollout_lib.settings_base import StrictModel

CORRECTION_TYPES = ("none", "tis", "seq_tis", "mis", "icepop")


class CorrectionSettings(StrictModel):
    """`algorithm.rl.loss.correction`: which correction, its cap C (tis, seq_tis, mis) and ICEPOP's band."""

    type: Literal["none", "tis", "seq_tis", "mis", "icepop"] = "none"
    cap: float = Field(2.0, gt=1)
    low: float = Field(0.5, gt=0, lt=1)
    high: float = Field(2.0, gt=1)

    @model_validator(mode="before")
    @classmethod
    def _known_type(cls, value):
        # One line naming the valid types, rather than pydantic's literal error with the input echoed.
        if isinstance(value, dict) and value.get("type", "none") not in CORRECTION_TYPES:
            raise ValueError(f"unknown correction type {value['type']!r}: one of {', '.join(CORRECTION_TYPES)}")
        return value

    @property
    def active(self) -> bool:
        return self.type != "none"


class MismatchCorrection:
    """The correction of `settings`, applied to one micro-batch's rl token weights."""

    def __init__(self, settings: CorrectionSettings) -> None:
        self.settings = settings

    def token_factors(self, old_logprobs: Tensor, sampler_logprobs: Tensor, member: Tensor,
                      sequence_ids: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        """(factor_t, diagnostics): each rl token's loss is multiplied by factor_t (detached; 0: masked).
        `member`: the rl tokens; `sequence_ids`: each token's packed sequence (seq_tis needs them)."""
        settings = self.settings
        with torch.no_grad():
            log_w = torch.where(member, old_logprobs - sampler_logprobs, torch.zeros_like(old_logprobs))
            ratio = torch.exp(log_w)
            ones = torch.ones_like(ratio)
            if settings.type == "tis":
                factor = ratio.clamp(max=settings.cap)
                clipped = member & (ratio > settings.cap)
            elif settings.type == "seq_tis":
                if sequence_ids is None:
                    raise ValueError("seq_tis needs each token's sequence (the micro-batch's sequence_lengths)")
                sequence_log_w = _sequence_sums(log_w, sequence_ids)  # log Π_t w_t: no overflow on long answers
                factor = torch.exp(sequence_log_w.clamp(max=math.log(settings.cap)))
                clipped = member & (sequence_log_w > math.log(settings.cap))
            elif settings.type == "mis":
                factor = torch.where(ratio > settings.cap, torch.zeros_like(ratio), ones)
                clipped = torch.zeros_like(member)
            elif settings.type == "icepop":
                inside = (ratio >= settings.low) & (ratio <= settings.high)
                factor = torch.where(inside, ones, torch.zeros_like(ratio))
                clipped = torch.zeros_like(member)
            else:
                factor, clipped = ones, torch.zeros_like(member)
            factor = torch.where(member, factor, ones)
            masked = member & (factor == 0)
            diagnostics = mismatch_diagnostics(log_w, member)
            diagnostics["clipped_fraction"] = mean_over(clipped.float(), member)
            diagnostics["masked_fraction"] = mean_over(masked.float(), member)
        return factor, diagnostics


def mismatch_diagnostics(log_w: Tensor, member: Tensor) -> dict[str, float]:
    """kl (k3 of KL(π_sampler ‖ π_old), mean over `member`) and ratio_max of w = exp(log_w). k3 as expm1(log w) -
    log w in float64: exp(log w) - 1 - log w in float32 has a rounding floor above the ~1e-5 log-ratios of an fp32
    engine against the trainer (rl-smollm2 on the engine: 4.4e-9, where behaviour/sampler_kl in float64 gave
    3.6e-11 for the same tokens)."""
    log_w = log_w.double()
    return {"kl": mean_over(torch.expm1(log_w) - log_w, member),
            "ratio_max": float(torch.exp(log_w[member]).max()) if bool(member.any()) else 0.0}


def sampler_report_diagnostics(log_w: Sequence[float]) -> dict[str, float]:
    """How far a sampler's report is from π_old over some tokens (log_w = logp_old - logp_sampler each), and what a
    correction at its defaults would do there: kl (k3, as `mismatch_diagnostics`), ratio_max, over_cap_fraction
    (tokens tis would cut and mis drop at C = 2) and outside_band_fraction (tokens icepop would drop, outside
    [0.5, 2]). The trainer's recompute and partial rollouts' stages report them as `behaviour/sampler_*` whether
    a correction is set or not, so a run shows whether one is worth setting. Empty for no tokens."""
    if not len(log_w):
        return {}
    defaults = CorrectionSettings()
    log_w = np.asarray(log_w, dtype=np.float64)
    ratio = np.exp(log_w)
    return {"kl": float(np.mean(np.expm1(log_w) - log_w)), "ratio_max": float(ratio.max()),
            "over_cap_fraction": float(np.mean(ratio > defaults.cap)),
            "outside_band_fraction": float(np.mean((ratio < defaults.low) | (ratio > defaults.high)))}


def build_correction(settings: CorrectionSettings) -> MismatchCorrection | None:
    """The correction to apply, or None for "none": the loss then runs exactly as before the setting."""
    return MismatchCorrection(settings) if settings.active else None


def _sequence_sums(values: Tensor, sequence_ids: Tensor) -> Tensor:
    """[T] each token's sum of `values` over its sequence (values are 0 off the member tokens)."""
    count = int(sequence_ids.max()) + 1 if sequence_ids.numel() else 0
    sums = torch.zeros(count, dtype=values.dtype, device=values.device).index_add(0, sequence_ids, values)
    return sums[sequence_ids]

