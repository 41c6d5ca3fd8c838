"""What one rollout's scoring produced, and the step-level summaries of a batch of those."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RewardResult:
    """reward is None exactly when some function failed; error then says which and why."""

    reward: float | None
    error: str | None = None
    per_function: dict[str, float | None] = field(default_factory=dict)  # unweighted score per function
    # The numbers each function's reward dict carried beside its score, as "<function>/<key>" (contract.extra_values).
    extra: dict[str, float] = field(default_factory=dict)


class TooManyRewardsMissingError(RuntimeError):
    """More of a step's rewards are missing than the run allows: a reward that fails on most rollouts is a broken
    reward setup, and training on the few it scored would be training on a biased sample.

    `errors` holds the most frequent distinct errors, most frequent first; `error_counts` pairs them with counts."""

    def __init__(self, summary: str, error_counts: list[tuple[str, int]]) -> None:
        self.summary = summary
        self.error_counts = error_counts
        self.errors = [error for error, _ in error_counts]
        message = summary
        if error_counts:  # the top cause on the first line: a failed run's one-line error shows only that line
            top, count = error_counts[0]
            message += f"; top cause ({count}x): {(top.strip().splitlines() or [repr(top)])[0]}"
            message += "\nmost frequent errors:\n  " + "\n  ".join(f"{n}x {error}" for error, n in error_counts)
        super().__init__(message)

    def __reduce__(self):  # pickled with a failed task's state: rebuilt from what __init__ takes
        return type(self), (self.summary, self.error_counts)


class AllRewardsFailedError(TooManyRewardsMissingError):
    """Every rollout of a step lost its reward (whatever the allowed share): nothing to train on."""


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


def most_frequent_errors(results: list[RewardResult], max_errors: int = 5) -> list[tuple[str, int]]:
    """(error, count) of the missing rewards' distinct errors, most frequent first (ties: first seen first)."""
    return Counter(r.error for r in results if r.reward is None and r.error is not None).most_common(max_errors)


def raise_if_all_missing(results: list[RewardResult], max_errors: int = 5) -> None:
    """Raise AllRewardsFailedError when results is non-empty and no rollout got a reward."""
    if not results or any(r.reward is not None for r in results):
        return
    raise AllRewardsFailedError(f"all {len(results)} rewards failed", most_frequent_errors(results, max_errors))


def raise_if_too_many_missing(results: list[RewardResult], max_missing_fraction: float, *, setting: str,
                              by_env: dict[str, list[RewardResult]] | None = None, max_errors: int = 5) -> None:
    """The circuit breaker: raise TooManyRewardsMissingError when more than `max_missing_fraction` of results are
    missing. `setting` names the limit in the message (its config locator); `by_env` adds each env's count. A limit
    of 1.0 never trips: only `raise_if_all_missing` fails such a run."""
    n_missing = sum(r.reward is None for r in results)
    if not results or n_missing / len(results) <= max_missing_fraction:
        return
    summary = (f"{n_missing} of {len(results)} rewards missing ({n_missing / len(results):.0%}), more than "
               f"{setting} = {max_missing_fraction:g} allows")
    if by_env:
        summary += " (by env: " + ", ".join(
            f"{name} {sum(r.reward is None for r in group)} of {len(group)}" for name, group in by_env.items()) + ")"
    raise TooManyRewardsMissingError(summary, most_frequent_errors(results, max_errors))
