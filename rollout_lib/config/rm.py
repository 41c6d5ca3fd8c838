"""`rollout train rm` settings, in the RM seed's TOML shape (`[algorithm.rm]`, `.optimizer`, `.budget`, `.dataset`,
`.hardware`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from rollout_lib.adapters import AdapterSettings
from rollout_lib.config.common import (
    BudgetSettings,
    EntryPointConfig,
    HardwareSettings,
    DatasetSource,
    ModelRef,
    OptimizerSettings,
    StrictModel,
)

RM_HEADS = ("bradley_terry", "pairwise_logistic")


class RmSettings(StrictModel):
    base_model: ModelRef
    head: str = "bradley_terry"  # or "pairwise_logistic": both responses in one input (rm/heads.py)
    minibatch_size: int = Field(ge=1)  # preference pairs per optimizer step
    max_seq_len: int = Field(256, ge=8)
    center_rewards_coefficient: float = Field(0.0, ge=0)
    checkpoint_interval: int = Field(50, ge=1)  # a snapshot every N steps (and at the last step)
    eval_batch_size: int = Field(32, ge=1)
    optimizer: OptimizerSettings
    budget: BudgetSettings
    dataset: DatasetSource
    eval_dataset: DatasetSource | None = None  # held-out pairs: accuracy before and after training
    hardware: HardwareSettings = HardwareSettings()  # device, precision, gradient checkpointing (docs/hardware.md)
    # A LoRA adapter trained instead of every weight (adapters.py, docs/scale.md). None: full fine-tuning, and then
    # absent from the settings' dump, so identities from before the setting stay.
    adapter: AdapterSettings | None = Field(None, exclude_if=lambda value: value is None)

    @field_validator("head")
    @classmethod
    def _known_head(cls, head: str) -> str:
        if head not in RM_HEADS:
            raise ValueError(f"unknown head {head!r}; heads that exist: {', '.join(RM_HEADS)}")
        return head


class RmAlgorithm(StrictModel):
    kind: Literal["rm"] = "rm"
    rm: RmSettings


class RmConfig(EntryPointConfig):
    algorithm: RmAlgorithm
