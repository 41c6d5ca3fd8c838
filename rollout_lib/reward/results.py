"""What one rollout's scoring produced, and the step-level summaries of a batch of those."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RewardResult:
    """reward is None exactly when some function failed; error then says which and why."""

    reward: float | None
    error: str | None = None
    per_function: dict[str, float | None] = field(default_factory=dict)  # unweighted score per function


class AllRewardsFailedError(RuntimeError):
    """Every rollout of a step lost its reward: a broken reward setup, not noise to train on."""

    def __init__(self, n_total: int, errors: list[str]) -> None:
        self.errors = errors
        shown = "\n  ".join(errors)
        super().__init__(f"all {n_total} rewards failed; first distinct errors:\n  {shown}")


def reward_metrics(results: list[RewardResult]) -> dict[str, float | int | None]:
    """Mean / population std over the present rewards (None when there are none), and how many are missing."""
    present = [r.reward for r in results if r.reward is not None]
    mean = math.fsum(present) / len(present) if present else None
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in present) / len(present)) if present else None
    return {
        "reward_mean": mean,
        "reward_std": std,
        "n_missing": len(results) - len(present),
        "n_total": len(results),
    }


def raise_if_all_missing(results: list[RewardResult], max_errors: int = 5) -> None:
    """Raise AllRewardsFailedError when results is non-empty and no rollout got a reward."""
    if not results or any(r.reward is not None for r in results):
        return
    distinct: list[str] = []
    for result in results:
        if result.error is not None and result.error not in distinct:
            distinct.append(result.error)
            if len(distinct) == max_errors:
                break
    raise AllRewardsFailedError(len(results), distinct)
