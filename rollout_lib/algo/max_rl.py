"""MaxRL: group-relative advantage scaled by the group's mean reward, the rl component on completion tokens."""

from __future__ import annotations

from typing import ClassVar, Literal

from rollout_lib.algo.base import Algorithm, AlgoSettings, Group, OptionalLengthPenalty, mean, with_length_penalty


class MaxRlSettings(AlgoSettings):
    type: Literal["max_rl"] = "max_rl"
    # Reward shaping by completion length before the baseline (as grpo's); None: rewards as scored.
    length_penalty: OptionalLengthPenalty = None

    group_relative: ClassVar[bool] = True


class MaxRl(Algorithm):
    """advantage = (reward - group mean) / group mean;  zero when the mean is <= 0.

    The mean is over the group's scored samples; a sample with a missing reward gets no rl credit. With a
    `length_penalty`, reward is the shaped reward (base.with_length_penalty), before the mean is taken; a penalty
    that brings the mean to <= 0 zeroes the group."""

    type_name = "max_rl"
    settings_class = MaxRlSettings

    def assign(self, group: Group) -> list[list[float] | None]:
        group = with_length_penalty(group, self.settings.length_penalty)
        present = group.present
        baseline = mean(present) if present else 0.0
        if baseline <= 0:
            return group.broadcast(group.per_sample(lambda reward: 0.0))
        return group.broadcast(group.per_sample(lambda reward: (reward - baseline) / baseline))
