"""echo: grpo on the policy's own turns, plus likelihood (ce) on what the environment wrote back.

In a multi-turn episode the environment's replies (tool results, feedback) are free supervision about the world the
policy acts in: echo trains the policy to predict them, each env message's content at its role's alpha, while the
policy's sampled tokens train under rl exactly as grpo (the components are normalised separately, so the
observation tokens never dilute the rl gradient). Defaults are the vetted setting: tool-result bodies at 0.1,
every other role untrained; setting `roles` replaces the whole table. Only the message's content trains, never the
template's framing around it (role headers, end-of-turn tokens), which the model would learn for free.

An optional filter (`filter = { import_path = "pkg.module:fn", kwargs = {...} }`) narrows the selection per
rollout: `fn(rollout, **kwargs)` gets the ROLLOUTS row as a dict (completion_ids, completion_turns with each
segment's role and content, sampling_logprobs, episode, info, ...) and returns one bool per completion token;
False drops that token's ce weight. Its module's source enters the advantages stage's cache key.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

from pydantic import Field, model_validator

from rollout_lib.algo.base import AlgorithmResources
from rollout_lib.algo.grpo import Grpo, GrpoSettings
from rollout_lib.reward.locate import check_reference, import_reference
from rollout_lib.settings_base import StrictModel

WHAT = "echo filter"


class RoleWeight(StrictModel):
    alpha: float = Field(gt=0)  # the ce weight of each content token of a message in this role


class UserFunction(StrictModel):
    import_path: str = Field(min_length=1)  # "package.module:function"
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _found_without_running_it(self) -> "UserFunction":
        check_reference(self.import_path, self.kwargs, what=WHAT)
        return self


class EchoSettings(GrpoSettings):
    type: Literal["echo"] = "echo"  # type: ignore[assignment]
    roles: dict[str, RoleWeight] = Field(default_factory=lambda: {"tool": RoleWeight(alpha=0.1)})
    filter: UserFunction | None = None

    def user_modules(self) -> tuple[str, ...]:
        return (self.filter.import_path.partition(":")[0],) if self.filter is not None else ()


class Echo(Grpo):
    """rl on sampled tokens (grpo's advantages); ce_weight = roles[role].alpha on the content tokens of every
    message the environment wrote, times the filter's keep-mask."""

    type_name = "echo"
    settings_class = EchoSettings

    def __init__(self, settings: EchoSettings, resources: AlgorithmResources | None = None, where: str = "algo"):
        super().__init__(settings, resources, where)
        self.filter = None
        if settings.filter is not None:
            self.filter = import_reference(settings.filter.import_path, what=WHAT)
            if not callable(self.filter) or inspect.iscoroutinefunction(self.filter):
                raise ValueError(f"{where}.filter: {WHAT} {settings.filter.import_path!r} is not a sync function")

    def observation_weights(self, rollout: dict[str, Any]) -> list[float] | None:
        weights = [0.0] * len(rollout["completion_ids"])
        for turn in rollout["completion_turns"] or ():
            role = self.settings.roles.get(turn["role"])
            if turn["sampled"] or role is None:
                continue
            for position in range(turn["body_start"], turn["body_start"] + turn["body_length"]):
                weights[position] = role.alpha
        if self.filter is not None:
            keep = self.filter(rollout, **self.settings.filter.kwargs)
            named = f"{self.where}.filter: {WHAT} {self.settings.filter.import_path!r}"
            if not isinstance(keep, (list, tuple)) or len(keep) != len(weights):
                size = len(keep) if isinstance(keep, (list, tuple)) else type(keep).__name__
                raise ValueError(f"{named} returned {size} for sample {rollout['sample_id']!r}; expected a list of "
                                 f"{len(weights)} bools (one per completion token)")
            if not all(isinstance(value, bool) for value in keep):
                raise ValueError(f"{named}: the keep-mask of sample {rollout['sample_id']!r} holds a non-bool")
            weights = [weight if kept else 0.0 for weight, kept in zip(weights, keep)]
        return weights
