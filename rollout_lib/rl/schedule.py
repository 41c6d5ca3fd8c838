"""Which policy state each RL step samples from: the off-policy schedule, in one place.

With `max_off_policy_steps = k`, step n trains on rollouts sampled from the state after step n-1-k (the initial
policy, step 0, while that is negative). k = 0 is the synchronous loop: each step samples from the state the step
before produced. With k > 0 the sampling of step n+k runs while step n trains, so at most k samplings are ahead of
the trainer, and the frozen copies a run keeps must cover the states those samplings read plus the newest.

The flow (flows/train_rl.py) asks this object, never re-derives the rule.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OffPolicySchedule:
    k: int  # max_off_policy_steps

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"max_off_policy_steps must be >= 0, got {self.k}")

    @property
    def synchronous(self) -> bool:
        return self.k == 0

    def sampled_after(self, step: int) -> int:
        """The step whose resulting state step `step` samples from (0: the initial policy)."""
        if step < 1:
            raise ValueError(f"RL steps count from 1, got {step}")
        return max(0, step - 1 - self.k)

    def lag(self, step: int) -> int:
        """Optimizer steps between the weights that sampled step `step` and the weights it trains from."""
        return step - 1 - self.sampled_after(step)

    def first_submissions(self, total: int) -> range:
        """The steps whose sampling is submitted before step 1 trains."""
        return range(1, min(self.k, total) + 1)

    def submitted_while_training(self, step: int, total: int) -> int | None:
        """The step whose sampling is submitted as step `step` starts (it runs while `step` trains), if any."""
        ahead = step + self.k
        return ahead if self.k and ahead <= total else None

    @property
    def frozen_capacity(self) -> int:
        """Frozen copies a run keeps: the k states samplings in flight read, the newest, and one spare for the
        evaluation of the state just trained."""
        return self.k + 2
