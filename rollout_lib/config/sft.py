"""`rollout train sft` settings, in the SFT seed's TOML shape (`[algorithm.sft]`, `.base_model`, `.dataset`,
`.optimizer`, `.budget`, `.packing`, `.hardware`; `loss_on = { kind = ... }`).

Batching: `minibatch_size` examples make one optimizer step. With packing off they are split into
`gradient_accumulation` micro-batches of `minibatch_size / gradient_accumulation` sequences, padded at collate
time; with packing on they are packed into micro-batches of at most `packing.max_seq_len` tokens without padding
(the packer decides how many). Rows longer than `packing.max_seq_len` are truncated in both modes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from rollout_lib.adapters import AdapterSettings
from rollout_lib.config.common import (
    BudgetSettings,
    EntryPointConfig,
    HardwareSettings,
    DatasetSource,
    ModelRef,
    existing_path,
    OptimizerSettings,
    StrictModel,
)


class LossOn(StrictModel):
    """Which tokens the loss trains on: `assistant_only` (every assistant turn, including its end-of-turn
    token; the vetted default) or `all` (every token after the first)."""

    kind: Literal["assistant_only", "all"] = "assistant_only"

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        # `loss_on = "all"` reads as naturally as the seed's `loss_on = { kind = "all" }`.
        return {"kind": value} if isinstance(value, str) else value


class PackingSettings(StrictModel):
    kind: Literal["off", "on"] = "off"
    max_seq_len: int = Field(2048, ge=2)  # truncation length; with packing on also the micro-batch capacity


class SftSettings(StrictModel):
    base_model: ModelRef
    minibatch_size: int = Field(ge=1)  # examples per optimizer step
    gradient_accumulation: int = Field(1, ge=1)  # micro-batches per step (packing off)
    loss_on: LossOn = LossOn()
    packing: PackingSettings = PackingSettings()
    checkpoint_interval: int = Field(50, ge=1)  # a snapshot every N steps (and at the last step)
    optimizer: OptimizerSettings
    budget: BudgetSettings
    dataset: DatasetSource
    eval_dataset: DatasetSource | None = None  # held-out examples: loss per trained token before and after
    hardware: HardwareSettings = HardwareSettings()  # device, precision, gradient checkpointing (docs/hardware.md)
    # A LoRA adapter trained instead of every weight (adapters.py, docs/scale.md). None: full fine-tuning, and then
    # absent from the settings' dump, so identities from before the setting stay.
    adapter: AdapterSettings | None = Field(None, exclude_if=lambda value: value is None)
    # A chat template (.jinja) that renders the examples instead of the base model's tokenizer's own (one that
    # renders tools, for data with tool calls: configs/templates/chatml-tools.jinja), and that the checkpoints are
    # saved with. Its content is in the training identity; None: absent from the settings' dump, so identities from
    # before the setting stay.
    chat_template: str | None = Field(None, exclude_if=lambda value: value is None)

    @field_validator("chat_template")
    @classmethod
    def _template_from_the_config(cls, path: str | None, info: ValidationInfo) -> str | None:
        return None if path is None else existing_path(path, info, what="chat template")

    @property
    def packed(self) -> bool:
        return self.packing.kind == "on"

    def loss_kwargs(self) -> dict:
        """Settings of the rl/ref_kl loss components: SFT trains ce only."""
        return {}

    @property
    def sequences_per_micro_batch(self) -> int:
        """Packing off: how many sequences one padded micro-batch holds."""
        return self.minibatch_size // self.gradient_accumulation


class SftAlgorithm(StrictModel):
    kind: Literal["sft"] = "sft"
    sft: SftSettings


class SftConfig(EntryPointConfig):
    algorithm: SftAlgorithm
