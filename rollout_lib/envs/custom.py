"""A user's interaction named by import path: `interaction = { type = "custom", import_path = "pkg.module:Class",
kwargs = {...}, max_turns = 4 }`.

The class is built as `Class(**kwargs)` and needs only the two methods of envs.base.Interaction: `start(prompt)`
(optional) and `respond(state, messages) -> EnvReply`. Its module's source enters the sample stage's cache key, so
editing the environment resamples."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rollout_lib.envs.base import EnvReply, Interaction, InteractionSettings
from rollout_lib.reward.locate import check_reference, import_reference

WHAT = "interaction class"


class CustomInteractionSettings(InteractionSettings):
    type: Literal["custom"] = "custom"
    import_path: str = Field(min_length=1)  # "package.module:Class"
    kwargs: dict[str, Any] = Field(default_factory=dict)  # the class's constructor arguments

    @model_validator(mode="after")
    def _found_without_running_it(self) -> "CustomInteractionSettings":
        check_reference(self.import_path, self.kwargs, what=WHAT)  # found and read, never imported at plan time
        return self

    def user_modules(self) -> tuple[str, ...]:
        return (self.import_path.partition(":")[0],)


class CustomInteraction(Interaction):
    type_name = "custom"
    settings_class = CustomInteractionSettings

    def __init__(self, settings: CustomInteractionSettings, tools=None):
        super().__init__(settings, tools)
        cls = import_reference(settings.import_path, what=WHAT)
        self.user = cls(**settings.kwargs)
        if not callable(getattr(self.user, "respond", None)):
            raise TypeError(f"{WHAT} {settings.import_path!r} has no respond(state, messages) method")

    @property
    def name(self) -> str:
        return type(self.user).__name__

    def start(self, prompt: dict[str, Any]) -> dict[str, Any]:
        start = getattr(self.user, "start", None)
        return start(prompt) if start is not None else {}

    def respond(self, state: dict[str, Any], messages: list[dict[str, str]]) -> EnvReply:
        return self.user.respond(state, messages)
