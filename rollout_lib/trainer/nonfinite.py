"""The finite-gradient guard: a step whose loss or gradient is not finite is skipped, too many in a row fail the run.

One bad batch (a behaviour logprob the sampler reported as impossible, a token whose ratio overflowed) must not
poison the weights, nor stop a long run on its own; a run that keeps producing them is broken and must stop, saying
where (prime-rl #2972: NaN gradients stepped silently into the weights). The trainer skips `optimizer.step()` on such
a step and records `skipped_nonfinite = 1` in its metrics; `NonFiniteGuard` counts the skips and raises
NonFiniteLossError, one line naming the step and the first non-finite tensor, at `max_nonfinite_steps` in a row.
The count lives with the trainer in memory: a trainer rebuilt in a new process starts counting again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from rollout_lib.trainer.base import NonFiniteLossError


class NonFiniteGuard:
    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0

    def after_step(self, step: int, nonfinite: str | None) -> None:
        """Record step `step`'s outcome: `nonfinite` names its first non-finite tensor when it was skipped."""
        if nonfinite is None:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteLossError(
                f"step {step}: {self.in_a_row} step(s) in a row with a non-finite loss or gradient "
                f"(loss.max_nonfinite_steps = {self.max_in_a_row}); first non-finite tensor: {nonfinite}; "
                "weights not updated")


def first_nonfinite_gradient(named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> str | None:
    """The name of the first parameter (in the model's order) whose gradient holds a NaN or inf, else None. Sharded
    (FSDP2): this rank's shard of each gradient."""
    for name, parameter in named_parameters:
        grad = parameter.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if local is not None and not bool(torch.isfinite(local).all()):
            return f"gradient of {name}"
    return None


def finite_metrics(metrics: dict) -> dict:
    """`metrics` without NaN/inf values: a skipped step's numbers go to the run's records and checkpoint manifests,
    which hold JSON numbers only."""
    return {name: value for name, value in metrics.items()
            if not isinstance(value, float) or math.isfinite(value)}
