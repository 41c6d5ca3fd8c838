"""The two settings shapes every part of the library shares, in a module that imports nothing of rollout_lib: the
config package builds its algorithm union from the algorithm registry, and algorithms' settings (a teacher is a
frozen model, rollout_lib/serving/settings.py) need these without importing the config package back."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StrictModel(BaseModel):
    """Unknown keys are errors, never silently ignored; settings are immutable once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelRef(StrictModel):
    """Where a model comes from: a hub id, a local directory, `pkg:<python package>` (a model shipped inside an
    installed package), `tiny:qwen2` (the project's own tiny test model, built on first use), or a checkpoint of
    rollout's store: its id (64 hex digits) or a ref such as `runs/<name>/latest`."""

    uri: str = Field(min_length=1)
    gguf_file: str | None = None
    revision: str | None = None
    # The store a checkpoint reference is looked up in; an entry point fills in its run's store. A locator, not
    # what the model is: never dumped, so never part of a training identity (the checkpoint id is, through
    # model_content_digest).
    store: str | None = Field(None, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        # `base_model = "..."` (RM seed) and `[...base_model] uri = "..."` (SFT seed) are both the seed's shape.
        return {"uri": value} if isinstance(value, str) else value
