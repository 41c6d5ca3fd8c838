"""MaxRL: group-relative advantage scaled by the group's mean reward, the rl component on completion tokens."""

from __future__ import annotations

from typing import ClassVar, Literal

from rollout_lib.algo.base import Algorithm, AlgoSettings, Group, mean


class MaxRlSettings(AlgoSettings):
    type: Literal["max_rl"] = "max_rl"

    group_relative: ClassVar[bool] = True


class MaxRl(Algorithm):
    """advantage = (reward - group mean) / group mean;  zero when the mean is <= 0.

    The mean is over the group's scored samples; a sample with a missing reward gets no rl credit."""

    type_name = "max_rl"
    settings_class = MaxRlSettings

    def assign(self, group: Group) -> list[list[float] | None]:
        present = group.present
        baseline = mean(present) if present else 0.0
        if baseline <= 0:
            return group.broadcast(group.per_sample(lambda reward: 0.0))
        return group.broadcast(group.per_sample(lambda reward: (reward - baseline) / baseline))
