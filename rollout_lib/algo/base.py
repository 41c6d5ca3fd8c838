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

Adding an algorithm is adding a module: to this package, or to any installed distribution that declares it as an
entry point of the group "rollout.algorithms" (`plugins.py`). Its settings class (a subclass of `AlgoSettings`
with a literal `type`) and its `Algorithm` subclass register by their type name; the config's `algo` union is
built from the registry, so nothing else changes.

This package never imports `rollout_lib.config` (the config imports it, to build its `algo` union).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from rollout_lib.serving.frozen import FrozenModels

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
    frozen_models: FrozenModels | None = None
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
