"""Settings blocks shared by every entry point (optimizer, budget, datasets, model references, run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StrictModel(BaseModel):
    """Unknown keys are errors, never silently ignored; settings are immutable once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RunSettings(StrictModel):
    name: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    seed: int = 42
    # Any fsspec URL: a local directory (default), memory://..., s3://bucket/prefix.
    store: str = ".rollout/store"
    storage_options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("store")
    @classmethod
    def _absolute_local_store(cls, store: str) -> str:
        # A relative local root would point somewhere else from another working directory (a worker, a test);
        # made absolute once, at validation, it names one place in every cache key that carries it.
        return store if "://" in store else str(Path(store).expanduser().resolve())


class ModelRef(StrictModel):
    """Where a model comes from: a hub id, a local directory, `pkg:<python package>` (a model shipped inside an
    installed package), or `tiny:qwen2` (the project's own tiny test model, built on first use)."""

    uri: str = Field(min_length=1)
    gguf_file: str | None = None
    revision: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        # `base_model = "..."` (RM seed) and `[...base_model] uri = "..."` (SFT seed) are both the seed's shape.
        return {"uri": value} if isinstance(value, str) else value


class OptimizerSettings(StrictModel):
    kind: Literal["sgd", "adamw"] = "adamw"
    lr: float = Field(gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    momentum: float = Field(0.0, ge=0, lt=1)  # sgd only
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)  # floor of linear/cosine decay, as a fraction of lr
    max_grad_norm: float | None = Field(1.0, gt=0)  # gradient clipping; None disables it

    @model_validator(mode="after")
    def _betas_in_range(self) -> "OptimizerSettings":
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must each be in [0, 1) (got {list(self.betas)})")
        return self


class BudgetSettings(StrictModel):
    max_steps: int = Field(ge=1)


class JsonlDataset(StrictModel):
    """A JSONL file. The RM seed spells the tag `type`, the SFT seed `kind`; both are accepted, as one key."""

    type: Literal["jsonl_path"] = "jsonl_path"
    path: str = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _kind_or_type(cls, value: Any) -> Any:
        if isinstance(value, dict) and "kind" in value:
            if "type" in value:
                raise ValueError("give either `type` or `kind`, not both")
            value = {**value, "type": value["kind"]}
            del value["kind"]
        return value


class EntryPointConfig(StrictModel):
    """The settings of one entry point: `[run]` and `[algorithm.<kind>]`. A subclass declares `algorithm` (a model
    with `kind` and a field of that name holding the entry point's settings)."""

    run: RunSettings = RunSettings()

    @property
    def settings(self):
        """The entry point's own settings block (`algorithm.rm`, `algorithm.sft`, `algorithm.rl`)."""
        return getattr(self.algorithm, self.algorithm.kind)

    def plan_problems(self) -> list[tuple[str, str]]:
        """The seed's validate_plan: (dotted locator, problem) pairs found at plan time, before any model loads."""
        return []
