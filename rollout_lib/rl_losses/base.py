"""What every built-in rl loss shares: its settings' common knobs, the registry, and the sequence math.

An rl loss computes the rl component's **numerator** for one micro-batch, Σ_t w_t · loss_t over its rl tokens; the
trainer divides it by the rl normaliser (losses.component_loss):

    N_rl = step-global count of rl tokens                       normalizer = "tokens" (default)
    N_rl = C · step-global count of sequences with an rl token   normalizer = { constant = C }  (Dr. GRPO)

Both are sums over every micro-batch of every rank, so gradient accumulation and data parallelism stay exact: a
micro-batch's loss is its numerator over the step's N_rl, whatever rank trains it.

A loss module subclasses `RlLoss` (its `type_name`, its `settings_class`, `terms`) and is registered on import, so
adding a loss is adding a file to this package: the config's `algorithm.rl.loss` union grows by itself.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from rollout_lib.losses import DEFAULT_REF_KL_EPS_LOW, DEFAULT_REF_KL_KL_COEF, mean_over  # noqa: F401  (re-exported)
from rollout_lib.rl_losses.correction import CorrectionSettings
from rollout_lib.settings_base import StrictModel

DEFAULT_MAX_NONFINITE_STEPS = 3


class ConstantNormalizer(StrictModel):
    """Dr. GRPO's normaliser: a sequence's rl tokens are summed and divided by `constant` (e.g. the generation
    budget), whatever its length, then averaged over the step's sequences."""

    constant: float = Field(gt=0)


class LossSettings(StrictModel):
    """The knobs every rl loss has. New knobs are left out of the settings' dump at their defaults, so the
    identities of runs from before them stay."""

    type: str
    # The ref_kl component's knobs (losses.ref_kl_loss_terms): whatever the rl loss, ref_kl samples train as before.
    ref_kl_eps_low: float = Field(DEFAULT_REF_KL_EPS_LOW, gt=0, le=1)
    ref_kl_kl_coef: float = Field(DEFAULT_REF_KL_KL_COEF, ge=0)
    # A ceiling on the importance ratio π/π_inf (a value above it counts as the ceiling and carries no gradient): a
    # guard against a stale or mismatched behaviour logprob exploding one token's weight. None: no ceiling.
    max_ratio: float | None = Field(None, gt=1, exclude_if=lambda value: value is None)
    normalizer: Literal["tokens"] | ConstantNormalizer = Field("tokens", exclude_if=lambda value: value == "tokens")
    # A step whose loss or gradient is not finite is skipped (no optimizer step, `skipped_nonfinite = 1`); this many
    # in a row fail the run. Never part of the training identity: it decides whether a run stops, not its weights.
    max_nonfinite_steps: int = Field(DEFAULT_MAX_NONFINITE_STEPS, ge=1)
    # The inference-training mismatch correction (correction.py): "none" is left out of the dump, so the identities
    # of runs from before it stay.
    correction: CorrectionSettings = Field(default_factory=CorrectionSettings,
                                           exclude_if=lambda value: not value.active)

    def normalizer_constant(self) -> float | None:
        return None if self.normalizer == "tokens" else self.normalizer.constant


RL_LOSSES: dict[str, type[RlLoss]] = {}


class RlLoss:
    """One rl loss: `terms` returns (Σ_t w_t · loss_t, metrics) for a micro-batch. Subclasses set `type_name` and
    `settings_class`; defining one registers it."""

    type_name: ClassVar[str]
    settings_class: ClassVar[type[LossSettings]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "type_name" in cls.__dict__:
            if RL_LOSSES.get(cls.type_name, cls) is not cls:
                raise TypeError(f"rl loss type {cls.type_name!r} is registered twice")
            RL_LOSSES[cls.type_name] = cls

    def __init__(self, settings: LossSettings) -> None:
        self.settings = settings

    def terms(self, logprobs: Tensor, inference_logprobs: Tensor, advantages: Tensor, weights: Tensor, *,
              sequence_ids: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        """(Σ_t w_t · loss_t, metrics) over one micro-batch's flat per-token tensors; `sequence_ids`: each token's
        packed sequence (None where the caller has no sequence boundaries)."""
        raise NotImplementedError


class EpsSettings(LossSettings):
    """A loss with a trust region of its own (eps_low / eps_high) and an optional k2 KL to the sampler."""

    @model_validator(mode="after")
    def _ratio_cap_above_the_trust_region(self) -> "EpsSettings":
        high = getattr(self, "eps_high", None)
        if self.max_ratio is not None and high is not None and self.max_ratio < 1 + high:
            raise ValueError(f"max_ratio ({self.max_ratio}) must be >= 1 + eps_high ({1 + high}): the ceiling is a "
                             "guard beyond the trust region, not a tighter one")
        return self


# --- shared math ------------------------------------------------------------------------------------------------


def sequence_means(values: Tensor, sequence_ids: Tensor, member: Tensor) -> tuple[Tensor, Tensor]:
    """(per-token mean of `values` over its sequence's member tokens, member-token count of that sequence), both
    [T]. A token of a sequence without member tokens gets mean 0 and count 0. Differentiable in `values`."""
    count = int(sequence_ids.max()) + 1 if sequence_ids.numel() else 0
    masked = torch.where(member, values, torch.zeros_like(values))
    sums = torch.zeros(count, dtype=values.dtype, device=values.device).index_add(0, sequence_ids, masked)
    lengths = torch.zeros(count, dtype=values.dtype, device=values.device).index_add(0, sequence_ids,
                                                                                   member.to(values.dtype))
    means = sums / lengths.clamp(min=1)
    return means[sequence_ids], lengths[sequence_ids]


