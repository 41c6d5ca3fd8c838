"""The reward loop: per-rollout async scoring with user reward functions (see loop.py)."""

from rollout_lib.reward.functions import (
    BUILTIN_REWARD_FUNCTIONS,
    RewardInput,
    resolve_reward_function,
)
from rollout_lib.reward.loop import (
    AllRewardsFailedError,
    RewardLoop,
    RewardResult,
    apply_rewards,
    is_async_callable,
    raise_if_all_missing,
    reward_metrics,
    score_rollouts,
    score_rollouts_sync,
)
from rollout_lib.reward.tables import reward_inputs

__all__ = [
    "BUILTIN_REWARD_FUNCTIONS",
    "AllRewardsFailedError",
    "RewardInput",
    "RewardLoop",
    "RewardResult",
    "apply_rewards",
    "is_async_callable",
    "raise_if_all_missing",
    "resolve_reward_function",
    "reward_inputs",
    "reward_metrics",
    "score_rollouts",
    "score_rollouts_sync",
]
