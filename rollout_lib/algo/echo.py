"""echo: grpo on the policy's own turns, plus likelihood (ce) on what the environment wrote back.

In a multi-turn episode the environment's replies (tool results, feedback) are free supervision about the world the
policy acts in: echo trains the policy to predict them, each env message's content at its role's alpha, while the
policy's sampled tokens train under rl exactly as grpo (the components are normalised separately, so the
observation tokens never dilute the rl gradient). Defaults are the vetted setting: tool-result bodies at 0.1,
every other role untrained; setting `roles` replaces the whole table. Only the message's content trains, never the
template's framing around it (role headers, end-of-turn tokens), which the model would learn for free.

An optional filter (`filter = { import_path = "pkg.module:fn", kwargs = {...} }`, seed 002's contract:
`fn(rollout, **kwargs) -> list[list[bool]]`, one keep-mask per trajectory step) narrows the selection per rollout;
an env token is decided by the first step whose prompt holds it. The contract in full: docs/algorithms.md (echo).
Its module's source enters the advantages stage's cache key.
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
        if self.filter is None:
            return weights
        steps = trajectory_steps(rollout)
        masks = self.filter({**rollout, "trajectory_steps": steps}, **self.settings.filter.kwargs)
        self._check_masks(masks, steps, rollout["sample_id"])
        # Each env token is decided by the first step whose prompt holds it: the span that step's prompt adds.
        decided = [False] * len(weights)  # env tokens after the last step's turn: in no prompt, dropped
        previous_end = 0
        for step, mask in zip(steps, masks):
            offset = step["prompt_len"] - step["completion_start"]  # = len(prompt_ids)
            for position in range(previous_end, step["completion_start"]):
                decided[position] = mask[offset + position]
            previous_end = step["completion_end"]
        return [weight if kept else 0.0 for weight, kept in zip(weights, decided)]

    def _check_masks(self, masks: Any, steps: list[dict[str, int]], sample_id: str) -> None:
        named = f"{self.where}.filter: {WHAT} {self.settings.filter.import_path!r}"
        lengths = [step["prompt_len"] + step["completion_end"] - step["completion_start"] for step in steps]
        if not isinstance(masks, (list, tuple)):
            got = type(masks).__name__
        elif not all(isinstance(mask, (list, tuple)) for mask in masks):
            got = f"{len(masks)} entries, not all lists of bools"
        else:
            got = f"{len(masks)} keep-masks of lengths {[len(mask) for mask in masks]}"
            if [len(mask) for mask in masks] == lengths:
                for index, mask in enumerate(masks):
                    if not all(isinstance(value, bool) for value in mask):
                        raise ValueError(f"{named}: the keep-mask of trajectory step {index} of sample "
                                         f"{sample_id!r} holds a non-bool")
                return
        raise ValueError(f"{named} returned {got} for sample {sample_id!r}; expected {len(lengths)} keep-masks (one "
                         f"per trajectory step, each over its prompt_ids + completion_ids) of lengths {lengths}")


def trajectory_steps(rollout: dict[str, Any]) -> list[dict[str, int]]:
    """One span per model call of a ROLLOUTS row: its sampled turn is completion_ids[completion_start:
    completion_end], its prompt the row's prompt_ids + completion_ids[:completion_start] (prompt_len tokens). A
    single-turn rollout is one step."""
    n_prompt = len(rollout["prompt_ids"])
    turns = rollout["completion_turns"]
    if turns is None:
        return [{"prompt_len": n_prompt, "completion_start": 0, "completion_end": len(rollout["completion_ids"])}]
    return [{"prompt_len": n_prompt + turn["start"], "completion_start": turn["start"],
             "completion_end": turn["start"] + turn["length"]} for turn in turns if turn["sampled"]]
