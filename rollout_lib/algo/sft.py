"""sft-distill (type "sft"): a frozen teacher samples, the policy learns its tokens by likelihood (ce).

Distillation from a frozen model's own outputs, on-line: each step the teacher answers the step's prompts and the
policy's cross-entropy on those completions is the loss. The sampling source must be a frozen model
(`sampler.source = { model = ... }` or `{ base_url, name }`): ce on the policy's own samples is a different
algorithm, and is refused at plan time (config/rl.py). No reward and no advantage is used.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from rollout_lib.algo.base import Algorithm, AlgoSettings


class SftDistillSettings(AlgoSettings):
    type: Literal["sft"] = "sft"

    samples_from_frozen_model: ClassVar[bool] = True


class SftDistill(Algorithm):
    """ce_weights = 1 on every completion token the teacher wrote."""

    type_name = "sft"
    settings_class = SftDistillSettings
    action_loss = "ce"
