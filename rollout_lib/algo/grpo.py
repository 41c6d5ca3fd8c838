"""GRPO: group-relative policy optimisation (Shao et al. 2024), the rl component on every completion token."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from rollout_lib.algo.base import (Algorithm, AlgoSettings, Group, OptionalLengthPenalty, mean, sample_std,
                                   with_length_penalty)


class GrpoSettings(AlgoSettings):
    type: Literal["grpo"] = "grpo"
    # Dividing by the group std (the original GRPO) up-weights near-unanimous groups; off by default, as in
    # Dr. GRPO (Liu et al. 2025), where it is shown to bias toward questions that are too easy or too hard.
    std_normalize: bool = False
    std_eps: float = Field(1e-4, gt=0)
    # Reward shaping by completion length before the baseline: { type = "overlong", max_len, buffer } (DAPO) or
    # { type = "group_relative" } (Kimi k1.5); None: rewards as scored.
    length_penalty: OptionalLengthPenalty = None

    group_relative: ClassVar[bool] = True


class Grpo(Algorithm):
    """advantage = reward - group mean;  with std_normalize: (reward - mean) / (group std + eps).

    Mean and std are over the group's scored samples; a sample with a missing reward gets no rl credit. With a
    `length_penalty`, reward is the shaped reward (base.with_length_penalty), before the mean is taken."""

    type_name = "grpo"
    settings_class = GrpoSettings

    def assign(self, group: Group) -> list[list[float] | None]:
        group = with_length_penalty(group, self.settings.length_penalty)
        present = group.present
        baseline = mean(present) if present else 0.0  # nothing scored: every sample gets None below anyway
        scale = sample_std(present) + self.settings.std_eps if self.settings.std_normalize else 1.0
        return group.broadcast(group.per_sample(lambda reward: (reward - baseline) / scale))
