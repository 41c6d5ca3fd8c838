"""The contract between the reward loop and a reward function: what one call is given (`RewardInput`), what its
return value stands for (`as_score`), and how the loop tells an async function from a sync one, and a group function
(`is_group_function`: it scores a group's rollouts together) from a per-rollout one.

The bottom of the reward room: functions, adapters (verl), the loop, judges and reward models all import it, and
it imports none of them.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RewardInput:
    """Everything a reward function may look at for one rollout."""

    prompt: list[dict]  # chat messages [{role, content}, ...]
    completion_text: str
    answer: str | None = None
    info: dict = field(default_factory=dict)  # parsed from the JSON `info` column of PROMPTS / ROLLOUTS
    env: str = ""
    # Multi-turn envs: completion_text is the policy's last turn; `turns` every message after the prompt
    # ({role, content}: the policy's turns as "assistant", then what the environment wrote), and `state` the
    # episode's final state (envs.base.Interaction). Single-turn: turns holds the one completion, state is empty.
    turns: list[dict] = field(default_factory=list)
    state: dict = field(default_factory=dict)
    example_id: str = ""  # with `env`, the group the rollout belongs to (the rollouts of one prompt)

    @property
    def group(self) -> tuple[str, str]:
        return self.env, self.example_id


def as_score(value: Any) -> float:
    """The float a reward function's return value stands for; anything else is the function's bug."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward dict has no 'score' key (keys: {sorted(value)})")
        value = value["score"]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # Real: numpy scalars too
        # bool is an int subclass; a True that slips through is almost always a missing float() somewhere.
        raise TypeError(f"reward must be a float or {{'score': float}}, got {type(value).__name__}: {value!r}")
    score = float(value)
    if not math.isfinite(score):
        # A NaN would poison every group mean it touches; treat it as a failed reward instead.
        raise ValueError(f"reward is not finite: {score}")
    return score


def extra_values(value: Any) -> dict[str, float]:
    """The numbers a reward dict carries beside its "score" (verl's `reward_extra_info`: an accuracy, a length, a
    format flag), which the step's metrics average; a float return carries none. Values that are not finite numbers
    (strings, lists, None) are for the function's own logs and are left out."""
    if not isinstance(value, dict):
        return {}
    return {str(key): float(extra) for key, extra in value.items()
            if key != "score" and isinstance(extra, numbers.Real) and math.isfinite(float(extra))}


def is_async_callable(fn: Any) -> bool:
    """True when calling fn returns an awaitable by construction: `async def`, a bound async method, a
    functools.partial of one (at any depth), or an instance whose `__call__` is `async def`."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn):  # also sees through bound methods
        return True
    if isinstance(fn, type):  # calling a class constructs an instance, whatever its __call__ is
        return False
    return inspect.iscoroutinefunction(getattr(type(fn), "__call__", None))


def is_group_function(fn: Any) -> bool:
    """True for a group reward function (a verifiers rubric's plural-argument one): marked `scores_group = True`,
    it is called once per group with the group's RewardInputs in row order and returns one score per input, in
    that order (each a float or a reward dict, as `as_score` reads them)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "scores_group", False) is True


def function_name(fn: Any) -> str:
    """A readable name for metrics and errors: the underlying function's name, through partials."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
