"""What every RL algorithm is: settings named by a `type`, a group-time `assign`, an optional ship-time `score`.

Modelled on the prime-rl algorithm abstraction (seed 002). Per environment, an algorithm

1. `assign(group)`: at group time, turns the group's rewards into per-token advantages over each completion;
2. `score(samples)` (optional, async): at ship time, fills per-token streams that need a model, e.g. reference
   logprobs for on-policy distillation. The default ships samples unchanged;
3. declares `action_loss`: the trainer component ("rl", "ce" or "ref_kl") its completion tokens train under.
   Stamping (`stamping.py`) turns that into the weight streams of the wire, so the trainer never needs to know
   which algorithm a token came from.

Adding an algorithm is adding a module to this package: a settings class (a subclass of `AlgoSettings` with a
literal `type`) and an `Algorithm` subclass naming it. Both register by their type name; the config's `algo`
union is built from the registry, so nothing else changes.

This package never imports `rollout_lib.config` (the config imports it, to build its `algo` union).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

LOSS_COMPONENTS = ("rl", "ce", "ref_kl")


class AlgoSettings(BaseModel):
    """Settings of one algorithm; subclasses set `type: Literal["<name>"] = "<name>"` and their own knobs.

    Defaults are the vetted setting, so `algo = { type = "grpo" }` alone is a working algorithm."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Group-relative algorithms compare samples of one prompt; with group_size = 1 every advantage is 0.
    group_relative: ClassVar[bool] = False


@dataclass(frozen=True)
class Group:
    """The samples of one prompt in one step: rewards (None = missing) and completion lengths in tokens."""

    rewards: Sequence[float | None]
    completion_lengths: Sequence[int]

    def __post_init__(self) -> None:
        if len(self.rewards) != len(self.completion_lengths):
            raise ValueError(f"{len(self.rewards)} rewards for {len(self.completion_lengths)} completions")

    @property
    def present(self) -> list[float]:
        """The rewards that were scored: the baseline of group-relative algorithms is taken over these only."""
        return [reward for reward in self.rewards if reward is not None]

    def per_sample(self, advantage_of: Callable[[float], float]) -> list[float]:
        """advantage_of(reward) for each scored sample; a sample whose reward is missing gets 0."""
        return [0.0 if reward is None else float(advantage_of(reward)) for reward in self.rewards]

    def broadcast(self, per_sample: Sequence[float]) -> list[list[float]]:
        """One advantage per completion token: each sample's scalar repeated over its completion."""
        if len(per_sample) != len(self.completion_lengths):
            raise ValueError(f"{len(per_sample)} advantages for {len(self.completion_lengths)} samples")
        return [[float(value)] * length for value, length in zip(per_sample, self.completion_lengths)]


class Algorithm:
    """One environment's algorithm. Subclasses set `type_name`, `settings_class` and implement `assign`."""

    type_name: ClassVar[str]
    settings_class: ClassVar[type[AlgoSettings]]
    action_loss: ClassVar[str] = "rl"
    # Whether a sample without a reward can still train (a distillation signal needs no reward; rl does).
    needs_reward: ClassVar[bool] = True

    def __init__(self, settings: AlgoSettings):
        if not isinstance(settings, self.settings_class):
            raise TypeError(f"{type(self).__name__} takes {self.settings_class.__name__}, "
                            f"got {type(settings).__name__}")
        self.settings = settings

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.action_loss not in LOSS_COMPONENTS:
            raise TypeError(f"{cls.__name__}.action_loss must be one of {LOSS_COMPONENTS}, got {cls.action_loss!r}")
        if "type_name" in cls.__dict__:
            register(cls)

    def assign(self, group: Group) -> list[list[float]]:
        """Per-token advantages of each sample's completion tokens (len = completion length)."""
        raise NotImplementedError

    # Ship-time hook: subclasses that need a model's view of the samples (reference logprobs) override it.
    has_score: ClassVar[bool] = False

    async def score(self, samples: pa.Table) -> pa.Table:
        """TRAINING_SAMPLES of this algorithm's env, with any ship-time streams filled in."""
        return samples


# --- registry -------------------------------------------------------------------------------------------------

ALGORITHMS: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    name = cls.type_name
    declared = cls.settings_class.model_fields.get("type")
    if declared is None or declared.default != name:
        raise TypeError(f"{cls.settings_class.__name__} must declare `type: Literal[{name!r}] = {name!r}`")
    if name in ALGORITHMS and ALGORITHMS[name] is not cls:
        raise TypeError(f"algorithm type {name!r} is registered twice ({ALGORITHMS[name].__name__}, {cls.__name__})")
    ALGORITHMS[name] = cls
    return cls


def build_algorithm(settings: AlgoSettings) -> Algorithm:
    name = getattr(settings, "type", None)
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm type {name!r}; algorithms that exist: {', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[name](settings)


# --- shared math ---------------------------------------------------------------------------------------------


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def sample_std(values: Sequence[float]) -> float:
    """Unbiased (n - 1) standard deviation, as torch.std and TRL/prime-rl's group normalisation; 0 for n < 2."""
    if len(values) < 2:
        return 0.0
    center = mean(values)
    return math.sqrt(math.fsum((value - center) ** 2 for value in values) / (len(values) - 1))
