"""A user's advantage function named by import path: per-token credit of the user's making, the rl component on
completion tokens."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, model_validator

from rollout_lib.algo.base import Algorithm, AlgorithmResources, AlgoSettings, Group
from rollout_lib.reward.locate import check_reference, import_reference

WHAT = "advantage function"


class CustomSettings(AlgoSettings):
    type: Literal["custom"] = "custom"
    import_path: str = Field(min_length=1)  # "package.module:function"
    kwargs: dict[str, Any] = Field(default_factory=dict)  # passed to the function as keyword arguments

    @model_validator(mode="after")
    def _found_without_running_it(self) -> "CustomSettings":
        # Plan time: the module is found and its source read, never imported (its top-level code may do anything).
        check_reference(self.import_path, self.kwargs, what=WHAT)
        return self

    def user_modules(self) -> tuple[str, ...]:
        return (self.import_path.partition(":")[0],)


class Custom(Algorithm):
    """advantages = function(group, **kwargs): one list of per-token advantages per sample, len = its completion.

    The function gets the `Group` (rewards, None where missing; completion lengths; `present`, `per_sample` and
    `broadcast` helpers) and returns, per sample, a list of floats or None for no rl credit. It is sync, and runs
    in the advantages stage, where its module is first imported."""

    type_name = "custom"
    settings_class = CustomSettings

    def __init__(self, settings: CustomSettings, resources: AlgorithmResources | None = None, where: str = "algo"):
        super().__init__(settings, resources, where)
        self.function = import_reference(settings.import_path, what=WHAT)
        if not callable(self.function):
            raise ValueError(f"{where}: {WHAT} {settings.import_path!r} is not callable")
        if inspect.iscoroutinefunction(self.function):
            raise ValueError(f"{where}: {WHAT} {settings.import_path!r} is async; advantage functions are sync")

    def assign(self, group: Group) -> list[list[float] | None]:
        returned = self.function(group, **self.settings.kwargs)
        named = f"{self.where}: {WHAT} {self.settings.import_path!r}"
        if isinstance(returned, (str, bytes)) or not isinstance(returned, Sequence) or len(returned) != len(
                group.rewards):
            count = len(returned) if isinstance(returned, Sequence) else type(returned).__name__
            raise ValueError(f"{named} returned {count} rows for a group of {len(group.rewards)} samples; "
                             "expected one list of per-token advantages (or None) per sample")
        checked: list[list[float] | None] = []
        for index, (values, length) in enumerate(zip(returned, group.completion_lengths)):
            if values is None:
                checked.append(None)
                continue
            try:
                values = [float(value) for value in values]  # lists, tuples, numpy arrays
            except TypeError:
                raise ValueError(f"{named} returned a {type(values).__name__} for sample {index}; expected a list "
                                 f"of {length} floats (one per completion token) or None") from None
            if len(values) != length:
                raise ValueError(f"{named} returned {len(values)} advantages for sample {index}, which has "
                                 f"{length} completion tokens")
            checked.append(values)
        return checked
