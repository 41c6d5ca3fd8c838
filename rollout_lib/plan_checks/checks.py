"""The plan checks of every entry point, by its kind: (dotted locator, problem) pairs found before any model loads
(the seed's validate_plan): those every entry point shares (an adapter that matches nothing in its base model, GPUs
the trainer and the served models cannot take as set), SFT's, RM's, RL's (rl.py) and RLHF's; and the warnings of
settings that run but are probably not what was meant."""

from __future__ import annotations

from rollout_lib.config.rl import RlConfig, env_locator
from rollout_lib.config.rlhf import STAGES, RlhfConfig
from rollout_lib.errors import FILE, ConfigError
from rollout_lib.hardware import hardware_settings, placement_problems
from rollout_lib.plan_checks.rl import rl_problems, rl_warnings

# Stands in for a checkpoint an earlier stage has not trained yet, where a stage's settings are only checked (a
# checkpoint id is never looked up at validation).
_NOT_TRAINED_YET = "0" * 64
# Settings of every stage the pipeline sets; a stage override may not touch them (run.seed and run.torch_threads
# stay the stage's own).
PIPELINE_SETS = {
    "run.name": "each stage runs under <run.name>-<stage>-<its training identity>",
    "run.store": "every stage trains in the pipeline's [run] store",
    "run.storage_options": "every stage trains in the pipeline's [run] store",
}


def plan_problems(config) -> list[tuple[str, str]]:
    if isinstance(config, RlhfConfig):
        return _rlhf_problems(config)
    by_kind = {"rl": rl_problems, "sft": _sft_problems, "rm": _rm_problems}[config.algorithm.kind]
    return common_problems(config) + by_kind(config)


def plan_warnings(config) -> list[tuple[str, str]]:
    return rl_warnings(config) if isinstance(config, RlConfig) else []


def common_problems(config) -> list[tuple[str, str]]:
    """The checks of every entry point: its adapter, then its GPU placement (hardware.placement_problems) beside the
    models it serves on this node (RL's policy, and the frozen and reward models rollout serves)."""
    served = served_gpus(config) if config.algorithm.kind == "rl" else []
    return adapter_problems(config) + placement_problems(config.hardware_locator, hardware_settings(config.settings),
                                                         served)


def served_gpus(config) -> list[tuple[str, list[int] | None]]:
    """(locator of its gpus, gpus) of each server an RL run starts on this node: the policy's, each frozen model
    rollout serves (teachers, sampling sources, judges) and each reward model it serves; a model named twice alike
    is one deployment, counted once."""
    from rollout_lib.serving.settings import ServedModel

    served = [("algorithm.rl.policy_sampler.gpus", getattr(config.settings.policy_sampler, "gpus", None))]
    seen = set()
    frozen = [(where, model, model.model_dump_json()) for where, model in config.frozen_models()
              if isinstance(model, ServedModel)]
    rewards = [(where.removesuffix(".reward_model"), reward, reward.model_dump_json())
               for where, reward in config.served_reward_models() if reward.base_url is None]
    for where, settings, key in frozen + rewards:
        if settings.gpus is not None and key not in seen:
            seen.add(key)
            served.append((f"{where}.gpus", settings.gpus))
    return served


def adapter_problems(config) -> list[tuple[str, str]]:
    """An adapter whose target modules match nothing in the base model, found from the base's config.json alone (a
    skeleton on the meta device) where it is at hand; else the trainer's build reports it."""
    settings = config.settings
    adapter = getattr(settings, "adapter", None)
    if adapter is None:
        return []
    from rollout_lib.adapters import target_problem
    from rollout_lib.model.loading import model_skeleton

    skeleton = model_skeleton(settings.base_model, reward_model=config.algorithm.kind == "rm")
    problem = target_problem(skeleton, adapter) if skeleton is not None else None
    return [] if problem is None else [(f"algorithm.{config.algorithm.kind}.adapter.target_modules", problem)]


def _sft_problems(config) -> list[tuple[str, str]]:
    settings = config.settings
    if settings.packed and settings.gradient_accumulation != 1:
        return [("algorithm.sft.gradient_accumulation",
                 "must be 1 with packing on: the packer forms the micro-batches (at most packing.max_seq_len tokens "
                 f"each) from the step's {settings.minibatch_size} examples")]
    if settings.minibatch_size % settings.gradient_accumulation:
        return [("algorithm.sft.gradient_accumulation",
                 f"must divide minibatch_size ({settings.minibatch_size}) so that every micro-batch holds as many "
                 f"examples (got {settings.gradient_accumulation})")]
    return []


def _rm_problems(config) -> list[tuple[str, str]]:
    if config.settings.head == "pairwise_logistic" and config.settings.center_rewards_coefficient:
        return [("algorithm.rm.center_rewards_coefficient", "centres bradley_terry's rewards; "
                 "pairwise_logistic scores a pair, not a response: leave it 0")]
    return []


def _reserved(config: RlhfConfig, stage: str) -> dict[str, str]:
    """Setting -> why the pipeline sets it, for the stage's overrides."""
    reserved = dict(PIPELINE_SETS)
    if stage == "rm" and config.rm.start_from == "sft":
        reserved["algorithm.rm.base_model"] = "the RM starts from the SFT stage's checkpoint (rm.start_from)"
    if stage == "rl":
        reserved["algorithm.rl.base_model"] = "the policy starts from the SFT stage's checkpoint"
    return reserved


def _rlhf_problems(config: RlhfConfig) -> list[tuple[str, str]]:
    """Every stage's settings, checked before the first stage trains: overrides that fight the pipeline, rewarded
    envs the RL config lacks, and each stage config's own errors."""
    problems = []
    for stage in STAGES:
        for index, (key, _) in enumerate(config.stage(stage).override_pairs()):
            why = next((why for setting, why in _reserved(config, stage).items() if _touches(key, setting)), None)
            if why is not None:
                problems.append((f"{stage}.overrides[{index}]", f"sets {key}, which the pipeline sets: {why}"))
    if problems:
        return problems
    try:
        names = config._rl_env_names()
    except ConfigError as exc:
        return _stage_problems("rl", exc)
    for index, target in enumerate(config.rl.rm_rewards or []):
        if target.env not in names:
            known = ", ".join(map(str, names)) or "none"
            problems.append((f"rl.rm_rewards[{index}].env",
                             f"no env {target.env!r} in {config.rl.config} (its envs: {known})"))
    if problems:
        return problems
    for index, target in config.rewarded_envs():
        if target.keep_rewards:
            continue
        why = f"the RM checkpoint replaces the rewards of env {target.env!r} (rl.rm_rewards: keep_rewards = false)"
        for o_index, (key, _) in enumerate(config.rl.override_pairs()):
            if _touches(key, env_locator(index, "rewards")):
                problems.append((f"rl.overrides[{o_index}]", f"sets {key}, but {why}"))
    if problems:
        return problems
    for stage in STAGES:
        try:
            stage_config = config.stage_config(stage, sft_checkpoint=_NOT_TRAINED_YET, rm_checkpoint=_NOT_TRAINED_YET)
            stage_problems = plan_problems(stage_config)
            if stage_problems:
                raise ConfigError(stage_problems, config.stage(stage).config)
        except ConfigError as exc:
            problems.extend(_stage_problems(stage, exc))
    return problems


def _stage_problems(stage: str, exc: ConfigError) -> list[tuple[str, str]]:
    """A stage config's errors under the stage's name: a file that cannot be read as `<stage>.config`, a setting as
    `<stage>: <its file>: <its locator>`."""
    source = f"{exc.source}: " if exc.source else ""
    return [(f"{stage}.config", f"{source}{message}") if where == FILE else
            (stage, f"{source}{where}: {message}") for where, message in exc.problems]


def _touches(key: str, setting: str) -> bool:
    """Whether an override of `key` writes `setting` or part of it (or a table holding it)."""
    return any(longer == shorter or longer.startswith((f"{shorter}.", f"{shorter}["))
               for longer, shorter in ((key, setting), (setting, key)))
