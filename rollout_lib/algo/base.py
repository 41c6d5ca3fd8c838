"""What every RL algorithm is: settings named by a `type`, and one class that owns its hooks, built with the
resources it declares.

Modelled on the prime-rl algorithm abstraction (seed 002). Per environment, an algorithm says

1. `action_loss` (a class property, never configured): the trainer component its completion tokens train under,
   "rl" (policy gradient on advantages), "ce" (likelihood) or "ref_kl" (reverse KL to a reference);
2. `assign(group)`: at group time, the per-token advantages of each completion. Only rl algorithms define it, and
   they must. A sample it gives `None` gets no rl credit and trains nothing in rl (its reward is missing);
3. `score(samples)` (async, optional): at ship time, fills the streams that need a model's view of the samples
   (reference logprobs for distillation). Defining it is what makes an algorithm score at ship time;
4. `observation_weights(rollout)` (optional): for a multi-turn env, the ce weight of each token the environment
   wrote (tool results, feedback). By default they train nothing; echo defines it.

Stamping (`stamping.py`) reads only these hooks to write the weight streams of the wire, so the trainer never
needs to know which algorithm a token came from. What a class needs to be built (the policy tokenizer, the run's
frozen models) it names in `requires`; `AlgorithmResources` carries them, and building an algorithm without one
of them fails naming the env.

Adding an algorithm is adding a module, here or in an installed distribution's entry point "rollout.algorithms"
(`plugins.py`): its settings class and `Algorithm` subclass register by their type name (docs/algorithms.md).

Shared math lives as plain functions at the end of this module: the group mean and std, and the length penalties
(`length_penalty` of the group algorithms) that shape rewards before group normalisation.

This package never imports `rollout_lib.config` (the config imports it, to build its `algo` union).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout_lib.settings_base import tagged_union

if TYPE_CHECKING:
    from rollout_lib.serving.served import ServedModels

LOSS_COMPONENTS = ("rl", "ce", "ref_kl")


class AlgoSettings(BaseModel):
    """Settings of one algorithm; subclasses set `type: Literal["<name>"] = "<name>"` and their own knobs.

    Defaults are the vetted setting, so `algo = { type = "grpo" }` alone is a working algorithm."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Group-relative algorithms compare samples of one prompt; with group_size = 1 every advantage is 0.
    group_relative: ClassVar[bool] = False

    def user_modules(self) -> tuple[str, ...]:
        """Modules outside the project whose source decides this algorithm's results (a user function named by an
        import path): their files enter the advantages stage's cache key, which the code version cannot see."""
        return ()


@dataclass(frozen=True)
class AlgorithmResources:
    """The run's objects an algorithm may be built with; a class names those it needs in `requires`.

    Resources change how a result is computed, never what it is keyed by (tasks.common.RESOURCE_PARAMETERS)."""

    tokenizer: Any = None  # the policy's tokenizer (renders prompts, checks a teacher's vocabulary)
    # The run's frozen-model pools: `.pool(settings, tokenizer=..., where=...)` returns a started pool with
    # `await pool.score(token_ids)` (prefill logprobs) and `await pool.generate(...)`.
    served_models: ServedModels | None = None
    prompts: Any = None  # env name -> its PROMPTS table (messages, info) of the run
    # The live policy at the weights the step sampled from: `.model` (loaded on first use) and `.initial_model()`
    # (the frozen base model), for algorithms whose reference is the policy itself (opsd).
    policy: Any = None


RESOURCE_NAMES = frozenset(field.name for field in fields(AlgorithmResources))


class MissingResourceError(RuntimeError):
    """An algorithm was built without a resource its class requires: the caller's bug, named by the env."""


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

    def per_sample(self, advantage_of: Callable[[float], float]) -> list[float | None]:
        """advantage_of(reward) for each scored sample; None (no rl credit) for a sample whose reward is missing."""
        return [None if reward is None else float(advantage_of(reward)) for reward in self.rewards]

    def broadcast(self, per_sample: Sequence[float | None]) -> list[list[float] | None]:
        """One advantage per completion token: each sample's scalar repeated over its completion (None stays)."""
        if len(per_sample) != len(self.completion_lengths):
            raise ValueError(f"{len(per_sample)} advantages for {len(self.completion_lengths)} samples")
        return [None if value is None else [float(value)] * length
                for value, length in zip(per_sample, self.completion_lengths)]


class Algorithm:
    """One environment's algorithm. Subclasses set `type_name`, `settings_class`, `action_loss` (default "rl") and
    `requires`, and define the hooks: `assign` for rl, `score` when it scores at ship time."""

    type_name: ClassVar[str]
    settings_class: ClassVar[type[AlgoSettings]]
    action_loss: ClassVar[str] = "rl"
    requires: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, settings: AlgoSettings, resources: AlgorithmResources | None = None, where: str = "algo"):
        """`where`: the env's config locator (`algorithm.rl.envs[0].algo`), which errors of this algorithm name."""
        if not isinstance(settings, self.settings_class):
            raise TypeError(f"{type(self).__name__} takes {self.settings_class.__name__}, "
                            f"got {type(settings).__name__}")
        resources = resources or AlgorithmResources()
        missing = sorted(name for name in self.requires if getattr(resources, name) is None)
        if missing:
            raise MissingResourceError(f"{where}: a {self.type_name} algorithm is built with the run's "
                                       f"{' and '.join(missing)}, and none was given")
        self.settings = settings
        self.resources = resources
        self.where = where

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.action_loss not in LOSS_COMPONENTS:
            raise TypeError(f"{cls.__name__}.action_loss must be one of {LOSS_COMPONENTS}, got {cls.action_loss!r}")
        unknown = set(cls.requires) - RESOURCE_NAMES
        if unknown:
            raise TypeError(f"{cls.__name__}.requires names {sorted(unknown)}; resources are {sorted(RESOURCE_NAMES)}")
        if "type_name" in cls.__dict__:
            # rl trains on advantages, so an rl algorithm assigns them; any other component has no use for them.
            if (cls.action_loss == "rl") != assigns_advantages(cls):
                raise TypeError(f"{cls.__name__}: an algorithm defines `assign` exactly when its tokens train under "
                                f"rl (action_loss is {cls.action_loss!r})")
            register(cls)

    def assign(self, group: Group) -> list[list[float] | None] | None:
        """Per-token advantages of each sample's completion tokens (len = completion length), None for a sample
        that gets no rl credit; None for the whole group when the algorithm assigns none (it does not train rl)."""
        return None

    async def score(self, samples: pa.Table) -> pa.Table:
        """TRAINING_SAMPLES of this algorithm's env, with the streams that need a model filled in."""
        return samples

    def observation_weights(self, rollout: dict[str, Any]) -> list[float] | None:
        """The ce weight of each completion token of a ROLLOUTS row (a dict of its columns), non-zero only on
        tokens the environment wrote (`completion_turns` segments with sampled = False); None: they train nothing.
        Called for multi-turn rollouts only."""
        return None


def assigns_advantages(algorithm: Algorithm | type[Algorithm]) -> bool:
    cls = algorithm if isinstance(algorithm, type) else type(algorithm)
    return cls.assign is not Algorithm.assign


def trains_env_tokens(algorithm: Algorithm | type[Algorithm]) -> bool:
    cls = algorithm if isinstance(algorithm, type) else type(algorithm)
    return cls.observation_weights is not Algorithm.observation_weights


def scores_at_ship_time(algorithm: Algorithm | type[Algorithm]) -> bool:
    cls = algorithm if isinstance(algorithm, type) else type(algorithm)
    return cls.score is not Algorithm.score


# --- registry -------------------------------------------------------------------------------------------------

ALGORITHMS: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    name = cls.type_name
    declared = cls.settings_class.model_fields.get("type")
    if declared is None or declared.default != name:
        raise TypeError(f"{cls.settings_class.__name__} must declare `type: Literal[{name!r}] = {name!r}`")
    if name in ALGORITHMS and ALGORITHMS[name] is not cls:
        raise TypeError(f"algorithm type {name!r} is registered twice ({ALGORITHMS[name].__module__}."
                        f"{ALGORITHMS[name].__name__}, {cls.__module__}.{cls.__name__})")
    ALGORITHMS[name] = cls
    return cls


def build_algorithm(settings: AlgoSettings, resources: AlgorithmResources | None = None,
                    where: str = "algo") -> Algorithm:
    name = getattr(settings, "type", None)
    if name not in ALGORITHMS:
        raise ValueError(f"{where}: unknown algorithm type {name!r}; algorithms that exist: "
                         f"{', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[name](settings, resources, where)


# --- shared math ---------------------------------------------------------------------------------------------


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def sample_std(values: Sequence[float]) -> float:
    """Unbiased (n - 1) standard deviation, as torch.std and TRL/prime-rl's group normalisation; 0 for n < 2."""
    if len(values) < 2:
        return 0.0
    center = mean(values)
    return math.sqrt(math.fsum((value - center) ** 2 for value in values) / (len(values) - 1))


# --- length penalties: reward shaping before group normalisation ------------------------------------------------


class OverlongPenalty(BaseModel):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to each scored sample's reward:
    0 up to `max_len - buffer` completion tokens, then linear down to -coef at `max_len`, and -coef beyond."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["overlong"] = "overlong"
    max_len: int = Field(ge=1)  # L_max: usually the env's sampling.max_tokens
    buffer: int = Field(ge=1)  # L_cache: the soft-punishment interval before max_len
    coef: float = Field(1.0, gt=0)  # the penalty at max_len (DAPO: 1, the size of its correctness reward)

    @model_validator(mode="after")
    def _buffer_fits(self) -> "OverlongPenalty":
        if self.buffer > self.max_len:
            raise ValueError(f"buffer ({self.buffer}) must be <= max_len ({self.max_len})")
        return self


class GroupRelativeLengthPenalty(BaseModel):
    """Kimi k1.5's length reward (Kimi Team 2025, sec. 2.3.3), added to each scored sample's reward: within the
    group, lambda = 0.5 - (len - min len) / (max len - min len); a correct sample (reward >= correct_threshold)
    gets coef * lambda, any other coef * min(0, lambda). All lengths equal: 0."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["group_relative"] = "group_relative"
    coef: float = Field(1.0, gt=0)
    correct_threshold: float = 1.0  # a reward at or above it is a correct answer (rewards in [0, 1]: 1 = solved)


LengthPenalty = tagged_union((OverlongPenalty, GroupRelativeLengthPenalty), "length_penalty")
# The `length_penalty` setting of a group algorithm: off (None) by default, and then absent from the settings'
# dump, so the training identity of every run from before the setting is unchanged.
OptionalLengthPenalty = Annotated[Union[LengthPenalty, None],  # noqa: UP007
                                   Field(exclude_if=lambda value: value is None)]


def overlong_penalty(length: int, max_len: int, buffer: int, coef: float = 1.0) -> float:
    """DAPO: 0 for length <= max_len - buffer, -coef * (length - (max_len - buffer)) / buffer up to max_len,
    -coef beyond it."""
    excess = length - (max_len - buffer)
    if excess <= 0:
        return 0.0
    return -coef * min(excess / buffer, 1.0)


def group_relative_length_rewards(rewards: Sequence[float | None], lengths: Sequence[int], coef: float = 1.0,
                                  correct_threshold: float = 1.0) -> list[float | None]:
    """Kimi k1.5: coef * lambda for a correct sample, coef * min(0, lambda) otherwise, with lambda = 0.5 -
    (len - min len) / (max len - min len) over the group's scored samples; None for a sample whose reward is
    missing (it neither gets a length reward nor sets the group's range)."""
    scored = [length for reward, length in zip(rewards, lengths) if reward is not None]
    if not scored or max(scored) == min(scored):
        return [None if reward is None else 0.0 for reward in rewards]
    shortest, spread = min(scored), max(scored) - min(scored)
    shaped: list[float | None] = []
    for reward, length in zip(rewards, lengths):
        if reward is None:
            shaped.append(None)
            continue
        lam = 0.5 - (length - shortest) / spread
        shaped.append(coef * (lam if reward >= correct_threshold else min(0.0, lam)))
    return shaped


def length_penalties(group: Group, settings: OverlongPenalty | GroupRelativeLengthPenalty) -> list[float | None]:
    """What `settings` adds to each sample's reward (None where the reward is missing)."""
    if isinstance(settings, OverlongPenalty):
        return [None if reward is None else overlong_penalty(length, settings.max_len, settings.buffer, settings.coef)
                for reward, length in zip(group.rewards, group.completion_lengths)]
    if isinstance(settings, GroupRelativeLengthPenalty):
        return group_relative_length_rewards(group.rewards, group.completion_lengths, settings.coef,
                                             settings.correct_threshold)
    raise TypeError(f"unknown length penalty {type(settings).__name__}")


def with_length_penalty(group: Group, settings: OverlongPenalty | GroupRelativeLengthPenalty | None) -> Group:
    """The group with each scored sample's reward shaped by its completion length: applied before group
    normalisation, so the baseline (and std) are those of the shaped rewards. None: the group unchanged.

    Lengths are `completion_lengths`: every completion token, those an environment wrote in a multi-turn episode
    included."""
    if settings is None:
        return group
    shaped = [None if reward is None else reward + penalty
              for reward, penalty in zip(group.rewards, length_penalties(group, settings))]
    return replace(group, rewards=shaped)
