"""`rollout train rlhf` settings: three stage configs run as one pipeline, sft -> rm -> rl (flows/rlhf.py).

    [run]   name, store, storage_options: every stage trains in this store, under its own run name
            `<name>-<stage>-<first 8 hex of the stage's training identity>` (see `stage_run_name`)
    [sft]   config = "configs/sft-tiny.toml", overrides = ["key.path=value", ...]   (as `rollout train sft --set`)
    [rm]    config, overrides, start_from = "sft" (the SFT stage's checkpoint, classic RLHF; default)
                                          | "base_model" (the RM config's own base model)
    [rl]    config, overrides; the policy starts from the SFT stage's checkpoint
    [[rl.rm_rewards]]  env = "<env name>", weight = 1.0, keep_rewards = false, batch_size, max_length:
            the envs the RM stage's checkpoint rewards (default: every env, weight 1, instead of its own rewards)

A stage's overrides may set anything of its config (`run.seed` included) but what the pipeline sets: `run.name`,
`run.store`, `run.storage_options`, a base model taken from an earlier stage, and the rewards the RM replaces; the
error names the override.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator

from rollout_lib.config.common import EntryPointConfig, RunSettings, StrictModel, resolve_path
from rollout_lib.config.loading import apply_overrides, load_settings, parse_override, read_toml
from rollout_lib.config.rl import RlConfig, env_locator
from rollout_lib.config.rm import RmConfig
from rollout_lib.config.sft import SftConfig

STAGES = ("sft", "rm", "rl")
STAGE_CONFIGS: dict[str, type[EntryPointConfig]] = {"sft": SftConfig, "rm": RmConfig, "rl": RlConfig}
_IDENTITY_CHARS = 8


class RlhfRunSettings(StrictModel):
    """The pipeline's name and the store every stage shares. Seeds and thread counts stay per stage (their configs,
    or `run.seed=...` in a stage's overrides)."""

    name: str = "rlhf"
    # Validated when defaulted too: the stages get the store as an absolute path.
    store: str = Field(default_factory=RunSettings.model_fields["store"].default_factory, validate_default=True)
    storage_options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name", "store")
    @classmethod
    def _as_an_entry_point_run(cls, value: str, info: ValidationInfo) -> str:
        """The entry points' rules (a run name's spelling; a local store made absolute, so that every stage names
        the same place), kept in one place: RunSettings."""
        try:
            return getattr(RunSettings.model_validate({info.field_name: value}, context=info.context),
                           info.field_name)
        except ValidationError as exc:
            raise ValueError(exc.errors()[0]["msg"]) from None


class StageSettings(StrictModel):
    config: str = Field(min_length=1)  # the stage's TOML; relative to the pipeline config's project, as every path
    overrides: list[str] = Field(default_factory=list)  # "key.path=value", as `rollout train <stage> --set`

    @field_validator("config")
    @classmethod
    def _from_the_pipeline_config(cls, config: str, info: ValidationInfo) -> str:
        return resolve_path(config, info)

    @field_validator("overrides")
    @classmethod
    def _parseable(cls, overrides: list[str]) -> list[str]:
        for text in overrides:
            parse_override(text)  # a ConfigError (a ValueError): pydantic names the item
        return overrides

    def override_pairs(self) -> list[tuple[str, Any]]:
        return [(".".join(path), value) for path, value in map(parse_override, self.overrides)]


class RmStageSettings(StageSettings):
    # "sft": the reward model is the SFT checkpoint with a new score head (classic RLHF: it reads text as the policy
    # does; a causal-LM checkpoint loads as a sequence classifier). "base_model": the RM config's own base model,
    # so retraining SFT does not retrain the reward model.
    start_from: Literal["sft", "base_model"] = "sft"


class RmRewardSettings(StrictModel):
    """An env the RM stage's checkpoint rewards (an RL `{ reward_model = ... }` reward, config/rl.py)."""

    env: str = Field(min_length=1)
    weight: float = 1.0
    keep_rewards: bool = False  # true: beside the env's own rewards; false: instead of them (classic RLHF)
    batch_size: int | None = Field(None, ge=1)  # None: the reward model reward's defaults
    max_length: int | None = Field(None, ge=8)

    def reward(self, rm_checkpoint: str) -> dict[str, Any]:
        knobs = self.model_dump(include={"batch_size", "max_length"}, exclude_none=True)
        return {"reward_model": rm_checkpoint, "weight": self.weight, **knobs}


class RlStageSettings(StageSettings):
    rm_rewards: list[RmRewardSettings] | None = None  # None: every env, weight 1, instead of its own rewards

    @field_validator("rm_rewards")
    @classmethod
    def _each_env_once(cls, rm_rewards: list[RmRewardSettings] | None) -> list[RmRewardSettings] | None:
        names = [target.env for target in rm_rewards or []]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"names env {twice[0]!r} more than once")
        return rm_rewards


class RlhfConfig(StrictModel):
    run: RlhfRunSettings = RlhfRunSettings()
    sft: StageSettings
    rm: RmStageSettings
    rl: RlStageSettings

    def stage(self, stage: str) -> StageSettings:
        return getattr(self, stage)

    def stage_run_name(self, stage: str, identity: str) -> str:
        """A stage's run name. A run name holds one training (identity/claims.py), and a stage's training changes with
        any of its settings or with an earlier stage's checkpoint: naming it by its training identity gives every
        training of the stage its own name, and the same training always the same name (and cache)."""
        return f"{self.run.name}-{stage}-{identity[:_IDENTITY_CHARS]}"

    def stage_overrides(self, stage: str, *, sft_checkpoint: str | None = None,
                        rm_checkpoint: str | None = None) -> dict[str, Any]:
        """Everything a stage's config is loaded with, as {"key.path": value}: its own overrides, the pipeline's
        store, and the checkpoints of earlier stages (RM: the SFT checkpoint when it starts from SFT; RL: the SFT
        checkpoint as its base model and the RM checkpoint as the rewarded envs' reward). A checkpoint left None
        leaves the stage config's own setting (a plan made before the earlier stage has trained)."""
        overrides = dict(self.stage(stage).override_pairs())
        overrides["run.store"] = self.run.store
        overrides["run.storage_options"] = dict(self.run.storage_options)
        if stage == "rm" and self.rm.start_from == "sft" and sft_checkpoint is not None:
            overrides["algorithm.rm.base_model"] = sft_checkpoint
        if stage == "rl":
            if sft_checkpoint is not None:
                overrides["algorithm.rl.base_model"] = sft_checkpoint
            if rm_checkpoint is not None:
                overrides.update(self._rm_reward_overrides(rm_checkpoint))
        return overrides

    def stage_config(self, stage: str, *, sft_checkpoint: str | None = None, rm_checkpoint: str | None = None):
        """The stage's validated settings (its run name not yet chosen: it follows from them)."""
        overrides = self.stage_overrides(stage, sft_checkpoint=sft_checkpoint, rm_checkpoint=rm_checkpoint)
        return load_settings(STAGE_CONFIGS[stage], self.stage(stage).config, overrides)

    def rewarded_envs(self) -> list[tuple[int, RmRewardSettings]]:
        """(index in the RL config's envs, how the RM rewards it) for every env the RM stage rewards."""
        names = self._rl_env_names()
        targets = self.rl.rm_rewards if self.rl.rm_rewards is not None else [RmRewardSettings(env=n) for n in names]
        return [(names.index(target.env), target) for target in targets]

    def _rm_reward_overrides(self, rm_checkpoint: str) -> dict[str, Any]:
        envs = self._rl_raw()["algorithm"]["rl"]["envs"]
        return {env_locator(index, "rewards"):
                [*(envs[index].get("rewards", []) if target.keep_rewards else []), target.reward(rm_checkpoint)]
                for index, target in self.rewarded_envs()}

    def _rl_raw(self) -> dict:
        """The RL stage's TOML with its own overrides applied: the env list and rewards as the user wrote them."""
        return apply_overrides(read_toml(self.rl.config), dict(self.rl.override_pairs()))

    def _rl_env_names(self) -> list[str]:
        envs = self._rl_raw().get("algorithm", {}).get("rl", {}).get("envs", [])
        return [env.get("name") for env in envs if isinstance(env, dict)] if isinstance(envs, list) else []
