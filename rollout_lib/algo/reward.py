"""Reward as advantage: REINFORCE credit with no baseline, the rl component on every completion token."""

from __future__ import annotations

from typing import Literal

from rollout_lib.algo.base import Algorithm, AlgoSettings, Group


class RewardAdvantageSettings(AlgoSettings):
    type: Literal["reward"] = "reward"


class RewardAsAdvantage(Algorithm):
    """advantage = reward, on every completion token;  no baseline, so no group is needed (group_size 1 trains).

    Every scored sample is pushed up in proportion to its reward: unbiased but noisier than a baselined gradient,
    for rewards whose zero already means "neutral". A sample with a missing reward gets no rl credit."""

    type_name = "reward"
    settings_class = RewardAdvantageSettings

    def assign(self, group: Group) -> list[list[float] | None]:
        return group.broadcast(group.per_sample(lambda reward: reward))
